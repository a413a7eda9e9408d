"""POST /v1/messages (Anthropic's Messages API) through a real `conveyor serve` and Anthropic's
official client: the answer is the chat endpoint's for the same conversation, streamed as
its events, tool_use blocks (and tool_result blocks as the next turn's input), stop
sequences, count_tokens, the X-Api-Key header, and errors in Anthropic's envelope.

One server per module (the default model); greedy, few tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from server_fixtures import ServerProcess, metric_value, start_server, wait_idle

API_KEY = "test-key"
SYSTEM = "Answer in one short sentence."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # (this client's create takes no temperature)
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 30}},
               "required": ["city"], "additionalProperties": False}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    server = start_server("--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                          "--tool-call-parser", "hermes", "--api-key", API_KEY,
                          api_key=API_KEY)
    yield server
    assert server.stop() == 0, server.log_tail()
    server.remove_log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)


def test_a_message_is_the_chat_answer_to_the_same_conversation(server, client):
    chat = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY).chat.completions
    expected = chat.create(model=server.model, temperature=0, max_tokens=40,
                           messages=[{"role": "system", "content": SYSTEM}, *ASK])
    message = client.messages.create(model=server.model, max_tokens=40, system=SYSTEM,
                                     messages=ASK, **GREEDY)
    assert message.type == "message" and message.role == "assistant"
    (block,) = message.content
    assert block.type == "text" and block.text == expected.choices[0].message.content
    assert message.stop_reason == "end_turn"
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == expected.usage.prompt_tokens
    assert usage.cache_read_input_tokens > 0  # the chat request's blocks were reused
    assert usage.output_tokens == expected.usage.completion_tokens
    counted = client.messages.count_tokens(model=server.model, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == expected.usage.prompt_tokens
    short = client.messages.create(model=server.model, max_tokens=3, system=SYSTEM,
                                   messages=ASK, **GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    stopped = client.messages.create(model=server.model, max_tokens=40, system=SYSTEM,
                                     messages=ASK, stop_sequences=["Paris"], **GREEDY)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "Paris")
    assert stopped.content[0].text == block.text[:block.text.index("Paris")]


def test_a_final_assistant_message_is_continued(server, client):
    """Anthropic's prefill: the model goes on from the assistant's words, as the chat
    endpoint's continue_final_message does; count_tokens counts that prompt."""
    prefill = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    chat = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY).chat.completions
    expected = chat.create(model=server.model, temperature=0, max_tokens=8, messages=prefill,
                           extra_body={"continue_final_message": True,
                                       "add_generation_prompt": False})
    message = client.messages.create(model=server.model, max_tokens=8, messages=prefill,
                                     **GREEDY)
    assert message.content[0].text == expected.choices[0].message.content
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == expected.usage.prompt_tokens
    counted = client.messages.count_tokens(model=server.model, messages=prefill)
    assert counted.input_tokens == expected.usage.prompt_tokens


def test_a_streamed_message_is_the_apis_event_sequence(server, client):
    whole = client.messages.create(model=server.model, max_tokens=40, system=SYSTEM,
                                   messages=ASK, **GREEDY)
    with client.messages.stream(model=server.model, max_tokens=40, system=SYSTEM,
                                messages=ASK, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [e for e in events if e.type in ("message_start", "content_block_start",
                                            "content_block_delta", "content_block_stop",
                                            "message_delta", "message_stop")]
    kinds = [e.type for e in raw]
    deltas = [e for e in raw if e.type == "content_block_delta"]
    assert len(deltas) >= 2  # streamed, not sent whole
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] *
                     len(deltas), "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in deltas) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == whole.usage.output_tokens


def test_tool_use_blocks_and_tool_results(server, client):
    """A forced tool: its call as a tool_use block (streamed as input_json_delta pieces),
    then the call and its result as the next turn's input."""
    named = {"type": "tool", "name": "get_weather"}
    message = client.messages.create(model=server.model, max_tokens=60, tools=[WEATHER],
                                     tool_choice=named, messages=ASK_WEATHER, **GREEDY)
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input["city"]
    assert message.stop_reason == "tool_use"
    with client.messages.stream(model=server.model, max_tokens=60, tools=[WEATHER],
                                tool_choice=named, messages=ASK_WEATHER, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [e.delta.partial_json for e in events
              if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(pieces) >= 2 and final.content[0].input == call.input
    follow_up = client.messages.create(
        model=server.model, max_tokens=20, tools=[WEATHER], **GREEDY, messages=[
            *ASK_WEATHER,
            {"role": "assistant", "content": [{"type": "tool_use", "id": call.id,
                                               "name": call.name, "input": call.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": "21 C and sunny"}]}])
    assert follow_up.content[0].text
    without = client.messages.count_tokens(model=server.model, messages=ASK_WEATHER,
                                           tools=[WEATHER])
    assert follow_up.usage.input_tokens + follow_up.usage.cache_read_input_tokens > \
        without.input_tokens + 10  # the call and its result were rendered


def test_bodies_and_events_validate_against_the_clients_types(server):
    """Whole answers and every streamed event, raw, against Anthropic's client types (text,
    then a forced call)."""
    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    for body in ({"system": SYSTEM, "messages": ASK},
                 {"messages": ASK_WEATHER, "tools": [WEATHER],
                  "tool_choice": {"type": "any"}}):
        request = {"model": server.model, "max_tokens": 40, "temperature": 0, **body}
        Message.model_validate(_post(server, request).json())
        with httpx.stream("POST", server.base_url + "/v1/messages", timeout=60,
                          headers={"x-api-key": API_KEY},
                          json={**request, "stream": True}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ")]
        for event in events:
            adapter.validate_python(event)
        blocks = [(e["type"], e["index"]) for e in events
                  if e["type"] in ("content_block_start", "content_block_stop")]
        assert blocks and blocks == [(kind, i) for i in range(len(blocks) // 2)
                                     for kind in ("content_block_start", "content_block_stop")]


def _post(server: ServerProcess, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/messages", timeout=60,
                      headers={"x-api-key": API_KEY, **headers},
                      json={"model": server.model, "max_tokens": 8, "messages": ASK, **body})


@pytest.mark.parametrize(("body", "words"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "many words " * 600}]},
     "tokens > 1024 maximum"),
    ({"messages": []}, "messages"),
    ({"n": 2}, "n must be 1"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"temperature": -1}, "temperature"),
])
def test_bad_requests_are_400s_in_anthropics_envelope(server, body: dict[str, Any], words: str):
    response = _post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error


def test_the_api_key_comes_in_either_header(server):
    assert _post(server, {}).status_code == 200
    bearer = httpx.post(server.base_url + "/v1/messages", timeout=60,
                        headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"model": server.model, "max_tokens": 2, "messages": ASK})
    assert bearer.status_code == 200
    wrong = _post(server, {}, **{"x-api-key": "wrong"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    both = _post(server, {}, Authorization=f"Bearer {API_KEY}")  # two credentials: refused
    assert both.status_code == 401


def test_what_claude_code_sends(server, client):
    """Its model names (any is taken: one model is served), a max_tokens past the context
    (capped, as llama.cpp does), a billing line whose stamp changes every request (made
    constant: the prompt stays in the prefix cache), several text blocks and consecutive
    turns of one role (joined, as Anthropic joins them), an empty answer sent back."""
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37.0d9; "
                                       "cc_entrypoint=cli; cch=12345;"},
              {"type": "text", "text": "You are a careful assistant. " * 40}]
    first = Message.model_validate(_post(server, {  # (the client streams past 21,333 tokens)
        "model": "claude-sonnet-4-5-20250929", "max_tokens": 32000, "system": system,
        "temperature": 0}).json())
    assert first.model == server.model and first.stop_reason == "end_turn"
    system[0]["text"] = system[0]["text"].replace("cch=12345", "cch=9f8e7")
    again = client.messages.create(model="claude-haiku-4-5", max_tokens=4, system=system,
                                   messages=ASK, **GREEDY)
    total = again.usage.input_tokens + again.usage.cache_read_input_tokens
    assert again.usage.cache_read_input_tokens >= total - 16  # all but the last block
    split = [{"role": "user", "content": "Name a fruit."},
             {"role": "user", "content": [{"type": "text", "text": "Only one word."}]}]
    joined = [{"role": "user", "content": [{"type": "text", "text": "Name a fruit."},
                                           {"type": "text", "text": "Only one word."}]}]
    counts = [client.messages.count_tokens(model="claude-x", messages=m).input_tokens
              for m in (split, joined)]
    assert counts[0] == counts[1]
    empty = client.messages.create(model=server.model, max_tokens=8, messages=ASK,
                                   stop_sequences=[first.content[0].text.split()[0]], **GREEDY)
    assert empty.content[0].text == ""
    history = [*ASK, {"role": "assistant", "content": empty.content},
               {"role": "user", "content": "Please answer."}]
    assert client.messages.create(model=server.model, max_tokens=4, messages=history,
                                  system=SYSTEM, **GREEDY).content


def test_tool_errors_reach_the_model(server, client):
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                              "name": "get_weather", "input": {"city": "x"}}]}

    def count(is_error: bool) -> int:
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": is_error,
                  "content": [{"type": "text", "text": "no such city"}]}
        return client.messages.count_tokens(model=server.model, tools=[WEATHER], messages=[
            *ASK_WEATHER, call, {"role": "user", "content": [result]}]).input_tokens

    assert count(True) > count(False)  # ("Error: " before the text)


def test_a_failed_grammar_is_an_error_not_an_end_turn(server):
    """A grammar llguidance gives up on while generating: a 400 with the reason, or, streamed,
    an error event (Anthropic has no "error" stop reason)."""
    grammar = "start: r0\n" + "".join(f'r{i}: r{i} r{i} | r{i + 1} | "a" | "#"\n'
                                      for i in range(10)) + 'r10: "b"'
    body = {"max_tokens": 40, "messages": [{"role": "user", "content": "Letters:"}],
            "structured_outputs": {"grammar": grammar}, "temperature": 0}
    whole = _post(server, body)
    assert whole.status_code == 400 and "structured output failed" in whole.text
    with httpx.stream("POST", server.base_url + "/v1/messages", timeout=60,
                      headers={"x-api-key": API_KEY},
                      json={"model": server.model, **body, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ")]
    assert events[-1]["type"] == "error" and "message_delta" not in [e["type"] for e in events]


def test_the_server_is_idle_after_the_messages(server):
    metrics = wait_idle(server)
    assert metric_value(metrics, "conveyor:kv_cache_usage_perc") == 0
    assert metric_value(metrics, "conveyor:num_requests_running") == 0

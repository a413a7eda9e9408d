"""POST /v1/responses through a real `conveyor serve` and the official client's
`responses.create` / `responses.stream` / `responses.parse`: the answer is the chat
endpoint's for the same conversation, streamed as the API's typed events (numbered, each
item opened and closed, deltas that join to the text), function calls as items (and as
input on the next turn), text.format as a constraint, and 400s naming the field.

One server per module (the default model); greedy, few tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from server_fixtures import ServerProcess, metric_value, openai_client, serving, wait_idle

INSTRUCTIONS = "Answer in one short sentence."
QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 30}},
               "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving("--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                       "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


def _chat_text(client: openai.OpenAI, server: ServerProcess, max_tokens: int) -> Any:
    return client.chat.completions.create(
        model=server.model, temperature=0, max_tokens=max_tokens,
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "user", "content": QUESTION}])


def test_a_response_is_the_chat_answer_to_the_same_conversation(server, client):
    chat = _chat_text(client, server, 40)
    response = client.responses.create(model=server.model, input=QUESTION,
                                       instructions=INSTRUCTIONS, temperature=0,
                                       max_output_tokens=40, metadata={"run": "test"})
    assert response.status == "completed" and response.object == "response"
    assert response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + \
        response.usage.output_tokens
    assert (response.instructions, response.max_output_tokens, response.metadata) == \
        (INSTRUCTIONS, 40, {"run": "test"})
    short = client.responses.create(model=server.model, input=QUESTION, temperature=0,
                                    instructions=INSTRUCTIONS, max_output_tokens=3)
    assert short.status == "incomplete"
    assert short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 3


def test_a_streamed_response_is_the_apis_event_sequence(server, client):
    whole = client.responses.create(model=server.model, input=QUESTION, temperature=0,
                                    instructions=INSTRUCTIONS, max_output_tokens=40)
    with client.responses.stream(model=server.model, input=QUESTION, temperature=0,
                                 instructions=INSTRUCTIONS, max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2  # streamed, not sent whole
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] *
                     len(deltas), "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == final.output_text
    assert events[-2].item.content[0].text == text and events[-2].item.status == "completed"
    assert events[0].response.status == "in_progress" and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_function_calls_are_items_and_the_next_turns_input(server, client):
    """A named function: the call as an item, streamed as argument deltas; then the call and
    its output as input items of the next turn."""
    named = {"type": "function", "name": "get_weather"}
    response = client.responses.create(model=server.model, input="What is the weather in Paris?",
                                       tools=[WEATHER], tool_choice=named, temperature=0,
                                       max_output_tokens=60)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id and json.loads(call.arguments)["city"]
    with client.responses.stream(model=server.model, input="What is the weather in Paris?",
                                 tools=[WEATHER], tool_choice=named, temperature=0,
                                 max_output_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done.arguments == call.arguments == final.output[0].arguments
    follow_up = client.responses.create(
        model=server.model, tools=[WEATHER], temperature=0, max_output_tokens=20, input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id,
             "output": '{"temperature_c": 21}'}])
    assert follow_up.status in ("completed", "incomplete") and follow_up.output_text
    # The tool result reached the model: the same turn without it is another prompt.
    tokenized = httpx.post(server.base_url + "/tokenize", json={"messages": [
        {"role": "user", "content": "What is the weather in Paris?"}]}).json()
    assert follow_up.usage.input_tokens > tokenized["count"] + 10


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


def test_text_format_constrains_the_answer(server, client):
    parsed = client.responses.parse(model=server.model, input="Describe Paris as JSON.",
                                    text_format=City, temperature=0, max_output_tokens=80)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, City)
    assert City.model_validate_json(parsed.output_text) == parsed.output_parsed
    assert parsed.text.format.type == "json_schema"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "x " * 3000}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}},
     "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "top_logprobs": 3}, "top_logprobs"),
    ({"input": "hi", "n": 2}, "n"),
])
def test_bad_requests_are_400s_naming_the_field(server, body: dict[str, Any], param: str):
    response = httpx.post(server.base_url + "/v1/responses", timeout=60,
                          json={"model": server.model, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_the_server_is_idle_after_the_responses(server):
    metrics = wait_idle(server)
    assert metric_value(metrics, "conveyor:kv_cache_usage_perc") == 0
    assert metric_value(metrics, "conveyor:num_requests_running") == 0

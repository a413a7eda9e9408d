"""`--tool-call-parser llama3_json` (Llama 3.1-3.3's JSON calls) through a real `conveyor
serve` on the default model: forced calls in Llama's syntax, whole and streamed alike; an
"auto" answer whose text is a call (forced into that shape by a regex) read as one; an
earlier turn's calls and results sent back."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from server_fixtures import ServerProcess, openai_client, serving, wait_idle
from test_structured_server import ASK_WEATHER, TIME, WEATHER, _chat, _streamed


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving("--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                       "--tool-call-parser", "llama3_json")


CITY_CALL = r'\{"name": "get_weather", "parameters": \{"city": "[A-Z][a-z]{2,12}"\}\}'


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}, "auto"])
def test_llama3_calls_whole_and_streamed_agree(server: ServerProcess, tool_choice: object):
    body: dict[str, object] = {"tools": [WEATHER, TIME], "tool_choice": tool_choice,
                               "max_tokens": 64, "parallel_tool_calls": False}
    if tool_choice == "auto":  # the model's text, held to a call's shape
        body["structured_outputs"] = {"regex": CITY_CALL}
    choice = _chat(server, **body).json()["choices"][0]
    content, calls, finish = _streamed(server, **body)
    whole = choice["message"]
    assert content == whole["content"] is None
    assert calls == [(c["function"]["name"], c["function"]["arguments"])
                     for c in whole["tool_calls"]]
    assert finish == choice["finish_reason"] == \
        ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    if tool_choice == "auto":
        assert [name for name, _ in calls] == ["get_weather"]
        return
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for call in whole["tool_calls"]:
        name = call["function"]["name"]
        assert name == ("get_time" if isinstance(tool_choice, dict) else name)
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            tools[name]["function"]["parameters"])


def test_text_that_is_not_a_call_is_content(server: ServerProcess):
    body = {"tools": [WEATHER], "max_tokens": 8, "structured_outputs": {"regex": "Sunny[.]"}}
    message = _chat(server, **body).json()["choices"][0]["message"]
    assert message["content"] == "Sunny." and "tool_calls" not in message
    assert _streamed(server, **body)[0] == "Sunny."


def test_llama3_round_trip(server: ServerProcess):
    client = openai_client(server)
    first = client.chat.completions.create(model=server.model, messages=ASK_WEATHER,
                                           tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    messages = [*ASK_WEATHER, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model=server.model, messages=messages,
                                            tools=[WEATHER], temperature=0, max_tokens=8)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]
    wait_idle(server)

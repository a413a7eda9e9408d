"""POST /v1/responses through a real `conveyor serve` and the official client's
`responses.create` / `responses.stream` / `responses.parse`: the answer is the chat
endpoint's for the same conversation, streamed as the API's typed events (numbered, each
item opened and closed, deltas that join to the text), function calls as items (and as
input on the next turn), text.format as a constraint, and 400s naming the field.

One server per module (the default model); greedy, few tokens.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from server_fixtures import ServerProcess, metric_value, openai_client, serving, wait_idle

INSTRUCTIONS = "Answer in one short sentence."
QUESTION = "What is the capital of France?"
TIME = {"type": "function", "name": "get_time", "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                                   "maxLength": 30}},
                       "required": ["zone"], "additionalProperties": False}}
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


def _raw_events(server: ServerProcess, **body: Any) -> list[dict[str, Any]]:
    """A stream's events as sent, each validated against the official client's types."""
    events = []
    with httpx.stream("POST", server.base_url + "/v1/responses", timeout=60,
                      json={"model": server.model, "stream": True, **body}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)  # strict: every field the types require is there
    return events


def test_bodies_and_events_validate_against_the_clients_types(server):
    body = {"input": QUESTION, "instructions": INSTRUCTIONS, "max_output_tokens": 10,
            "temperature": 0, "tools": [WEATHER], "tool_choice": "auto"}
    whole = httpx.post(server.base_url + "/v1/responses", json={"model": server.model, **body},
                       timeout=60).json()
    Response.model_validate(whole)
    events = _raw_events(server, **body)
    final = events[-1]["response"]
    assert final.keys() == whole.keys()  # a streamed body has the same keys (nulls too)
    assert final["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]
    assert whole["tool_choice"] == "auto" and whole["text"] == {"format": {"type": "text"}}


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
    # Several calls: each item is done before the next is added
    kinds = [(e["type"], e.get("output_index")) for e in _raw_events(
        server, input="What is the weather in Paris and the time in Tokyo?", temperature=0,
        tools=[WEATHER, TIME], tool_choice="required", max_output_tokens=80)]
    opened = [i for kind, i in kinds if kind == "response.output_item.added"]
    assert opened == list(range(len(opened)))
    for i in opened[1:]:
        assert kinds.index(("response.output_item.done", i - 1)) < \
            kinds.index(("response.output_item.added", i))
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


def test_a_stream_that_fails_ends_with_response_failed():
    """An engine failure mid-stream: an error event, the item under way done as incomplete,
    then response.failed (clients wait for completed, incomplete or failed)."""
    from conveyor.engine.async_engine import RequestFailedError
    from conveyor.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from conveyor.server.output_plan import OutputPlan
    from conveyor.server.protocol import ResponseObject
    from conveyor.server.responses import _ResponseEvents

    async def failing() -> AsyncIterator[RequestOutput]:
        for text in ("Hel", "lo"):
            yield RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, [5])], False,
                                RequestMetrics(0.0, num_generation_tokens=1))
        raise RequestFailedError("r")

    async def events() -> list[dict[str, Any]]:
        stream = _ResponseEvents(ResponseObject(id="resp_1", status="in_progress", model="m"),
                                 OutputPlan(None, None, None))
        return [json.loads(e.split("data: ", 1)[1])
                async for e in stream.sse(failing(), "r")]  # type: ignore[arg-type]

    sent = asyncio.run(events())
    kinds = [e["type"] for e in sent]
    assert kinds[-5:] == ["error", "response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.failed"]
    assert sent[-2]["item"]["status"] == "incomplete"
    assert sent[-2]["item"]["content"][0]["text"] == "Hello"
    failed = sent[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    for event in sent:
        TypeAdapter(ResponseStreamEvent).validate_python(event)


@pytest.mark.parametrize("field", ["conversation", "prompt"])
def test_stored_conversations_and_prompts_are_400s(server, field: str):
    response = httpx.post(server.base_url + "/v1/responses", timeout=60, json={
        "model": server.model, "input": "hi", field: {"id": "x"}})
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_the_server_is_idle_after_the_responses(server):
    metrics = wait_idle(server)
    assert metric_value(metrics, "conveyor:kv_cache_usage_perc") == 0
    assert metric_value(metrics, "conveyor:num_requests_running") == 0

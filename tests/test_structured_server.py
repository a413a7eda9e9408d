"""Structured outputs and tool calling through a real `conveyor serve` and the official
client: every constrained output validates (jsonschema), the openai client's parse()
returns an object, tool calls stream as they are answered whole, and bad constraints are
400s that harm no other request.

One server per module (the default model); greedy, few tokens.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server_fixtures import ServerProcess, metric_value, openai_client, serving, wait_idle

# Generous for a small grammar; the compile-timeout test sends one that takes seconds.
COMPILE_TIMEOUT_S = 0.5
MAX_GRAMMAR_BYTES = 200_000

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 24},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array_enum": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                   "minItems": 2, "maxItems": 4}},
        "required": ["colors"], "additionalProperties": False},
    "any_of_numbers": {"type": "object", "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "count": {"type": "integer", "minimum": 1, "maximum": 99},
        "id": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "maxLength": 8}]}},
        "required": ["score", "count", "id"], "additionalProperties": False},
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
# Ambiguous (every split of a run of "a"s and "#"s parses, through 10 rules): it compiles
# at once, but its first mask, over tokens such as "#####...", needs more Earley items than
# llguidance's per-step limit (50,000), so llguidance gives up on it while generating.
FUEL_GRAMMAR = "start: r0\n" + "".join(f'r{i}: r{i} r{i} | r{i + 1} | "a" | "#"\n'
                                       for i in range(10)) + 'r10: "b"'


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving("--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                       "--tool-call-parser", "hermes",
                       "--grammar-compile-timeout", str(COMPILE_TIMEOUT_S),
                       "--max-grammar-bytes", str(MAX_GRAMMAR_BYTES))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


def _chat(server: ServerProcess, **body: object) -> httpx.Response:
    body = {"model": server.model, "messages": ASK_WEATHER, "temperature": 0, **body}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=600)


def _kv_free(server: ServerProcess) -> None:
    metrics = wait_idle(server)
    assert metric_value(metrics, "conveyor:kv_cache_usage_perc") == 0
    assert metric_value(metrics, "conveyor:num_requests_running") == 0


# ---------------------------------------------------------------------- constrained JSON
class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: float = Field(ge=0, le=50)
    kind: Literal["capital", "town"]


def test_openai_parse_returns_the_object(server: ServerProcess, client: openai.OpenAI):
    completion = client.chat.completions.parse(
        model=server.model, temperature=0, max_tokens=120, response_format=City,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City)
    assert City.model_validate_json(message.content) == message.parsed


def test_schemas_validate_batched_with_free_requests(server: ServerProcess):
    """Greedy and sampled, all at once with a free request whose output stays what it is
    alone; the tokens the schemas forced came as drafts (/stats counts them)."""
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                max_retries=0)
    free = {"model": server.model, "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "user", "content": "Tell me about the sea."}]}

    async def run() -> tuple[list, object, object]:
        alone = await client.chat.completions.create(**free)
        constrained = [client.chat.completions.create(
            model=server.model, max_tokens=150, seed=7, temperature=temperature,
            messages=[{"role": "user", "content": f"Give an example {name} JSON object."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": name, "schema": schema, "strict": True}})
            for name, schema in SCHEMAS.items() for temperature in (0.0, 1.0)]
        *outs, batched = await asyncio.gather(*constrained, client.chat.completions.create(**free))
        return outs, alone, batched

    before = httpx.get(server.base_url + "/stats").json()["grammar_forced_accepted_tokens"]
    outs, alone, batched = asyncio.run(run())
    assert batched.choices[0].message.content == alone.choices[0].message.content
    forced = httpx.get(server.base_url + "/stats").json()["grammar_forced_accepted_tokens"]
    assert forced - before > 0.2 * sum(o.usage.completion_tokens for o in outs)
    schemas = [schema for schema in SCHEMAS.values() for _ in (0, 1)]
    for out, schema in zip(outs, schemas, strict=True):
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    _kv_free(server)


def test_completions_regex_choice_and_aliases(server: ServerProcess, client: openai.OpenAI):
    prompt = "My phone number is"
    out = client.completions.create(model=server.model, prompt=prompt, max_tokens=20,
                                    temperature=0,
                                    extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert out.choices[0].finish_reason == "stop"
    assert len(out.choices[0].text) == 8 and out.choices[0].text[3] == "-"
    assert out.choices[0].text.replace("-", "").isdigit()
    for body in ({"guided_choice": ["yes", "no"]},
                 {"structured_outputs": {"choice": ["yes", "no"]}}):
        out = client.completions.create(model=server.model, prompt="Is water wet? Answer:",
                                        max_tokens=5, temperature=1.0, seed=3, extra_body=body)
        assert out.choices[0].text in ("yes", "no")
    grammar = 'root ::= "The answer is " ("red" | "blue") "."'
    out = client.completions.create(model=server.model, prompt="Q: a color? A:", max_tokens=20,
                                    temperature=0, extra_body={"guided_grammar": grammar})
    assert out.choices[0].text in ("The answer is red.", "The answer is blue.")
    out = client.completions.create(model=server.model, prompt="A JSON object:", max_tokens=60,
                                    temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text), dict)
    else:  # a max_tokens cut mid-object is "length", never "stop"
        assert out.choices[0].finish_reason == "length"


def test_logprobs_of_tokens_a_grammar_rules_out_are_numbers(server: ServerProcess):
    """Two choices leave fewer allowed tokens than top_logprobs asks for: the rest have
    -inf, which JSON cannot carry; they come as -9999.0 (vLLM's floor), not null."""
    choice = {"structured_outputs": {"choice": ["yes", "no"]}}
    chat = _chat(server, max_tokens=3, logprobs=True, top_logprobs=5, **choice).json()
    entries = chat["choices"][0]["logprobs"]["content"]
    values = [e["logprob"] for e in entries] + \
        [t["logprob"] for e in entries for t in e["top_logprobs"]]
    body = {"model": server.model, "prompt": "Is water wet? Answer:", "max_tokens": 3,
            "temperature": 0, "logprobs": 5, **choice}
    text = httpx.post(server.base_url + "/v1/completions", json=body, timeout=600).json()
    values += [v for top in text["choices"][0]["logprobs"]["top_logprobs"] for v in top.values()]
    assert all(isinstance(v, float) and v >= -9999.0 for v in values), values
    assert -9999.0 in values  # some were ruled out


def test_length_mid_structure_is_length(server: ServerProcess):
    r = _chat(server, max_tokens=3, response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}})
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", ["response_format.json_schema.schema", "strin"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "if": {"required": ["a"]}, "then": {}}}}},
     "response_format", ["Unimplemented", "if"]),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", ["structured_outputs.regex"]),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex", ["one"]),
    ({"structured_outputs": {"json": {"type": "object", "description": "x" * MAX_GRAMMAR_BYTES}}},
     "structured_outputs", ["max_grammar_bytes"]),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", ["nope"]),
    ({"tool_choice": "required"}, "tool_choice", ["tools"]),
    ({"min_tokens": 2, "response_format": {"type": "json_object"}}, "min_tokens",
     ["structured_outputs", "grammar decides"]),
])
def test_bad_constraints_are_400_naming_the_field(server: ServerProcess, body: dict,
                                                  param: str, words: list[str]):
    r = _chat(server, max_tokens=4, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    for word in words:
        assert word in error["message"]


def test_grammar_out_of_fuel_ends_with_error(server: ServerProcess, client: openai.OpenAI):
    """A grammar llguidance gives up on while generating (FUEL_GRAMMAR): finish_reason
    "error", not "stop"; a stream ends with the choice's "error" chunk, then an error event
    with the reason (the client raises it); the server goes on."""
    body = {"model": server.model, "prompt": "Letters:", "max_tokens": 40, "temperature": 0,
            "extra_body": {"structured_outputs": {"grammar": FUEL_GRAMMAR}}}
    whole = client.completions.create(**body)
    assert whole.choices[0].finish_reason == "error"
    chunks = []
    with pytest.raises(openai.APIError) as info:
        for chunk in client.completions.create(**body, stream=True):
            chunks.append(chunk)
    assert chunks[-1].choices[0].finish_reason == "error"
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert info.value.message.startswith("structured output failed: ")
    assert info.value.body["code"] == "structured_output_failed"
    metrics = wait_idle(server)
    assert metric_value(metrics, "conveyor:request_success_total", finished_reason="error") >= 2
    _kv_free(server)


def test_compile_timeout_is_400_and_harms_nobody(server: ServerProcess,
                                                 client: openai.OpenAI):
    # ~197 KB: 6,600 optional properties, whose compile time grows with their square (3.9 s
    # on an idle AMX Xeon, 8x the server's timeout; 2,100 anyOf properties with patterns
    # took 0.36 s there, under it)
    slow = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(6600)}}
    assert len(json.dumps(slow)) < MAX_GRAMMAR_BYTES

    async def run() -> tuple[httpx.Response, object]:
        async with httpx.AsyncClient(timeout=600) as http:
            bad = http.post(server.base_url + "/v1/chat/completions", json={
                "model": server.model, "messages": ASK_WEATHER, "max_tokens": 8,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "slow", "schema": slow}}})
            good = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                      max_retries=0).chat.completions.create(
                model=server.model, messages=ASK_WEATHER, max_tokens=8, temperature=0)
            return await asyncio.gather(bad, good)

    timeouts = httpx.get(server.base_url + "/stats").json()["grammar_compile_timeouts"]
    bad, good = asyncio.run(run())
    assert bad.status_code == 400 and "grammar_compile_timeout" in bad.json()["error"]["message"]
    # (/stats is the snapshot after the engine's latest step: one more request takes one)
    client.completions.create(model=server.model, prompt="Hi", max_tokens=1)
    assert httpx.get(server.base_url + "/stats").json()["grammar_compile_timeouts"] == timeouts + 1
    assert good.choices[0].finish_reason == "length" and good.choices[0].message.content
    assert httpx.get(server.base_url + "/health").status_code == 200
    _kv_free(server)


# ---------------------------------------------------------------------- tools
def _calls(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []]


def _streamed(server: ServerProcess, **body: object) -> tuple[str | None, list, str]:
    """(content, [(name, arguments text)], finish_reason) reassembled from a stream."""
    body = {"model": server.model, "messages": ASK_WEATHER, "temperature": 0, "stream": True,
            **body}
    content, calls, finish = None, {}, None
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body,
                      timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            if delta.get("content"):
                content = (content or "") + delta["content"]
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                if call.get("id"):  # (a parser's own ids: call_..., Mistral's 9 characters)
                    assert isinstance(call["id"], str) and len(call["id"]) >= 9
                fn = call.get("function") or {}
                entry["name"] += fn.get("name") or ""
                entry["arguments"] += fn.get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


def _whole_and_streamed(server: ServerProcess,
                        **body: object) -> tuple[dict, list[tuple[str, str]], str]:
    """The same request whole and streamed, checked to agree (content, every call's name and
    arguments text in order, finish_reason): the whole answer's choice, and the calls and
    finish_reason."""
    choice = _chat(server, **body).json()["choices"][0]
    content, calls, finish = _streamed(server, **body)
    whole = choice["message"]
    assert content == whole["content"]
    assert calls == [(c["function"]["name"], c["function"]["arguments"])
                     for c in whole.get("tool_calls", [])]  # left out when there are none
    assert finish == choice["finish_reason"]
    return choice, calls, finish


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}, "auto"])
def test_tool_calls_whole_and_streamed_agree(server: ServerProcess, tool_choice: object):
    # One call each (parallel calls would let the small model go on calling to max_tokens)
    body = {"tools": [WEATHER, TIME], "tool_choice": tool_choice, "max_tokens": 64,
            "parallel_tool_calls": False}
    message, _, _ = _whole_and_streamed(server, **body)
    whole = message["message"]
    if tool_choice == "auto":
        return  # the model may answer in text; what it did is the same either way
    # A named function's calls end with "stop", as OpenAI's and vLLM's do
    named = isinstance(tool_choice, dict)
    assert message["finish_reason"] == ("stop" if named else "tool_calls")
    assert whole["content"] is None
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for name, arguments in _calls(whole):
        assert name == "get_time" or tool_choice == "required"
        jsonschema.validate(arguments, tools[name]["function"]["parameters"])
        assert whole["tool_calls"][0]["id"].startswith("call_")


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_cut_short_are_never_content(server: ServerProcess, tool_choice: object):
    """A grammar-forced call that max_tokens ends before its name is written: no content
    (the call's markup leaked into it), whole or streamed; finish_reason "length"."""
    body = {"tools": [WEATHER, TIME], "tool_choice": tool_choice, "max_tokens": 3}
    choice, _, finish = _whole_and_streamed(server, **body)
    assert choice["message"]["content"] is None and finish == "length"


def test_tool_round_trip_with_the_client(server: ServerProcess, client: openai.OpenAI):
    first = client.chat.completions.create(model=server.model, messages=ASK_WEATHER,
                                           tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    messages = [*ASK_WEATHER, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id,
                 "content": json.dumps({"temperature": 21, "unit": "celsius"})}]
    prompt = httpx.post(server.base_url + "/tokenize",
                        json={"model": server.model, "messages": messages}).json()
    second = client.chat.completions.create(model=server.model, messages=messages,
                                            tools=[WEATHER], temperature=0, max_tokens=16)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert prompt["count"] > 0
    _kv_free(server)


def test_answer_without_calls_leaves_tool_calls_out(server: ServerProcess):
    message = _chat(server, max_tokens=4).json()["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"]  # as OpenAI's answers


def test_tool_call_arguments_stream_in_pieces(server: ServerProcess, client: openai.OpenAI):
    """The official client's stream: the call's id and name first, then its arguments in
    several deltas as the model writes them; concatenated, the non-streamed answer."""
    body = {"model": server.model, "messages": ASK_WEATHER, "tools": [WEATHER],
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
            "max_tokens": 60}  # one call (with parallel ones the model goes on to max_tokens)
    whole = client.chat.completions.create(**body).choices[0]
    heads, pieces, finish = {}, {}, None
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in heads and call.type == "function"
                    heads[call.index] = call.function.name
                pieces.setdefault(call.index, []).append(call.function.arguments or "")
            finish = choice.finish_reason or finish
    calls = whole.message.tool_calls
    assert [(heads[i], "".join(pieces[i])) for i in sorted(pieces)] == \
        [(c.function.name, c.function.arguments) for c in calls]
    assert finish == whole.finish_reason == "tool_calls"
    assert len([p for p in pieces[0] if p]) >= 4, pieces  # not one chunk per call
    jsonschema.validate(json.loads(calls[0].function.arguments),
                        WEATHER["function"]["parameters"])


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Shipment(BaseModel):
    to: Address
    weight_kg: int = Field(ge=1, le=99)


def test_tools_of_nested_models_resolve_their_refs(server: ServerProcess, client: openai.OpenAI):
    """openai.pydantic_function_tool of a nested model writes `$defs` and `$ref`s from the
    parameters' root, which the tool-call grammar nests: it hoists them (a 400 before)."""
    tool = openai.pydantic_function_tool(Shipment)
    assert "$defs" in tool["function"]["parameters"]
    ask = [{"role": "user", "content": "Ship 3 kg to Paris, France."}]
    for choice in ("required", {"type": "function", "function": {"name": "Shipment"}}):
        completion = client.chat.completions.parse(
            model=server.model, messages=ask, tools=[tool], tool_choice=choice,
            parallel_tool_calls=False, temperature=0, max_tokens=80)
        (call,) = completion.choices[0].message.tool_calls
        assert isinstance(call.function.parsed_arguments, Shipment)
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}},
        "$defs": {"Address": {"type": "string"}}}}}
    clash = _chat(server, messages=ask, tools=[tool, other], tool_choice="required")
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "tools"


def test_required_with_parallel_calls(server: ServerProcess):
    """tool_choice "required" with parallel_tool_calls: one or more calls, every finished
    one valid against its tool's schema (a last one cut by max_tokens is "length"),
    distinct ids, and the stream reassembles to the whole answer."""
    body = {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": True,
            "max_tokens": 100, "messages": [
                {"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]}
    choice, calls, finish = _whole_and_streamed(server, **body)
    whole = choice["message"]
    assert whole["content"] is None
    assert len({c["id"] for c in whole["tool_calls"]}) == len(calls) >= 1
    tools = {"get_weather": WEATHER, "get_time": TIME}
    finished = calls if finish == "tool_calls" else calls[:-1]
    assert finish in ("tool_calls", "length")
    for name, arguments in finished:
        jsonschema.validate(json.loads(arguments), tools[name]["function"]["parameters"])
    _kv_free(server)

"""`--tool-call-parser llama3_json` (Llama 3.1-3.3's JSON calls) and `mistral` through a real
`conveyor serve` on the default model: forced calls in each syntax, whole and streamed
alike; an "auto" answer whose text is a call (forced into that shape by a regex) read as
one; an earlier turn's calls and results sent back. And Mistral's tags as the special tokens
they are, on tiny random models."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from server_fixtures import ServerProcess, openai_client, serving, start_server, wait_idle
from test_structured_server import (
    ASK_WEATHER,
    TIME,
    WEATHER,
    _chat,
    _streamed,
    _whole_and_streamed,
)


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
    choice, calls, finish = _whole_and_streamed(server, **body)
    whole = choice["message"]
    assert whole["content"] is None and "tool_calls" in whole
    assert finish == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
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


@pytest.fixture(scope="module")
def mistral_server() -> Iterator[ServerProcess]:
    yield from serving("--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                       "--tool-call-parser", "mistral")


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}])
def test_mistral_calls_whole_and_streamed_agree(mistral_server: ServerProcess,
                                                tool_choice: object):
    body = {"tools": [WEATHER, TIME], "tool_choice": tool_choice, "max_tokens": 64,
            "parallel_tool_calls": False}
    whole = _whole_and_streamed(mistral_server, **body)[0]["message"]
    assert whole["content"] is None and "tool_calls" in whole
    for call in whole["tool_calls"]:  # Mistral's templates take no other ids
        assert len(call["id"]) == 9 and call["id"].isalnum()
        tools = {"get_weather": WEATHER, "get_time": TIME}
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            tools[call["function"]["name"]]["function"]["parameters"])
    wait_idle(mistral_server)


def _mistral_model(tmp_path_factory, tiny_tokenizer, v11: bool) -> Path:
    """A tiny random model whose vocabulary has Mistral's tags as special tokens."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from conftest import build_tiny_model

    source, _ = tiny_tokenizer
    folder = tmp_path_factory.mktemp("mistral-tokenizer")
    tok = HFTokenizer.from_file(str(source / "tokenizer.json"))
    tags = ["[TOOL_CALLS]", "[ARGS]"] if v11 else ["[TOOL_CALLS]"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tags])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}assistant: "
                               "{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return build_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), folder,
                            tok.get_vocab_size(), "llama")


@pytest.mark.parametrize("v11", [False, True])
def test_mistral_tags_as_special_tokens(tmp_path_factory, tiny_tokenizer, v11: bool):
    """[TOOL_CALLS] is a special token, which a text drops by default: with the mistral
    parser the request keeps it, and the call is read (in the form the vocabulary says)."""
    folder = _mistral_model(tmp_path_factory, tiny_tokenizer, v11)
    server = start_server("--model", str(folder), "--dtype", "float32", "--max-model-len",
                          "1024", "--kv-cache-memory", "4MiB", "--tool-call-parser", "mistral")
    try:
        body = {"tools": [TIME], "tool_choice": "required", "max_tokens": 60,
                "parallel_tool_calls": False,
                "temperature": 1.0, "seed": 3}
        answer = _chat(server, **body).json()
        assert "choices" in answer, answer
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None and choice["message"]["tool_calls"]
        assert _streamed(server, **body)[1] == [
            (c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"]["tool_calls"]]
        wait_idle(server)
    finally:
        assert server.stop() == 0, server.log_tail()
        server.remove_log()

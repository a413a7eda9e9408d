"""Hostile input over real HTTP: every bad request is a 4xx naming its field, a bug is an
opaque 500 logged once, and the per-request caps hold before any costly work.

One small `conveyor serve` for the module, with an API key and two faults injected into the
server process (an unknown-model check that raises, a logprobs formatter that raises), so
that the unexpected-exception paths run through the real app and its logging.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from server_fixtures import ServerProcess, start_server

API_KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256
# The model name that makes the injected check raise, and the text its exception carries:
# neither may reach the client.
FAULT_MODEL = "inject-internal-error"
SECRET = "SECRET-DETAIL-4242"
_INJECT = f"""
import conveyor.server.completions as completions

_check_model = completions.check_model

def _failing_check_model(state, model):
    if model == {FAULT_MODEL!r}:
        raise RuntimeError("injected failure: {SECRET}")
    _check_model(state, model)

def _failing_logprobs(*args, **kwargs):
    raise RuntimeError("injected failure in logprobs: {SECRET}")

completions.check_model = _failing_check_model
completions.completion_logprobs = _failing_logprobs
"""
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    server = start_server("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "16MiB",
                          "--api-key", API_KEY, api_key=API_KEY, setup=_INJECT)
    yield server
    assert server.stop() == 0, server.log_tail()
    server.remove_log()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _still_healthy(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
    assert ok.status_code == 200, ok.text


# ---------------------------------------------------------------------- finding 1
# Raw JSON bodies: "\ud800" is a lone surrogate once decoded (a client's json.dumps writes it).
SURROGATE_BODIES = [
    ("/v1/completions", '{"prompt": "abc\\ud800def", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "abc\\ud800"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "abc\\ud800", "max_tokens": 2, "stream": true}', "prompt"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "a\\udc00"}], "max_tokens": 2}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", '
     '"text": "a\\ud800"}]}], "max_tokens": 2, "stream": true}', "messages"),
    ("/tokenize", '{"prompt": "abc\\ud800def"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "a\\udc00"}]}', "messages"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_BODIES)
def test_lone_surrogate_is_a_400_naming_the_field(http: httpx.Client, path: str, body: str,
                                                  param: str):
    response = http.post(path, content=body.encode(),
                         headers={"content-type": "application/json"})
    error = _error(response)
    assert error["param"] == param and "not valid Unicode" in error["message"]
    assert http.get("/health").status_code == 200


# ---------------------------------------------------------------------- opaque 500s
def _wait_for_log(server: ServerProcess, needle: str, count: int) -> str:
    """The log once `needle` occurs `count` times (logging may lag the response a little)."""
    deadline = time.monotonic() + 10
    while True:
        log = server.log_tail(1_000_000)
        if log.count(needle) >= count or time.monotonic() > deadline:
            return log
        time.sleep(0.1)


def test_unexpected_exception_is_an_opaque_500_logged_once(server: ServerProcess,
                                                           http: httpx.Client):
    before = server.log_tail(1_000_000).count(SECRET)
    response = http.post("/v1/completions", json={"model": FAULT_MODEL, "prompt": "Hello"})
    error = _error(response, 500)
    request_id = response.headers["x-request-id"]
    assert error == {"message": f"internal error (request id {request_id})",
                     "type": "InternalServerError", "param": None, "code": None}
    assert SECRET not in response.text and "RuntimeError" not in response.text
    log = _wait_for_log(server, SECRET, before + 1)
    time.sleep(0.5)  # a second traceback would come at once; give it the chance to show
    log = server.log_tail(1_000_000)
    assert log.count(SECRET) == before + 1, log[-4000:]  # one traceback, not two
    assert f"internal error (request id {request_id})" in log
    _still_healthy(http)


def test_exception_mid_stream_is_an_opaque_error_event(server: ServerProcess,
                                                       http: httpx.Client):
    before = server.log_tail(1_000_000).count(SECRET)
    body = {"prompt": "Hello", "max_tokens": 3, "logprobs": 1, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2]) == {"error": {
        "message": f"internal error (request id {request_id})",
        "type": "InternalServerError", "param": None, "code": None}}
    assert not any(SECRET in e for e in events)
    _wait_for_log(server, SECRET, before + 1)
    time.sleep(0.5)
    assert server.log_tail(1_000_000).count(SECRET) == before + 1
    _still_healthy(http)


def test_every_response_has_a_request_id(server: ServerProcess, http: httpx.Client):
    ids = {http.get("/health").headers["x-request-id"],
           httpx.get(server.base_url + "/v1/models").headers["x-request-id"],  # a 401
           http.post("/v1/completions", json={"prompt": ""}).headers["x-request-id"]}
    assert len(ids) == 3 and all(len(i) == 32 for i in ids)
    response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert response.json()["id"] == "cmpl-" + response.headers["x-request-id"]


def test_a_clients_request_id_is_echoed_and_names_the_request(server: ServerProcess,
                                                              http: httpx.Client):
    given = {"X-Request-Id": "gateway-7f3a"}  # as a gateway or Ray Serve's proxy sends it
    response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                         headers=given)
    assert response.headers.get_list("x-request-id") == ["gateway-7f3a"]
    assert response.json()["id"] == "cmpl-gateway-7f3a"
    before = server.log_tail(1_000_000).count(SECRET)
    failed = http.post("/v1/completions", json={"model": FAULT_MODEL, "prompt": "Hello"},
                       headers=given)
    assert _error(failed, 500)["message"] == "internal error (request id gateway-7f3a)"
    assert "internal error (request id gateway-7f3a)" in _wait_for_log(server, SECRET,
                                                                      before + 1)
    # The same id again while the first is in flight (it cannot end early: no EOS, a long
    # budget): served too, as vLLM serves it (the engine's ids take a random suffix). The
    # line iterator is held: dropped, it would close the connection and abort the request.
    body = {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN // 2, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body, headers=given) as running:
        lines = running.iter_lines()
        first = next(lines)
        assert running.status_code == 200 and first.startswith("data: {"), first
        twin = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                         headers=given)
        assert twin.status_code == 200 and twin.json()["id"] == "cmpl-gateway-7f3a", twin.text
    for bad in ("has space", "x" * 129, "caf\u00e9"):
        refused = http.get("/health", headers={"X-Request-Id": bad.encode("utf-8")})
        assert _error(refused, 400)["param"] == "x-request-id"
        assert len(refused.headers.get_list("x-request-id")) == 1


# ---------------------------------------------------------------------- finding 3
def _bad_chat(client: openai.OpenAI, server: ServerProcess, **kwargs: object) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, max_tokens=2, **kwargs)
    return info.value.response.json()["error"]


def test_chat_rules_of_openai_and_vllm(server: ServerProcess, client: openai.OpenAI,
                                       http: httpx.Client):
    assert _bad_chat(client, server, messages=[])["param"] == "messages"
    error = _bad_chat(client, server, messages=[{"role": "wizard", "content": "hi"}])
    assert error["param"] == "messages"
    assert all(role in error["message"] for role in ("system", "user", "assistant", "tool"))
    error = _bad_chat(client, server, messages=CHAT, stream_options={"include_usage": True})
    assert error["param"] == "stream_options"
    tool_turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    # Tool turns render (issue 12); a tool_choice naming no tool is the client's error.
    answer = client.chat.completions.create(
        model=server.model, max_tokens=2,
        messages=[*CHAT, tool_turn, {"role": "tool", "tool_call_id": "call_1", "content": "4"}])
    assert answer.choices[0].message.content
    for call in ({"function": {}}, {"function": {"name": "", "arguments": "{}"}},
                 {"function": {"name": "f", "arguments": 3}}, "f()"):
        malformed = {"role": "assistant", "content": None, "tool_calls": [call]}
        error = _bad_chat(client, server, messages=[*CHAT, malformed])
        assert error["param"] == "messages" and "tool_calls" in error["message"], call
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    error = _bad_chat(client, server, messages=CHAT, tools=[tool],
                      tool_choice={"type": "function", "function": {"name": "g"}})
    assert error["param"] == "tool_choice" and "'g'" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt="Hi", max_tokens=2,
                                  stream_options={"include_usage": True})
    assert info.value.response.json()["error"]["param"] == "stream_options"
    _still_healthy(http)


BAD_BODIES = [
    b'{"prompt": "\xff\xfe", "max_tokens": 2}',  # not UTF-8
    b"[" * 100_000 + b"]" * 100_000,  # deeper than the JSON parser goes
    b"{not json",
    b"[1, 2]",  # JSON, not an object
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=["utf8", "deep", "json", "array"])
def test_malformed_body_is_a_400_on_body(http: httpx.Client, body: bytes):
    response = http.post("/v1/completions", content=body,
                         headers={"content-type": "application/json"})
    assert _error(response)["param"] == "body"
    assert http.get("/health").status_code == 200


def test_malformed_framing_is_refused_by_the_http_layer(server: ServerProcess,
                                                       http: httpx.Client):
    # h11 refuses a negative Content-Length before the app sees the request: uvicorn answers a
    # bare 400 and closes the connection (no OpenAI body is possible there); nothing else breaks.
    port = int(server.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\n\r\n")
        answer = conn.recv(4096)
    assert answer.startswith(b"HTTP/1.1 400 ")
    _still_healthy(http)


# ---------------------------------------------------------------------- finding 8: caps
def test_text_too_long_to_fit_is_refused_before_tokenizing(http: httpx.Client):
    huge = "x" * 2_000_000
    for path, body, param in [
        ("/v1/completions", {"prompt": huge, "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": ["Hi", huge], "max_tokens": 2}, "prompt"),
        ("/tokenize", {"prompt": huge}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": huge}]}, "messages"),
    ]:
        error = _error(http.post(path, json=body))
        assert error["param"] == param and "2000" in error["message"], (path, error)
        assert f"{MAX_MODEL_LEN} tokens" in error["message"] and "characters" in error["message"]
    # The cap rejects nothing that fits: runs of spaces are long tokens of this vocabulary.
    spaces = " " * (64 * (MAX_MODEL_LEN - 16))
    response = http.post("/tokenize", json={"prompt": spaces})
    assert response.status_code == 200, response.text
    assert response.json()["count"] < MAX_MODEL_LEN < len(spaces) // 16


def test_caps_on_messages_and_sequences(http: httpx.Client):
    error = _error(http.post("/v1/chat/completions", json={"messages": CHAT * 100_000}))
    assert error["param"] == "messages" and "2048" in error["message"]
    error = _error(http.post("/v1/completions",
                             json={"prompt": ["Hi"] * 64, "n": 16, "max_tokens": 1}))
    assert error["param"] == "n" and "64" in error["message"]
    ok = http.post("/v1/completions", json={"prompt": ["Hi"] * 4, "n": 16, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 64
    _still_healthy(http)


# ---------------------------------------------------------------------- finding 9
@pytest.mark.parametrize("tokens", [("wrong", API_KEY), (API_KEY, "wrong"), (API_KEY, API_KEY)],
                         ids=["wrong-first", "wrong-last", "same-twice"])
def test_duplicate_authorization_headers_are_refused(server: ServerProcess,
                                                     tokens: tuple[str, str]):
    headers = [("Authorization", f"Bearer {t}") for t in tokens]
    response = httpx.get(server.base_url + "/v1/models", headers=headers)
    assert _error(response, 401)["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/v1/models", headers=AUTH).status_code == 200


# ---------------------------------------------------------------------- vLLM's extra fields
@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", {"messages": CHAT, "truncate_prompt_tokens": 8},
     "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ 'x' }}"}, "chat_template"),
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": "Hi", "add_special_tokens": False}, "add_special_tokens"),
    ("/v1/completions", {"prompt": "Hi", "length_penalty": 0.5}, "length_penalty"),
])
def test_fields_that_would_change_the_output_are_refused_not_ignored(
        server: ServerProcess, http: httpx.Client, path: str, body: dict, field: str):
    """A field of vLLM's API this server does not implement is a 400 naming it; set to the
    value that asks for nothing, or unknown to vLLM too, it is ignored (the latter logged)."""
    assert _error(http.post(path, json={"max_tokens": 2, **body}))["param"] == field
    quiet = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": [],
             "add_special_tokens": path == "/v1/completions", "frobnicate-4242": 1}
    prompt = {"messages": CHAT} if "chat" in path else {"prompt": "Hi"}
    assert http.post(path, json={"max_tokens": 2, **prompt, **quiet}).status_code == 200
    assert "'frobnicate-4242'" in _wait_for_log(server, "frobnicate-4242", 1)


def test_continue_final_message(server: ServerProcess, http: httpx.Client,
                                client: openai.OpenAI):
    """vLLM's continue_final_message: the assistant's last message is left open (rendered
    up to its text) and the model continues it; with add_generation_prompt a 400."""
    start = "The capital of France is"
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": start}]
    body = {"model": server.model, "messages": messages, "add_generation_prompt": False}
    closed = http.post("/tokenize", json=body).json()["tokens"]
    opened = http.post("/tokenize", json={**body, "continue_final_message": True}).json()
    tokenizer_text = http.post("/detokenize", json={"model": server.model,
                                                    "tokens": opened["tokens"]})
    assert tokenizer_text.status_code == 200 and tokenizer_text.json()["prompt"].endswith(start)
    assert opened["tokens"] == closed[:len(opened["tokens"])] and opened["count"] < len(closed)
    reply = client.chat.completions.create(
        messages=messages, model=server.model, temperature=0, max_tokens=4,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert reply.usage.prompt_tokens == opened["count"] and reply.choices[0].message.content
    error = _bad_chat(client, server, messages=messages,
                      extra_body={"continue_final_message": True})
    assert error["param"] == "continue_final_message"
    # chat_template_kwargs may set both flags, and win (as in vLLM): it was a 500
    kwargs = {"continue_final_message": True, "add_generation_prompt": False}
    through_kwargs = client.chat.completions.create(
        messages=messages, model=server.model, temperature=0, max_tokens=4,
        extra_body={"chat_template_kwargs": kwargs})
    assert through_kwargs.usage.prompt_tokens == opened["count"]
    assert through_kwargs.choices[0].message.content == reply.choices[0].message.content
    error = _bad_chat(client, server, messages=messages,
                      extra_body={"chat_template_kwargs": {"continue_final_message": True}})
    assert error["param"] == "continue_final_message"
    error = _bad_chat(client, server, messages=messages, extra_body={
        "chat_template_kwargs": {"continue_final_message": "yes"}})
    assert error["param"] == "chat_template_kwargs"

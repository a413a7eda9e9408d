"""The OpenAI-compatible server, end to end: a real `conveyor serve` and the official client.

One server per module (loading the model dominates); requests ask for few tokens.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from server_fixtures import ServerProcess, metric_value, start_server, wait_idle

MAX_MODEL_LEN = 1024
PROMPT = "The capital of France is"
GREEDY = {"temperature": 0.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
CHAT = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    server = start_server("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "64MiB")
    yield server
    status = server.stop()
    assert status == 0, server.log_tail()  # SIGTERM: graceful shutdown, exit 0
    assert "KV cache:" in server.log_tail(100_000)  # startup logged the capacity
    server.remove_log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _metrics(server: ServerProcess) -> str:
    return httpx.get(server.base_url + "/metrics").text


# ---------------------------------------------------------------------- completions
def test_completion_stream_matches_non_stream(server: ServerProcess, client: openai.OpenAI):
    full = client.completions.create(model=server.model, prompt=PROMPT, **GREEDY)
    choice = full.choices[0]
    assert choice.text and choice.finish_reason == "length"
    num_prompt = len(httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT})
                     .json()["tokens"])
    assert full.usage.prompt_tokens == num_prompt
    assert full.usage.completion_tokens == 8
    assert full.usage.total_tokens == num_prompt + 8
    assert full.usage.prompt_tokens_details.cached_tokens >= 0

    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == num_prompt


def test_chat_stream_matches_non_stream(server: ServerProcess, client: openai.OpenAI):
    full = client.chat.completions.create(model=server.model, messages=CHAT, **GREEDY)
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    assert full.usage.completion_tokens == 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + 8

    chunks = list(client.chat.completions.create(
        model=server.model, messages=CHAT, stream=True, stream_options={"include_usage": True},
        **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 8


def test_continuous_usage_stats(server: ServerProcess, client: openai.OpenAI):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far,
    its completion tokens growing to the last chunk's count."""
    for create, args in ((client.chat.completions.create, {"messages": CHAT}),
                         (client.completions.create, {"prompt": PROMPT})):
        chunks = list(create(model=server.model, max_tokens=8, temperature=0, stream=True,
                             stream_options={"include_usage": True,
                                             "continuous_usage_stats": True}, **args))
        counts = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
        assert counts == sorted(counts) and counts[-1] == 8 and not chunks[-1].choices


def test_n2_and_seed_reproducible(server: ServerProcess, client: openai.OpenAI):
    kwargs = {"model": server.model, "prompt": PROMPT, "n": 2, "temperature": 1.0,
              "max_tokens": 6, "seed": 1234, "extra_body": {"ignore_eos": True}}
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 12


def test_stop_string(server: ServerProcess, client: openai.OpenAI):
    text = client.completions.create(model=server.model, prompt=PROMPT, **GREEDY).choices[0].text
    stop = text.split()[1]  # a word from the middle of the greedy text
    expected = text[:text.index(stop)]
    stopped = client.completions.create(model=server.model, prompt=PROMPT, stop=[stop],
                                        **GREEDY).choices[0]
    assert stopped.text == expected and stopped.finish_reason == "stop"
    chunks = client.completions.create(model=server.model, prompt=PROMPT, stop=[stop],
                                       stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == expected
    # chat too, whole and streamed: the stop string that ended it is its stop_reason (vLLM's)
    body = {"model": server.model, "messages": CHAT, "stop": [" "], "temperature": 0,
            "max_tokens": 8, "ignore_eos": True}
    whole = httpx.post(server.base_url + "/v1/chat/completions", json=body).json()
    assert whole["choices"][0]["stop_reason"] == " "
    with httpx.stream("POST", server.base_url + "/v1/chat/completions",
                      json={**body, "stream": True}) as response:
        last = [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: {")][-1]
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["choices"][0]["stop_reason"] == " "


def test_completion_logprobs(server: ServerProcess, client: openai.OpenAI):
    full = client.completions.create(model=server.model, prompt=PROMPT, logprobs=2, **GREEDY)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == full.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    # greedy: the sampled token is the most likely one
    assert all(abs(max(top.values()) - v) < 1e-6
               for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chunks = client.completions.create(model=server.model, prompt=PROMPT, logprobs=2,
                                       stream=True, **GREEDY)
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_chat_logprobs(server: ServerProcess, client: openai.OpenAI):
    full = client.chat.completions.create(model=server.model, messages=CHAT, logprobs=True,
                                          top_logprobs=3, **GREEDY)
    content = full.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_echo_multi_prompt_and_token_ids(server: ServerProcess, client: openai.OpenAI):
    single = client.completions.create(model=server.model, prompt=PROMPT, **GREEDY)
    echoed = client.completions.create(model=server.model, prompt=PROMPT, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + single.choices[0].text
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = client.completions.create(model=server.model, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == single.choices[0].text
    multi = client.completions.create(model=server.model, prompt=[PROMPT, "Hello"], **GREEDY)
    assert [c.index for c in multi.choices] == [0, 1]
    assert multi.choices[0].text == single.choices[0].text
    assert multi.usage.completion_tokens == 16


def test_logit_bias_allowed_token_ids_bad_words(server: ServerProcess, client: openai.OpenAI):
    """OpenAI's logit_bias (the client's own parameter), vLLM's allowed_token_ids and
    bad_words."""
    (sea,) = httpx.post(server.base_url + "/tokenize", json={"prompt": " sea"}).json()["tokens"]
    forced = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3,
                                       temperature=0, logit_bias={str(sea): 100})
    assert forced.choices[0].text == " sea" * 3
    unforced = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3,
                                         temperature=0, logit_bias={str(sea): 100},
                                         extra_body={"bad_words": ["sea"]})  # a ban wins
    assert "sea" not in unforced.choices[0].text
    single = client.completions.create(model=server.model, prompt=PROMPT, **GREEDY)
    first = httpx.post(server.base_url + "/tokenize",
                       json={"prompt": single.choices[0].text}).json()["tokens"][0]
    banned = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=1,
                                       temperature=0, logit_bias={str(first): -100})
    assert banned.choices[0].text != single.choices[0].text[:len(banned.choices[0].text)]
    chat = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=3,
                                          temperature=0, extra_body={"allowed_token_ids": [sea]})
    assert chat.choices[0].message.content == " sea" * 3


def test_echo_with_logprobs_scores_the_prompt(server: ServerProcess, client: openai.OpenAI):
    """What lm-eval-harness's loglikelihood asks of a completions server: the prompt echoed
    with every token's logprob (the first has none), then the generated token's; with
    max_tokens 0, the prompt alone."""
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    scored = client.completions.create(model=server.model, prompt=PROMPT, echo=True,
                                       logprobs=2, max_tokens=1, temperature=0)
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(token in top for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:],
                                                  strict=True))
    assert "".join(lp.tokens) == scored.choices[0].text and lp.text_offset[0] == 0
    plain = client.completions.create(model=server.model, prompt=PROMPT, logprobs=2,
                                      max_tokens=1, temperature=0)
    assert lp.token_logprobs[-1] == plain.choices[0].logprobs.token_logprobs[0]
    alone = client.completions.create(model=server.model, prompt=PROMPT, echo=True,
                                      logprobs=2, max_tokens=0, temperature=0)
    assert alone.choices[0].text == PROMPT and alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    assert lp.text_offset == sorted(lp.text_offset)  # one running total
    # Characters split over tokens (an emoji's bytes): offsets count characters, not "\ufffd"s
    text = "Birds: 🐦🐦 and 東京 🙂 done"
    split = client.completions.create(model=server.model, prompt=text, echo=True, logprobs=0,
                                      max_tokens=0).choices[0].logprobs
    assert any("\ufffd" in t for t in split.tokens)
    for token, offset in zip(split.tokens, split.text_offset, strict=True):
        assert 0 <= offset < len(text)
        if "\ufffd" not in token and offset:
            assert text[offset:offset + len(token)] == token, (token, offset)


def test_prompt_logprobs_field(server: ServerProcess, client: openai.OpenAI):
    """vLLM's prompt_logprobs: per prompt token (the first null) its logprob, rank and text,
    keyed by token id; the echo's token_logprobs are the same numbers; not in a stream."""
    url = server.base_url
    ids = httpx.post(url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    scored = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]
    entries = scored["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    assert [list(e) for e in entries[1:]] == [[str(t)] for t in ids[1:]]
    echoed = client.completions.create(model=server.model, prompt=PROMPT, echo=True,
                                       logprobs=1, max_tokens=0)
    assert [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:], strict=True)] == \
        echoed.choices[0].logprobs.token_logprobs[1:]
    chat = httpx.post(url + "/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 1, "prompt_logprobs": 2}).json()
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(1 <= len(e) <= 3 and all(c["decoded_token"] is not None for c in e.values())
               for e in chat["prompt_logprobs"][1:])
    streamed = httpx.post(url + "/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and \
        streamed.json()["error"]["param"] == "prompt_logprobs"


def test_prefix_cache_reported_in_usage(server: ServerProcess, client: openai.OpenAI):
    prompt = " ".join(f"word{i}" for i in range(40))  # several full KV blocks
    client.completions.create(model=server.model, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=server.model, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_models_version_tokenize_detokenize(server: ServerProcess, client: openai.OpenAI):
    assert [m.id for m in client.models.list().data] == [server.model]
    assert httpx.get(server.base_url + "/version").json()["version"]
    tokens = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "Hello world"
    assert client.models.retrieve(server.model).id == server.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    chat = httpx.post(server.base_url + "/tokenize", json={"messages": CHAT,
                                                           "return_token_strs": True}).json()
    assert chat["count"] > tokens["count"] and len(chat["token_strs"]) == chat["count"]
    rendered = httpx.post(server.base_url + "/detokenize", json={"tokens": chat["tokens"]})
    assert "<|im_start|>" in rendered.json()["prompt"]  # special tokens kept: the same text
    assert "".join(chat["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n") == \
        rendered.json()["prompt"]
    # With tools and template kwargs: the count a chat request with them is charged
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}
    with_tools = httpx.post(server.base_url + "/tokenize", json={
        "messages": CHAT, "tools": [tool],
        "chat_template_kwargs": {"add_generation_prompt": False}}).json()
    answer = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=1, tools=[tool], tool_choice="none",
        extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert with_tools["count"] == answer.usage.prompt_tokens > chat["count"]


# ---------------------------------------------------------------------- batching, cancellation
def test_64_concurrent_streams_share_the_batch(server: ServerProcess):
    before = _metrics(server)
    aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                 max_retries=0)

    async def one(i: int) -> int:
        stream = await aclient.completions.create(
            model=server.model, prompt=f"Request {i}: once upon a time", stream=True,
            stream_options={"include_usage": True}, **GREEDY)
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def run_all() -> list[int]:
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    assert asyncio.run(run_all()) == [8] * 64
    stats = httpx.get(server.base_url + "/stats").json()
    assert stats["peak_num_requests_running"] >= 32, stats  # the batch held many at once
    after = wait_idle(server)
    name = "conveyor:request_success_total"
    assert (metric_value(after, name, finished_reason="length")
            - metric_value(before, name, finished_reason="length")) >= 64
    assert metric_value(after, "conveyor:kv_cache_usage_perc") == 0


def _aborts(server: ServerProcess) -> float:
    return metric_value(_metrics(server), "conveyor:request_success_total",
                        finished_reason="abort")


def test_streaming_disconnect_aborts(server: ServerProcess):
    before = _aborts(server)
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 500, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body) as response:
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving the block closes the connection mid-stream
    text = wait_idle(server)
    assert metric_value(text, "conveyor:kv_cache_usage_perc") == 0
    assert metric_value(text, "conveyor:num_requests_running") == 0
    assert _aborts(server) == before + 1
    stats = httpx.get(server.base_url + "/stats").json()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_non_streaming_disconnect_aborts(server: ServerProcess):
    before = _aborts(server)
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=1.5)
    text = wait_idle(server)
    assert metric_value(text, "conveyor:kv_cache_usage_perc") == 0
    assert _aborts(server) == before + 1


# ---------------------------------------------------------------------- errors
_LONG = list(range(100, 100 + MAX_MODEL_LEN))
BAD_REQUESTS = [
    # (path, body (dict, or raw str), status, param or None)
    ("/v1/completions", "{not json", 400, "body"),
    ("/v1/completions", "[1, 2]", 400, "body"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 100}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["x"] * 65}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[5], [1, -2]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 100}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"one": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, 400,
     "echo"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ("/v1/completions", {"prompt": _LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 5000}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"messages": 1}}, 200,
     None),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
     200, None),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/v1/nothing-here", {}, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_input_gets_openai_error(server: ServerProcess, path: str, body: object,
                                     status: int, param: str | None):
    url = server.base_url + path
    if isinstance(body, str):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        if path.startswith("/v1/chat") and status == 200:
            body = {**body, "max_tokens": 2}
        response = httpx.post(url, json=body)
    assert response.status_code == status, response.text
    if status != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_null_options_take_their_defaults(server: ServerProcess):
    """OpenAI's API declares n, stream, logprobs, echo and more nullable: null is the
    default, as vLLM takes it, not a 400."""
    url = server.base_url + "/v1"
    chat = {"model": server.model, "messages": CHAT, "max_completion_tokens": 3,
            "temperature": 0}
    nulls = dict.fromkeys(("n", "stream", "logprobs", "parallel_tool_calls", "ignore_eos",
                           "min_tokens", "skip_special_tokens", "priority", "seed"))
    plain = httpx.post(url + "/chat/completions", json=chat).json()
    nulled = httpx.post(url + "/chat/completions", json={**chat, **nulls})
    assert nulled.status_code == 200, nulled.text
    assert nulled.json()["choices"] == plain["choices"]
    completion = httpx.post(url + "/completions", json={
        "model": server.model, "prompt": PROMPT, "ignore_eos": True, "echo": None, "n": None,
        "stream": None, "include_stop_str_in_output": None})
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens
    assert len(completion.json()["choices"]) == 1


def test_context_length_messages_use_openai_wording(server: ServerProcess):
    url = server.base_url + "/v1/completions"
    too_long = httpx.post(url, json={"prompt": _LONG}).json()["error"]
    assert too_long["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your request "
        f"has {MAX_MODEL_LEN} input tokens. Please reduce the length of the input messages.")
    ids = list(range(100, 110))
    too_many = httpx.post(url, json={"prompt": ids, "max_tokens": 2000}).json()["error"]
    assert too_many["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: 2000. This model's maximum "
        f"context length is {MAX_MODEL_LEN} tokens and your request has 10 input tokens "
        f"(2000 > {MAX_MODEL_LEN} - 10).")


def test_method_not_allowed_and_client_errors(server: ServerProcess, client: openai.OpenAI):
    response = httpx.get(server.base_url + "/v1/completions")
    assert response.status_code == 405 and "error" in response.json()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=server.model, messages=CHAT, temperature=-2)


# ---------------------------------------------------------------------- metrics
def test_metrics_use_vllm_names(server: ServerProcess):
    text = _metrics(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total", "request_success_total",
                 "num_preemptions_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "request_prompt_tokens_bucket",
                 "request_generation_tokens_bucket"):
        assert f'conveyor:{name}{{' in text, name
    assert f'model_name="{server.model}"' in text
    assert 'conveyor:time_to_first_token_seconds_bucket{le="0.001"' in text
    assert 'conveyor:request_prompt_tokens_bucket{le="1000.0"' in text
    assert metric_value(text, "conveyor:generation_tokens_total") > 0


def test_requests_take_the_models_generation_config_defaults(tiny_model_factory) -> None:
    """A model whose generation_config.json sets temperature 0 and max_new_tokens 5: a
    request that sets no temperature is greedy, token for token as one that asks for
    temperature 0; one that sets its own temperature keeps it. One without max_tokens
    (null) gets 5 tokens, one that asks for more gets them."""
    folder = tiny_model_factory("server-gen-config", "llama")
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, "temperature": 0.0, "max_new_tokens": 5}))
    server = start_server("--model", str(folder), "--dtype", "float32",
                          "--kv-cache-memory", "1MiB")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        prompt = [5, 6, 7, 8, 9]

        def tokens(**params) -> list[int]:
            out = client.completions.create(model=server.model, prompt=prompt, max_tokens=12,
                                            logprobs=0, extra_body={"ignore_eos": True},
                                            **params)
            return out.choices[0].logprobs.tokens

        greedy = tokens(temperature=0)
        assert tokens() == greedy and tokens(seed=7) == greedy
        sampled = [tokens(temperature=1.5, seed=s) for s in range(3)]
        assert any(s != greedy for s in sampled)  # its own temperature is kept
        unset = client.completions.create(model=server.model, prompt=prompt, max_tokens=None,
                                          extra_body={"ignore_eos": True})
        assert unset.usage.completion_tokens == 5
    finally:
        assert server.stop() == 0, server.log_tail()
        server.remove_log()


def test_several_served_model_names() -> None:
    """vLLM's --served-model-name NAME [NAME ...]: requests may give any; answers and the
    model list carry them (the first in answers); other names are a 404."""
    from conveyor.config import EngineArgs

    assert EngineArgs(served_model_name=["a", "b"]).served_model_name == ("a", "b")
    with pytest.raises(ValueError, match="served_model_name"):
        EngineArgs(served_model_name=[])
    server = start_server("--served-model-name", "first-name", "second-name",
                          "--max-model-len", "512", "--kv-cache-memory", "32MiB")
    try:
        models = httpx.get(server.base_url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["first-name", "second-name"]
        answer = httpx.post(server.base_url + "/v1/chat/completions", json={
            "model": "second-name", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2}).json()
        assert answer["model"] == "first-name", answer
        assert httpx.get(server.base_url + "/v1/models/second-name").json()["id"] == \
            "second-name"
        other = httpx.post(server.base_url + "/v1/completions", json={
            "model": "third", "prompt": "Hi", "max_tokens": 2})
        assert other.status_code == 404
        assert "`first-name`, `second-name`" in other.json()["error"]["message"]
    finally:
        assert server.stop() == 0, server.log_tail()
        server.remove_log()

"""`GET /v1/engine/events` (the web page's live data) and `POST /v1/engine/load`, on a real
`conveyor serve` with the tiny random Llama: the events' format against what the server did,
the API key, and a client that goes away leaving nothing behind. `--no-web-ui` removes it all.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from conveyor.bench.palette import CATEGORIES
from server_fixtures import ServerProcess, start_server, wait_idle

KEY = "web-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_NUM_BATCHED_TOKENS = 64
EVENT_TIMEOUT_S = 120.0  # generous: the machine may be shared by other jobs


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Any) -> Iterator[ServerProcess]:
    proc = start_server("--model", str(tiny_llama_dir), "--dtype", "float32",
                        "--kv-cache-memory", "1MiB", "--max-model-len", "1024",
                        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
                        "--api-key", KEY, api_key=KEY)
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log_tail()
        proc.remove_log()


def events(response: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event name, data) of each Server-Sent Event of a streamed response."""
    name, data = "message", []
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data.append(line.removeprefix("data:").strip())
        elif not line and data:
            yield name, json.loads("\n".join(data))
            name, data = "message", []


def open_events(server: ServerProcess, headers: dict[str, str] = AUTH) -> Any:
    return httpx.stream("GET", server.base_url + "/v1/engine/events", headers=headers,
                        timeout=EVENT_TIMEOUT_S)


def steps_until(stream: Iterator[tuple[str, dict[str, Any]]], done: Any,
                timeout_s: float = EVENT_TIMEOUT_S) -> list[dict[str, Any]]:
    """The `steps` events read until `done(event)` is true (fails after timeout_s)."""
    seen = []
    deadline = time.monotonic() + timeout_s
    for name, event in stream:
        assert name == "steps" and event["type"] == "steps"
        seen.append(event)
        if done(event):
            return seen
        assert time.monotonic() < deadline, f"no such event in {len(seen)} events"
    raise AssertionError("the stream ended")


def test_events_describe_the_steps_the_server_ran(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY)
    stats = httpx.get(server.base_url + "/stats", headers=AUTH).json()
    with open_events(server) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        stream = events(response)
        name, info = next(stream)
        assert name == "info" and info["model"] == server.model
        assert info["kv_blocks_total"] == stats["kv_blocks_total"]
        assert info["max_num_batched_tokens"] == MAX_NUM_BATCHED_TOKENS
        assert [tuple(c) for c in info["categories"]] == list(CATEGORIES)

        def complete(prompt: str, n: int, max_tokens: int) -> Any:
            return client.completions.create(model=server.model, prompt=prompt, n=n,
                                              max_tokens=max_tokens, temperature=0,
                                              extra_body={"ignore_eos": True})

        with ThreadPoolExecutor(3) as pool:
            # n=2: the second sample shares the first one's prompt blocks (prefix caching);
            # long enough (~300 steps) to outlive a few block-map snapshots (one per 0.2 s)
            # on a fast machine, short enough to fit the 1 MiB cache beside the others.
            futures = [pool.submit(complete, "the sea " * 30, 2, 300),
                       pool.submit(complete, "hello world", 1, 40),
                       pool.submit(complete, "quick brown fox", 1, 40)]
            seen = steps_until(stream, lambda e: e["num_requests_running"] == 0
                               and e["num_requests_waiting"] == 0 and not e["steps"]
                               and all(f.done() for f in futures))
            results = [f.result() for f in futures]
    ids = {r.id for r in results}
    steps = [s for e in seen for s in e["steps"]]
    # (the engine's ids: the response's, "-" and a random suffix of 8 hex digits)
    scheduled = {rid.partition("#")[0][:-9] for s in steps for rid, _, _ in s["scheduled"]}
    assert ids <= scheduled
    assert ids <= {rid[:-9] for e in seen for rid in e["ended"]}
    assert [s["step"] for s in steps] == sorted({s["step"] for s in steps})
    for step in steps:
        assert sum(n for _, n, _ in step["scheduled"]) <= MAX_NUM_BATCHED_TOKENS
        assert {kind for _, _, kind in step["scheduled"]} <= {"prefill", "decode"}
        assert 0 <= step["kv_blocks_used"] <= info["kv_blocks_total"]
    assert max(len(s["scheduled"]) for s in steps) >= 2  # continuous batching, seen
    generated = sum(len(c.text) > 0 for r in results for c in r.choices)
    assert generated == 4
    maps = [e["block_map"] for e in seen if e["block_map"]]
    assert maps and all(b < info["kv_blocks_total"] for m in maps for t in m["tables"].values()
                        for b in t)
    # Shared prompt blocks, where a snapshot caught any (the n=2 request's samples are
    # prefilled in one step, so neither finds the other's blocks cached: the marking is
    # checked deterministically in the next test).
    for m in (m for m in maps if m["shared"]):
        holders = [rid for rid, table in m["tables"].items() if set(m["shared"]) & set(table)]
        assert len(holders) >= 2
    last = seen[-1]
    assert last["ttft"]["count"] >= 3 and last["ttft"]["p50_ms"] > 0
    assert last["tpot"]["count"] >= 3 and last["tpot"]["p99_ms"] >= last["tpot"]["p50_ms"]
    assert any(e["generation_tokens_per_s"] > 0 for e in seen)
    wait_idle(server)


def test_the_block_map_marks_prompt_blocks_that_running_requests_share(
        server: ServerProcess) -> None:
    """B arrives with A's prompt once A has prefilled it, so B's full prompt blocks are A's
    (prefix caching). The first step recorded after the events stream opens takes a block-map
    snapshot: both are still running then (hundreds of steps to go), so the map must mark
    those blocks shared, in both tables."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY)
    prompt = "the sea " * 30  # several full blocks

    def start() -> Any:
        stream = client.completions.create(model=server.model, prompt=prompt, max_tokens=300,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))  # its first token: the prompt is in the cache
        return stream

    first, second = start(), start()
    with open_events(server) as response:
        stream = events(response)
        assert next(stream)[0] == "info"
        seen = steps_until(stream, lambda e: e["block_map"] is not None)
    block_map = seen[-1]["block_map"]
    running = {rid: table for rid, table in block_map["tables"].items() if table}
    assert len(running) == 2, block_map
    a, b = running.values()
    k = len(block_map["shared"])
    assert k >= 1 and a[:k] == b[:k] and set(block_map["shared"]) == set(a) & set(b)
    for stream in (first, second):
        assert sum(1 for _ in stream) > 0
    wait_idle(server)


def test_a_stream_opened_later_learns_of_the_requests_already_waiting(
        tiny_llama_dir: Any) -> None:
    """One request runs at a time: the others wait. A second page (or a reload) that opens
    its stream while they wait is told of them as arrived, though the first page was told
    when they came. (Four of 1000 tokens: the tiny model makes ~2000 a second here, and the
    events come every 0.2 s.)"""
    proc = start_server("--model", str(tiny_llama_dir), "--dtype", "float32",
                        "--kv-cache-memory", "1MiB", "--max-model-len", "1024",
                        "--max-num-seqs", "1")
    try:
        client = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused")
        with open_events(proc, {}) as first, ThreadPoolExecutor(4) as pool:
            first_stream = events(first)
            assert next(first_stream)[0] == "info"
            futures = [pool.submit(client.completions.create, model=proc.model, prompt=p,
                                   max_tokens=1000, temperature=0,
                                   extra_body={"ignore_eos": True})
                       for p in ("one", "two", "three", "four")]

            def some_wait(event: dict[str, Any]) -> bool:
                for f in futures:  # a request that failed fails the test now, saying why
                    if f.done() and f.exception() is not None:
                        raise AssertionError(f"a request failed: {f.exception()!r}")
                return event["num_requests_waiting"] >= 1

            seen = steps_until(first_stream, some_wait)
            waiting = {r for e in seen for s in e["steps"] for r in s["arrived"]}
            with open_events(proc, {}) as second:
                second_stream = events(second)
                assert next(second_stream)[0] == "info"
                told = steps_until(second_stream, lambda e: any(s["arrived"]
                                                                for s in e["steps"]))
                arrived = {r for e in told for s in e["steps"] for r in s["arrived"]}
            running = {rid for e in seen for s in e["steps"] for rid, _, _ in s["scheduled"]}
            assert arrived & (waiting - running)  # told of a request that came before it
            for f in futures:
                f.result()
        wait_idle(proc)
    finally:
        assert proc.stop() == 0, proc.log_tail()
        proc.remove_log()


def test_the_api_key_guards_events_and_load_not_the_page(server: ServerProcess) -> None:
    url = server.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert httpx.get(url + "/v1/engine/events", headers=headers).status_code == 401
        assert httpx.post(url + "/v1/engine/load", json={}, headers=headers).status_code == 401
    page = httpx.get(url + "/")
    assert page.status_code == 200 and "<title>conveyor</title>" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name in ("api.js", "chat.js", "live.js", "app.css"):
        assert httpx.get(f"{url}/ui/{name}").status_code == 200
    bad = httpx.post(url + "/v1/engine/load", json={"num_requests": 0}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "num_requests"


def test_a_client_that_leaves_leaves_nothing_behind(server: ServerProcess) -> None:
    with open_events(server) as first:
        first_stream = events(first)
        assert next(first_stream)[0] == "info"
        with open_events(server) as second:
            second_stream = events(second)
            assert next(second_stream)[0] == "info"
            steps_until(first_stream, lambda e: e["num_subscribers"] == 2)
        steps_until(first_stream, lambda e: e["num_subscribers"] == 1)
    # Half-read, then dropped without a goodbye: the server notices at its next write.
    abandoned = httpx.Client(timeout=EVENT_TIMEOUT_S)
    response = abandoned.send(abandoned.build_request(
        "GET", server.base_url + "/v1/engine/events", headers=AUTH), stream=True)
    next(response.iter_lines())
    abandoned.close()
    with open_events(server) as last:
        stream = events(last)
        next(stream)
        steps_until(stream, lambda e: e["num_subscribers"] == 1, timeout_s=10)


def test_open_events_streams_do_not_hold_up_shutdown(tiny_llama_dir: Any) -> None:
    server = start_server("--model", str(tiny_llama_dir), "--dtype", "float32",
                          "--kv-cache-memory", "1MiB", "--shutdown-timeout", "60")
    ended = threading.Event()

    def read() -> None:
        with open_events(server, {}) as response:
            for _ in events(response):
                pass
        ended.set()

    reader = threading.Thread(target=read, daemon=True)
    try:
        reader.start()
        time.sleep(1.0)
        started = time.monotonic()
        assert server.stop() == 0, server.log_tail()
        assert time.monotonic() - started < 30, "shutdown waited for the events stream"
        assert ended.wait(10), "the events stream did not end with the server"
    finally:
        server.remove_log()


def test_no_web_ui_serves_no_page_and_no_events(tiny_llama_dir: Any) -> None:
    server = start_server("--model", str(tiny_llama_dir), "--dtype", "float32",
                          "--kv-cache-memory", "1MiB", "--no-web-ui")
    try:
        for path in ("/", "/ui/live.js", "/v1/engine/events"):
            assert httpx.get(server.base_url + path).status_code == 404, path
        assert httpx.post(server.base_url + "/v1/engine/load", json={}).status_code == 404
        reply = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none").completions.create(
            model=server.model, prompt="hello", max_tokens=2)
        assert reply.choices[0].finish_reason in ("length", "stop")
    finally:
        assert server.stop() == 0, server.log_tail()
        server.remove_log()

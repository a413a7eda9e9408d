"""The server under load and hostile connections, with its output on a pipe nobody reads.

The read timeouts are tested on a server of their own (one-second deadlines, a tiny model);
the load on one with a queue limit whose stdout/stderr fill up after a few hundred access
lines, so every load test also checks that logging never blocks serving. In file order:
read timeouts (partial body, idle connection, slowloris), the queue limit counting only
requests beyond the free slots, a soak with aborted streams, 1,500 more requests, and
SIGTERM ending the process (exit 0) with the pipe full.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import time
from typing import Any

import httpx
import pytest

from server_fixtures import ServerProcess, metric_value, start_server, wait_idle

TIMEOUT_S = 1  # --timeout-keep-alive, --timeout-read-headers, --timeout-read-body
MAX_NUM_SEQS = 64
MAX_QUEUED = 16
# How late past its timeout a connection may close (a loaded 2-core machine).
SLACK_S = 4.0


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    """The load tests' server: the default model, a queue limit, output nobody reads."""
    server = start_server("--max-model-len", "128", "--kv-cache-memory", "64MiB",
                          "--max-num-seqs", str(MAX_NUM_SEQS),
                          "--max-queued-requests", str(MAX_QUEUED), unread_pipe=True)
    yield server
    if server.proc.poll() is None:
        server.stop()


@pytest.fixture(scope="module")
def timeouts_server(tiny_llama_dir: Any) -> ServerProcess:
    """The read-timeout tests' server (a tiny model: the model does not matter here). Its
    one-second deadlines are its own: a burst of 200 requests from a client on a loaded
    2-core machine can miss them (a connection that sends nothing for a second is closed)."""
    server = start_server("--model", str(tiny_llama_dir), "--dtype", "float32",
                          "--kv-cache-memory", "1MiB",
                          "--timeout-keep-alive", str(TIMEOUT_S),
                          "--timeout-read-headers", str(TIMEOUT_S),
                          "--timeout-read-body", str(TIMEOUT_S))
    yield server
    assert server.stop() == 0, server.log_tail()
    server.remove_log()


def _connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1])))
    sock.settimeout(TIMEOUT_S + SLACK_S)
    return sock


def _read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and how long that took."""
    start, data = time.monotonic(), b""
    while chunk := sock.recv(4096):  # socket.timeout (a test failure) if it never closes
        data += chunk
    return data, time.monotonic() - start


def test_partial_body_gets_408(timeouts_server: ServerProcess):
    with _connect(timeouts_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": \"a\"")
        data, seconds = _read_until_closed(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert TIMEOUT_S * 0.9 <= seconds <= TIMEOUT_S + SLACK_S


def test_idle_connections_are_closed(timeouts_server: ServerProcess):
    with _connect(timeouts_server) as sock:  # never sends a byte
        assert _read_until_closed(sock)[0] == b""
    with _connect(timeouts_server) as sock:  # one request, then idle on a kept-alive connection
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, seconds = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200") and seconds >= TIMEOUT_S * 0.9


def test_slowloris_is_closed(timeouts_server: ServerProcess):
    """Header lines trickled faster than any idle timeout, never ending: 408, then closed."""
    with _connect(timeouts_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(0.2)
        start, data, closed = time.monotonic(), b"", False
        while not closed and time.monotonic() - start < TIMEOUT_S + SLACK_S:
            try:
                sock.sendall(b"X-Padding: y\r\n")
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:  # EPIPE or ECONNRESET: the server closed the connection
                closed = True
                continue
            data += chunk
            closed = not chunk
    assert closed and time.monotonic() - start <= TIMEOUT_S + SLACK_S
    assert data == b"" or data.startswith(b"HTTP/1.1 408"), data  # a reset may eat the 408


async def _burst(server: ServerProcess, num: int, max_tokens: int) -> list[httpx.Response]:
    body = {"model": server.model, "prompt": "Count to ten:", "max_tokens": max_tokens,
            "ignore_eos": True}
    limits = httpx.Limits(max_connections=num, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as c:
        return list(await asyncio.gather(*(c.post("/v1/completions", json=body)
                                           for _ in range(num))))


def test_queue_limit_counts_only_requests_beyond_free_slots(server: ServerProcess):
    """From an idle server, a burst that fits in max_num_seqs all runs at once: no 429,
    whatever --max-queued-requests says. A burst far beyond it gets 429s with Retry-After."""
    fits = asyncio.run(_burst(server, 40, max_tokens=4))
    assert [r.status_code for r in fits] == [200] * 40, [r.text for r in fits][:3]
    wait_idle(server)
    overload = asyncio.run(_burst(server, 200, max_tokens=8))
    statuses = [r.status_code for r in overload]
    assert set(statuses) <= {200, 429}, statuses
    assert MAX_NUM_SEQS <= statuses.count(200) < 200 and 429 in statuses
    for r in overload:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
    text = wait_idle(server)
    assert metric_value(text, "conveyor:kv_cache_usage_perc") == 0


async def _soak_stream(client: httpx.AsyncClient, body: dict, abort_after: int | None
                       ) -> tuple[int, list[str]]:
    """(status, data lines) of one stream; `abort_after` events, then the connection closes."""
    lines: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if abort_after is not None and len(lines) >= abort_after:
                    break  # leaving the block closes the connection mid-stream
    return response.status_code, lines


def _check_complete_stream(lines: list[str]) -> None:
    """Well-formed: JSON chunks, one finish_reason, a usage chunk, then [DONE]; the usage
    counts exactly the tokens received (one logprobs entry per token)."""
    assert lines[-1] == "[DONE]", lines[-3:]
    chunks = [json.loads(line) for line in lines[:-1]]
    usage = chunks[-1]["usage"]
    assert usage is not None and chunks[-1]["choices"] == []
    choices = [c["choices"][0] for c in chunks[:-1]]
    assert [c["finish_reason"] is not None for c in choices].count(True) == 1
    assert choices[-1]["finish_reason"] in ("stop", "length")
    received = sum(len(c["logprobs"]["tokens"]) for c in choices if c["logprobs"])
    assert received == usage["completion_tokens"] > 0


def test_soak_with_aborted_streams(server: ServerProcess):
    """300 streams, 60 at a time, 20 % closed by the client mid-stream: no 5xx, every other
    stream well-formed with exact usage, and the engine back to idle with no KV in use."""
    rng = random.Random(0)
    plans = [(rng.randint(2, 8), rng.randint(1, 3) if rng.random() < 0.2 else None)
             for _ in range(300)]

    async def soak() -> list[tuple[int, list[str]]]:
        gate = asyncio.Semaphore(60)  # below max_num_seqs: nothing should queue or get 429
        # A new connection per request: a kept-alive one the server closes (idle past its
        # keep-alive timeout on a loaded machine) just as a request goes out is a ReadError
        # that says nothing about the server.
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                     limits=httpx.Limits(max_keepalive_connections=0)) as client:
            async def one(max_tokens: int, abort_after: int | None) -> tuple[int, list[str]]:
                body = {"model": server.model, "prompt": "Tell me a story.", "stream": True,
                        "max_tokens": max_tokens if abort_after is None else 32,
                        "ignore_eos": abort_after is not None, "logprobs": 1,
                        "stream_options": {"include_usage": True}}
                async with gate:
                    return await _soak_stream(client, body, abort_after)

            return await asyncio.gather(*(one(*plan) for plan in plans))

    results = asyncio.run(soak())
    assert [status for status, _ in results] == [200] * len(plans)
    for (_, abort_after), (_, lines) in zip(plans, results, strict=True):
        if abort_after is None:
            _check_complete_stream(lines)
    text = wait_idle(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric_value(text, f"conveyor:{name}") == 0, name
    assert metric_value(text, "conveyor:request_success_total", finished_reason="abort") > 0


def test_unread_output_never_blocks_serving_and_sigterm_ends_it(server: ServerProcess):
    """1,500 more requests (an access line each: ~140 KB against a 64 KiB pipe buffer), a
    completion after them, then SIGTERM: the port closes at once and the process exits 0."""
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        for _ in range(1500):
            assert client.get("/health").status_code == 200
        done = client.post("/v1/completions", json={"model": server.model, "prompt": "Hi",
                                                    "max_tokens": 2})
        assert done.status_code == 200
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.TransportError):
        httpx.get(server.base_url + "/health", timeout=2)
    assert server.proc.wait(15) == 0

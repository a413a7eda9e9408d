"""SIGTERM under a streaming burst, and a second signal during the drain.

The first signal closes the listening socket at once; in-flight streams get
--shutdown-timeout seconds, then end with an SSE error event and [DONE]; every KV block is
freed and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time

import httpx
import pytest

from server_fixtures import ServerProcess, start_server

SHUTDOWN_TIMEOUT_S = 2.0
NUM_STREAMS = 8
# How long past the shutdown timeout the process may take to exit (a loaded 2-core machine).
EXIT_SLACK_S = 10.0


def _start(shutdown_timeout_s: float) -> ServerProcess:
    return start_server("--max-model-len", "512", "--kv-cache-memory", "64MiB",
                        "--shutdown-timeout", str(shutdown_timeout_s))


def _open_streams(server: ServerProcess, num: int) -> tuple[list[list[str]], list[threading.Thread],
                                                             threading.Barrier]:
    """`num` long streams, each in a thread collecting its data lines; the barrier is
    passed once every stream has received its first event."""
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    lines: list[list[str]] = [[] for _ in range(num)]
    started = threading.Barrier(num + 1)

    def read(i: int) -> None:
        # A cut connection ends the stream without [DONE]: the caller's checks see it.
        with contextlib.suppress(httpx.TransportError), httpx.stream(
                "POST", server.base_url + "/v1/completions", json=body,
                timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines[i].append(line[6:])
                    if len(lines[i]) == 1:
                        started.wait()

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(num)]
    for thread in threads:
        thread.start()
    return lines, threads, started


def _assert_refuses_connections(server: ServerProcess) -> None:
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base_url + "/health", timeout=2)


def test_sigterm_ends_a_streaming_burst_cleanly():
    server = _start(SHUTDOWN_TIMEOUT_S)
    try:
        lines, threads, started = _open_streams(server, NUM_STREAMS)
        started.wait(60)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        _assert_refuses_connections(server)
        assert server.proc.wait(SHUTDOWN_TIMEOUT_S + EXIT_SLACK_S) == 0, server.log_tail()
        assert time.monotonic() - signalled >= SHUTDOWN_TIMEOUT_S * 0.9  # it did drain
        for thread in threads:
            thread.join(10)
        for stream in lines:
            assert stream[-1] == "[DONE]", stream[-3:]
            error = json.loads(stream[-2])["error"]
            assert error["code"] == "shutting_down" and error["type"] == "server_error"
            assert all("choices" in json.loads(chunk) for chunk in stream[:-2])
        log = server.log_tail(1_000_000)
        assert "conveyor serving" in log and "shutting down: " in log
        assert log.count('"POST /v1/completions HTTP/1.1" 200 OK') == NUM_STREAMS
        assert "Traceback" not in log and "CancelledError" not in log, log
        shutdown_line = log[log.index("conveyor shut down:"):].splitlines()[0]
        free, total = (int(x) for x in shutdown_line.split(": ")[1].split(" KV")[0]
                       .split(" of "))
        assert free == total > 0, shutdown_line
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        server.remove_log()


def test_second_signal_exits_at_once():
    server = _start(60.0)  # a drain that would take a minute
    try:
        _, _, started = _open_streams(server, 1)
        started.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        _assert_refuses_connections(server)
        assert server.proc.poll() is None  # draining
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(5) == 128 + signal.SIGINT
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        server.remove_log()

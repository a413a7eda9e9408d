"""A real `conveyor serve` process on a free loopback port, for the server tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

# Loading the default model takes ~10 s on a small CPU machine; be generous under load.
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
_MAIN = "import sys; from conveyor.cli import main; sys.exit(main(sys.argv[1:]))"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str  # e.g. http://127.0.0.1:PORT (no /v1)
    log_path: str
    model: str = ""

    def log_tail(self, chars: int = 4000) -> str:
        if not self.log_path:
            return "(the output goes to a pipe nobody reads)"
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]

    def stop(self) -> int:
        """SIGTERM, then the exit status (a graceful shutdown exits 0)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not exit after SIGTERM:\n{self.log_tail()}") from e

    def remove_log(self) -> None:
        if self.log_path:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)


def start_server(*args: str, api_key: str | None = None, setup: str = "",
                 unread_pipe: bool = False) -> ServerProcess:
    """Start `conveyor serve ARGS` and wait until /health answers 200.

    `setup`: Python statements the server process runs first (a test's fault injection).
    Its output goes to a log file, or with `unread_pipe` to a pipe that nobody reads (once
    its buffer is full, every write to it blocks)."""
    try:
        from conveyor.model.loader import default_model_path

        default_model_path()
    except FileNotFoundError as e:
        pytest.fail(f"the default model is part of the set-up: {e}")
    port = free_port()
    cmd = [sys.executable, "-c", f"{setup}\n{_MAIN}", "serve", "--port", str(port), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if unread_pipe:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        log_path = ""
    else:
        log = tempfile.NamedTemporaryFile("w", prefix="conveyor-serve-", suffix=".log",
                                          delete=False)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log_path = log.name
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                models = httpx.get(server.base_url + "/v1/models", headers=headers, timeout=5)
                server.model = models.json()["data"][0]["id"]
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise AssertionError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}")


def serving(*args: str) -> Iterator[ServerProcess]:
    """A module fixture's body: `conveyor serve ARGS`, then a graceful stop (exit 0)."""
    server = start_server(*args)
    yield server
    assert server.stop() == 0, server.log_tail()
    server.remove_log()


def openai_client(server: ServerProcess) -> openai.OpenAI:
    """The official client on the server's /v1, without retries (a test sees each failure)."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition (0.0 if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            return float(value)
    return 0.0


def wait_idle(server: ServerProcess, timeout_s: float = 20.0) -> str:
    """The /metrics text once no request runs or waits and the KV cache is empty (or the
    text at the deadline: the caller's assertions then say what is still busy)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(server.base_url + "/metrics").text
        busy = (metric_value(text, "conveyor:num_requests_running")
                + metric_value(text, "conveyor:num_requests_waiting")
                + metric_value(text, "conveyor:kv_cache_usage_perc"))
        if busy == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.1)

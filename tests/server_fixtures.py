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
from dataclasses import dataclass

import httpx
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
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)


def start_server(*args: str, api_key: str | None = None, prelude: str = "") -> ServerProcess:
    """Start `conveyor serve ARGS` and wait until /health answers 200; `prelude` is Python
    run in the server process first (to inject a fault)."""
    try:
        from conveyor.model.loader import default_model_path

        default_model_path()
    except FileNotFoundError as e:
        pytest.fail(f"the default model is part of the set-up: {e}")
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="conveyor-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-c", f"{prelude}\n{_MAIN}", "serve", "--port", str(port), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log.name)
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

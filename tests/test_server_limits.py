"""The server's guards, end to end: API key, back-pressure (429), body size (413), a fuzzed
OpenAPI schema (no 5xx), and SIGTERM with a request in flight (it finishes, exit 0).

One small server for the module: one running sequence, two waiting at most, short contexts
(so that whatever the fuzzer sends finishes quickly).
"""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, settings

try:  # the `test` extra lists it; without it only the fuzz test is skipped
    import schemathesis
except ImportError:  # pragma: no cover
    schemathesis = None

from server_fixtures import ServerProcess, start_server

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY_BYTES = 65536
# Wall-clock budget of the fuzz test per operation: examples past it are skipped (generating
# examples cost a few forward passes each on CPU).
FUZZ_BUDGET_S = 20.0


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    server = start_server("--max-model-len", "32", "--kv-cache-memory", "16MiB",
                          "--max-num-seqs", "1", "--max-queued-requests", "2",
                          "--api-key", API_KEY, "--max-request-body-bytes", str(MAX_BODY_BYTES),
                          "--shutdown-timeout", "20", api_key=API_KEY)
    yield server
    if server.proc.poll() is None:
        server.stop()
    server.remove_log()


def _completion(server: ServerProcess, **fields: object) -> dict:
    return {"model": server.model, "prompt": "Hello", **fields}


def test_api_key_required_on_v1(server: ServerProcess):
    url = server.base_url + "/v1/models"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.get(url, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url, headers=AUTH).status_code == 200
    assert httpx.post(server.base_url + "/v1/completions",
                      json=_completion(server, max_tokens=1)).status_code == 401
    for open_path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.base_url + open_path).status_code == 200


def test_body_size_limit(server: ServerProcess):
    big = json.dumps(_completion(server, prompt="x " * MAX_BODY_BYTES)).encode()
    url = server.base_url + "/v1/completions"
    response = httpx.post(url, content=big, headers=AUTH)
    assert response.status_code == 413 and "error" in response.json()

    def chunked():  # no Content-Length: the limit applies while reading
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    response = httpx.post(url, content=chunked(), headers=AUTH)
    assert response.status_code == 413 and "error" in response.json()
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_full_queue_answers_429(server: ServerProcess):
    body = _completion(server, max_tokens=25, ignore_eos=True, stream=True)
    url = server.base_url + "/v1/completions"
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(headers=AUTH, timeout=30))
        accepted = []
        for _ in range(3):  # one runs (--max-num-seqs 1), two wait (--max-queued-requests 2)
            response = stack.enter_context(client.stream("POST", url, json=body))
            assert response.status_code == 200
            accepted.append(response)
        rejected = client.post(url, json={**body, "stream": False})
        assert rejected.status_code == 429, rejected.text
        assert int(rejected.headers["Retry-After"]) >= 1
        assert rejected.json()["error"]["type"] == "rate_limit_error"
    # leaving the block disconnected the three streams: they are aborted, the server is idle
    deadline = time.monotonic() + 20
    while httpx.get(server.base_url + "/stats", headers=AUTH).json()["kv_cache_usage"] > 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    ok = httpx.post(url, json=_completion(server, max_tokens=2), headers=AUTH)
    assert ok.status_code == 200


if schemathesis is not None:
    @pytest.fixture(scope="module")
    def api_schema(server: ServerProcess):
        return schemathesis.openapi.from_url(server.base_url + "/openapi.json")

    schema = schemathesis.pytest.from_fixture("api_schema")
    _fuzz_started: dict[str, float] = {}  # operation -> when its first example ran

    @schema.parametrize()
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    def test_fuzzed_requests_never_get_5xx(case, server: ServerProcess):
        started = _fuzz_started.setdefault(f"{case.method} {case.path}", time.monotonic())
        if time.monotonic() - started > FUZZ_BUDGET_S:
            return
        try:
            response = case.call(headers=AUTH, timeout=5)
        except Exception as e:  # a timeout (the server aborts the request) is not a 5xx
            if "timed out" not in str(e).lower() and "timeout" not in type(e).__name__.lower():
                raise
            return
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)

else:

    def test_fuzzed_requests_never_get_5xx():
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")


def test_sigterm_lets_in_flight_requests_finish(server: ServerProcess):
    body = _completion(server, max_tokens=12, ignore_eos=True, stream=True)
    assert httpx.get(server.base_url + "/health").status_code == 200
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH,
                      timeout=60) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        server.proc.terminate()  # SIGTERM while the request is in flight
        rest = [line for line in lines if line.startswith("data: ")]
    chunks = [json.loads(line[6:]) for line in [first, *rest] if line != "data: [DONE]"]
    assert rest[-1] == "data: [DONE]"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(60) == 0, server.log_tail()
    with pytest.raises(httpx.TransportError):
        httpx.get(server.base_url + "/health", timeout=2)

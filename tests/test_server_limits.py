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
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from server_fixtures import ServerProcess, start_server, wait_idle

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY_BYTES = 65536
# Fuzzed cases per operation (each a few forward passes at most: contexts are 32 tokens).
FUZZ_EXAMPLES = 30


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


def _fuzz(operation: schemathesis.APIOperation, counts: dict[str, int]) -> None:
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                      operation.as_strategy(GenerationMode.NEGATIVE))

    @given(case=cases)
    @settings(max_examples=FUZZ_EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def call(case: schemathesis.Case) -> None:
        counts[operation.label] += 1
        response = case.call(headers=AUTH, timeout=30)
        assert response.status_code < 500, (operation.label, case.body, response.text)

    call()


def test_fuzzed_requests_never_get_5xx(server: ServerProcess):
    """FUZZ_EXAMPLES cases per operation of the OpenAPI schema, valid and invalid, from a
    fixed seed: every one is answered, below 500. Counting them proves they ran."""
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    counts: dict[str, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        counts[operation.label] = 0
        _fuzz(operation, counts)
    posts = [label for label in counts if label.startswith("POST")]
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= set(posts), counts
    # A POST's inputs are endless: each ran all its examples. A GET without parameters has
    # one input, and Hypothesis stops after it.
    assert all(counts[label] == FUZZ_EXAMPLES for label in posts), counts
    assert all(n >= 1 for n in counts.values()), counts


def test_sigterm_lets_in_flight_requests_finish(server: ServerProcess):
    body = _completion(server, max_tokens=12, ignore_eos=True, stream=True)
    assert httpx.get(server.base_url + "/health").status_code == 200
    wait_idle(server, 60)  # the fuzzing's last requests may still hold the 1 slot, 2 queued
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH,
                      timeout=60) as response:
        assert response.status_code == 200, response.read()
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

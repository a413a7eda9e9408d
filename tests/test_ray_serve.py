"""`conveyor serve --replicas 2 --routing prefix`: two engine replicas of a tiny random model
on a local Ray Serve, behind one endpoint (run alone: `pytest -m ray`).

One deployment serves the module (Ray and two replicas start in ~30 s on 2 cores); the
replica-killing test runs last.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server_fixtures import ServerProcess, metric_value, start_server

pytestmark = pytest.mark.ray

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
SYSTEM_A = "You are a sea captain who answers about the sea and the sky in short haiku. " * 4
SYSTEM_B = "You are a quick brown fox that jumps over the lazy dog and counts one two. " * 4
RESTART_TIMEOUT_S = 90.0
LONG = 800  # tokens: requests still running when the replica is killed (prompt + LONG < 1024)


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[ServerProcess]:
    model = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(tiny_llama_dir, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    server = start_server("--model", str(model), "--dtype", "float32", "--max-model-len",
                          "1024", "--kv-cache-memory", "4MiB", "--replicas", "2",
                          "--routing", "prefix")
    yield server
    assert server.stop() == 0, server.log_tail()
    server.remove_log()


def _metrics(server: ServerProcess) -> str:
    return httpx.get(server.base_url + "/metrics", timeout=10).text


def _live_replicas(text: str) -> dict[str, int]:
    """replica name -> pid, from conveyor:replica_info."""
    live = {}
    for line in text.splitlines():
        if line.startswith("conveyor:replica_info{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:
                                                             line.index("}")].split(","))
            live[labels["replica"].strip('"')] = int(labels["pid"].strip('"'))
    return live


def _wait_for(server: ServerProcess, ready: Any, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = _metrics(server)
        if ready(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.25)


def _chat(system: str, user: str, max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def test_openai_client_streams_through_the_one_endpoint(replicas: ServerProcess) -> None:
    client = openai.OpenAI(base_url=replicas.base_url + "/v1", api_key="none")
    whole = client.chat.completions.create(model=replicas.model, max_tokens=12, temperature=0,
                                           messages=[{"role": "user", "content": "the sea"}])
    chunks = list(client.chat.completions.create(
        model=replicas.model, max_tokens=12, temperature=0, stream=True,
        messages=[{"role": "user", "content": "the sea"}]))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 3 and streamed == whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    # Errors are the single server's: a bad field is a 400 naming it.
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=replicas.model, prompt="x", temperature=-1)
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]


def test_prefix_routing_keeps_a_system_prompt_on_one_replica(replicas: ServerProcess) -> None:
    before = _metrics(replicas)
    chosen = []
    for i in range(6):
        answer = httpx.post(replicas.base_url + "/v1/chat/completions",
                            json=_chat(SYSTEM_A, f"question {i}"), timeout=60)
        assert answer.status_code == 200, answer.text
        chosen.append(answer.headers["x-conveyor-replica"])
    assert len(set(chosen)) == 1, chosen
    home = chosen[0]
    after = _wait_for(replicas, lambda text: metric_value(
        text, "conveyor:request_success_total", replica=home, finished_reason="length")
        >= metric_value(before, "conveyor:request_success_total", replica=home,
                        finished_reason="length") + 6)

    def grew(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert grew("conveyor:routing_decisions_total", policy="prefix", reason="prefix") >= 5
    assert grew("conveyor:replica_requests_total", replica=home) == 6
    others = set(_live_replicas(after)) - {home}
    assert len(others) == 1
    assert grew("conveyor:replica_requests_total", replica=others.pop()) == 0
    # The system prompt's KV blocks were reused on its replica: prefill skipped them.
    assert grew("conveyor:prefix_cache_hits_total", replica=home) >= 5 * 16


def _stream(base_url: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    """Stream one request; out: replica, data events, error (or None), whether [DONE]."""
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body,
                      timeout=120) as response:
        out["replica"] = response.headers.get("x-conveyor-replica")
        out["status"] = response.status_code
        out["events"], out["error"], out["done"] = [], None, False
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
            elif "error" in (event := json.loads(line[6:])):
                out["error"] = event["error"]
            else:
                out["events"].append(event)


def test_killing_a_replica_mid_run_leaves_the_endpoint_serving(
        replicas: ServerProcess) -> None:
    base = replicas.base_url
    live = _live_replicas(_metrics(replicas))
    assert len(live) == 2
    # One at a time, so that each is routed alone (Ray Serve hands a chosen replica to the
    # oldest pending request): two streams and then a non-stream share SYSTEM_A (prefix affinity:
    # its replica), two streams have new prompts (power of two choices: the other replica).
    bodies = [_chat(SYSTEM_A, "long 1", LONG, True), _chat(SYSTEM_A, "long 2", LONG, True),
              _chat(SYSTEM_B, "long 3", LONG, True), _chat("fresh " * 30, "long 4", LONG, True)]
    results: list[dict[str, Any]] = [{} for _ in bodies]
    threads = [threading.Thread(target=_stream, args=(base, b, r))
               for b, r in zip(bodies, results, strict=True)]
    deadline = time.monotonic() + 60
    for thread, result in zip(threads, results, strict=True):
        thread.start()
        while "status" not in result and time.monotonic() < deadline:
            time.sleep(0.02)
    while not all(len(r.get("events", ())) > 2 for r in results) and time.monotonic() < deadline:
        time.sleep(0.05)
    whole: dict[str, Any] = {}
    plain = threading.Thread(target=lambda: whole.update(response=httpx.post(
        base + "/v1/chat/completions", json=_chat(SYSTEM_A, "long 0", LONG), timeout=120)))
    plain.start()
    time.sleep(0.3)  # routed (alone), and far from its last token
    assert [r["status"] for r in results] == [200] * len(results), results
    victim = results[0]["replica"]
    os.kill(live[victim], signal.SIGKILL)
    for thread in [*threads, plain]:
        thread.join(120)
    on_victim = [r for r in results if r["replica"] == victim]
    survivors = [r for r in results if r["replica"] != victim]
    assert on_victim and survivors, [r["replica"] for r in results]
    for result in on_victim:  # cut mid-stream: an error event naming why, then [DONE]
        assert result["error"] is not None and result["error"]["code"] == "replica_died"
        assert result["done"]
    for result in survivors:  # the other replica's streams never noticed
        assert result["error"] is None and result["done"]
        assert result["events"][-1]["choices"][0]["finish_reason"] == "length"
    response = whole["response"]
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "replica_died"
    # The endpoint keeps answering, and Ray Serve brings the replica count back to two.
    for i in range(4):
        answer = httpx.post(base + "/v1/chat/completions", json=_chat(SYSTEM_A, f"after {i}"),
                            timeout=60)
        assert answer.status_code == 200, answer.text
    restored = _wait_for(replicas, lambda text: len(_live_replicas(text)) == 2
                         and victim not in _live_replicas(text), RESTART_TIMEOUT_S)
    assert victim not in _live_replicas(restored) and len(_live_replicas(restored)) == 2
    assert metric_value(restored, "conveyor:replica_failures_total", replica=victim) >= 2
    # Every surviving engine ends with its KV cache empty.
    idle = _wait_for(replicas, lambda text: all(
        metric_value(text, "conveyor:kv_cache_usage_perc", replica=r) == 0
        and metric_value(text, "conveyor:num_requests_running", replica=r) == 0
        for r in _live_replicas(text)))
    for replica in _live_replicas(idle):
        assert metric_value(idle, "conveyor:kv_cache_usage_perc", replica=replica) == 0

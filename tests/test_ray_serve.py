"""`conveyor serve --replicas 2 --routing prefix`: two engine replicas of a tiny random model
on a local Ray Serve, behind one endpoint (run alone: `pytest -m ray`).

The module starts one Ray cluster (in this process) and `conveyor serve --ray-address` joins
it; one test also runs `conveyor.deploy.build_app` (pow2 routing) on it with `serve.run`.
The replica-killing test runs last.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import conveyor
from server_fixtures import ServerProcess, free_port, metric_value, start_server

pytestmark = pytest.mark.ray

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
SYSTEM_A = "You are a sea captain who answers about the sea and the sky in short haiku. " * 4
SYSTEM_B = "You are a quick brown fox that jumps over the lazy dog and counts one two. " * 4
RESTART_TIMEOUT_S = 180.0
LONG = 800  # tokens: requests still running when the replica is killed (prompt + LONG < 1024)


# Each engine replica's settings (flags for `conveyor serve`, fields for build_app).
ENGINE = {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory": "4MiB"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster (its head's address) with 4 logical CPUs: the CLI's two replicas
    and build_app's two (each replica reserves one)."""
    import ray

    # Ray's workers inherit its processes' environment: they import conveyor from this
    # checkout (an absolute path, whatever directory they run in).
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(conveyor.__file__).parents[1]), *filter(None, [before])])
    try:
        context = ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    yield context.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="module")
def chat_model(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(tiny_llama_dir, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return model


@pytest.fixture(scope="module")
def replicas(cluster: str, chat_model: Path) -> Iterator[ServerProcess]:
    flags = [x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    server = start_server("--model", str(chat_model), *flags, "--replicas", "2",
                          "--routing", "prefix", "--ray-address", cluster)
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


def _requests_per_replica(text: str) -> dict[str, float]:
    """replica name -> requests running or waiting in its engine."""
    return {replica: metric_value(text, "conveyor:num_requests_running", replica=replica)
            + metric_value(text, "conveyor:num_requests_waiting", replica=replica)
            for replica in _live_replicas(text)}


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
    # 64 tokens: a stream coalesces the tokens a slow reader has not taken yet (async_engine),
    # and 12 tokens through the proxy arrived in 2 chunks on a fast CPU
    body = {"model": replicas.model, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": "the sea"}],
            "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(**body, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 3 and streamed == whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.completion_tokens == 64
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
    # Both replicas' latest pushes (on a loaded machine one may be a few seconds late).
    after = _wait_for(replicas, lambda text: len(_live_replicas(text)) == 2 and metric_value(
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


def test_the_web_page_watches_the_replica_that_runs_its_requests(
        replicas: ServerProcess) -> None:
    """The live view's stream, the load button and the page's chat (its header) all reach
    one replica, whatever the prefix router would have chosen for the chat."""
    url = replicas.base_url
    page = {"X-Conveyor-Live-View": "1"}
    chosen = []
    for i in range(4):
        with httpx.stream("GET", url + "/v1/engine/events", timeout=60) as events:
            assert events.status_code == 200
            chosen.append(events.headers["x-conveyor-replica"])
        load = httpx.post(url + "/v1/engine/load", json={"num_requests": 1, "max_tokens": 2},
                          timeout=60)
        assert load.status_code == 200, load.text
        system = (SYSTEM_A, SYSTEM_B)[i % 2]  # (prefix affinity would split these)
        chat = httpx.post(url + "/v1/chat/completions", json=_chat(system, f"page {i}"),
                          headers=page, timeout=60)
        assert chat.status_code == 200, chat.text
        chosen += [load.headers["x-conveyor-replica"], chat.headers["x-conveyor-replica"]]
    assert len(set(chosen)) == 1, chosen


def test_one_request_id_header_the_replicas_own(replicas: ServerProcess) -> None:
    url = replicas.base_url + "/v1/chat/completions"
    fresh = httpx.post(url, json=_chat(SYSTEM_B, "an id"), timeout=60)
    given = httpx.post(url, json=_chat(SYSTEM_B, "my id"), timeout=60,
                       headers={"X-Request-Id": "client-id-42"})
    for response, expected in ((fresh, None), (given, "client-id-42")):
        assert response.status_code == 200, response.text
        ids = response.headers.get_list("x-request-id")
        assert len(ids) == 1 and ids[0] == (expected or ids[0]), ids
        # The replica's app named the request by the same id (its logs and errors say it).
        assert response.json()["id"] == f"chatcmpl-{ids[0]}"
    bad = httpx.post(url, json=_chat(SYSTEM_B, "bad id"), headers={"X-Request-Id": "a b"},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-id"


def test_build_app_on_a_running_cluster_with_pow2_routing(replicas: ServerProcess,
                                                          chat_model: Path) -> None:
    from ray import serve

    from conveyor.config import EngineArgs
    from conveyor.deploy import DeployConfig, build_app
    from conveyor.server.config import ServerConfig

    app = build_app(EngineArgs(model=str(chat_model), **ENGINE), ServerConfig(),
                    DeployConfig(replicas=2, routing="pow2"), app_name="pow2")
    serve.run(app, name="pow2", route_prefix="/pow2")  # beside the CLI's app, on its proxy
    try:
        base = replicas.base_url + "/pow2"
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        answer = client.completions.create(model=replicas.model, prompt="the sea", max_tokens=5,
                                           temperature=0)
        assert answer.usage is not None and answer.usage.completion_tokens == 5
        with ThreadPoolExecutor(8) as pool:  # together: the shorter queue wins each time
            answers = list(pool.map(lambda i: httpx.post(
                base + "/v1/completions", timeout=120, json={
                    "prompt": f"request {i}", "max_tokens": 24, "temperature": 0}), range(8)))
        assert [a.status_code for a in answers] == [200] * 8
        chosen = [a.headers["x-conveyor-replica"] for a in answers]
        assert len(set(chosen)) == 2, chosen
        metrics = httpx.get(base + "/metrics", timeout=10).text
        counted = {r: metric_value(metrics, "conveyor:replica_requests_total", replica=r)
                   for r in set(chosen)}
        assert sum(counted.values()) == 9 and set(_live_replicas(metrics)) == set(chosen)
        assert "conveyor:routing_decisions_total{" not in metrics  # the prefix router's
        with ThreadPoolExecutor(8) as pool:  # the page's requests: one replica, however busy
            pinned = list(pool.map(lambda i: httpx.post(
                base + "/v1/completions", timeout=120, headers={"X-Conveyor-Live-View": "1"},
                json={"prompt": f"page {i}", "max_tokens": 8, "temperature": 0}), range(8)))
        assert len({a.headers["x-conveyor-replica"] for a in pinned}) == 1
    finally:
        serve.delete("pow2")


def test_a_signal_as_soon_as_the_endpoint_answers_is_a_clean_shutdown(chat_model: Path) -> None:
    """SIGTERM the moment /health answers (Serve's proxy answers before the driver returns
    from serve.run): a graceful stop, exit 0, not Ray's driver handler's status 15. On a Ray
    cluster of its own (no --ray-address), one replica."""
    flags = [x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    server = start_server("--model", str(chat_model), *flags, "--replicas", "1")
    assert server.stop() == 0, server.log_tail()
    server.remove_log()


def test_a_ray_address_where_no_cluster_answers_is_a_clear_error() -> None:
    main = "import sys; from conveyor.cli import main; sys.exit(main(sys.argv[1:]))"
    address = f"127.0.0.1:{free_port()}"
    done = subprocess.run([sys.executable, "-c", main, "serve", "--replicas", "1",
                           "--ray-address", address], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"--ray-address {address}: no Ray cluster answers there" in done.stderr


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
    assert [r["status"] for r in results] == [200] * len(results), results
    streams_on = {r: sum(result["replica"] == r for result in results) for r in live}
    whole: dict[str, Any] = {}
    plain = threading.Thread(target=lambda: whole.update(response=httpx.post(
        base + "/v1/chat/completions", json=_chat(SYSTEM_A, "long 0", LONG), timeout=120)))
    plain.start()
    # The victim is the replica whose engine holds the non-streaming request (one request more
    # than its streams): killed then, far from that request's last token. (Killed before
    # the replica took it, Ray Serve would retry it on the other one.)
    def landed(text: str) -> list[str]:
        return [r for r, n in _requests_per_replica(text).items() if n > streams_on[r]]

    victim = next(iter(landed(_wait_for(replicas, landed))), None)
    assert victim is not None, (streams_on, _requests_per_replica(_metrics(replicas)))
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

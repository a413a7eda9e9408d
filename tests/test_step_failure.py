"""A step that raises (a kernel error, an out-of-memory, a bug) fails only its requests.

Offline: the failed step's requests end with finish_reason "error", the waiting ones finish
as if nothing happened, every KV block is free and the engine serves on. Through a real
`conveyor serve` whose runner raises on demand: a 500 (non-streaming) or an SSE error event
then [DONE] (streaming), one traceback per failure in the log, the next request served; when
steps keep failing, /health stops answering 200 and the process exits non-zero.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from conveyor import LLM, SamplingParams
from conveyor.core.outputs import SchedulerOutput
from conveyor.engine.llm_engine import MAX_CONSECUTIVE_STEP_FAILURES
from server_fixtures import ServerProcess, metric_value, start_server

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
INJECTED = "injected step failure"


def _failing_step(llm: LLM, calls: set[int] | None) -> Callable[..., Any]:
    """The model's step (one call per engine step, whether it runs ``forward`` or the CPU
    fused decode loop), raising on the given call numbers (1-based; None: always)."""
    step = llm.engine.runner.model.step
    counter = itertools.count(1)

    def failing(*args: Any, **kwargs: Any) -> Any:
        if calls is None or next(counter) in calls:
            raise RuntimeError(INJECTED)
        return step(*args, **kwargs)

    return failing


@pytest.fixture(scope="module")
def two_seq_llm(tiny_llama_dir) -> LLM:
    """Two sequences at a time: of four requests, two run while two wait."""
    from conftest import TINY_KV_MEMORY

    return LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=TINY_KV_MEMORY,
               max_num_seqs=2)


def _prompts(n: int) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": [5 + i, 17, 33 + 3 * i, 8, 90 + i]} for i in range(n)]


PROMPTS = _prompts(4)


def test_failed_step_fails_only_its_requests(two_seq_llm, monkeypatch, kv_free, caplog):
    llm = two_seq_llm
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    errors_before = llm.stats().finished_by_reason["error"]
    model = llm.engine.runner.model
    # Step 3: requests 0 and 1 are decoding (their KV half-written), 2 and 3 wait.
    monkeypatch.setattr(model, "step", _failing_step(llm, {3}))
    with caplog.at_level("ERROR", logger="conveyor.engine.llm_engine"):
        outputs = llm.generate(PROMPTS, GREEDY)
    reasons = [o.outputs[0].finish_reason for o in outputs]
    assert reasons == ["error", "error", "length", "length"]
    assert [o.outputs[0].token_ids for o in outputs[2:]] == expected[2:]
    assert llm.stats().finished_by_reason["error"] == errors_before + 2
    assert sum(INJECTED in r.getMessage() or (r.exc_info and INJECTED in str(r.exc_info[1]))
               for r in caplog.records) == 1  # one traceback for one failure
    kv_free(llm)
    monkeypatch.undo()  # the model works again: so does the engine
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    kv_free(llm)


def test_steps_failing_in_a_row_stop_the_engine(two_seq_llm, monkeypatch, kv_free):
    llm = two_seq_llm
    monkeypatch.setattr(llm.engine.runner.model, "step", _failing_step(llm, None))
    # Each failed step ends two requests: more than enough requests to fail that often.
    with pytest.raises(RuntimeError, match="cannot continue") as info:
        llm.generate(_prompts(2 * MAX_CONSECUTIVE_STEP_FAILURES + 2), GREEDY)
    assert INJECTED in str(info.value.__cause__)
    assert llm.engine.num_consecutive_step_failures == MAX_CONSECUTIVE_STEP_FAILURES
    kv_free(llm)
    monkeypatch.undo()
    assert all(o.outputs[0].finish_reason == "length" for o in llm.generate(PROMPTS, GREEDY))
    kv_free(llm)


def test_failed_post_processing_fails_only_its_request(two_seq_llm, monkeypatch, kv_free):
    """A bug after the forward pass (detokenizing, stop checks) for one request."""
    from conveyor.engine.sequence import Sequence

    llm = two_seq_llm
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    add_token = Sequence.add_token
    calls = itertools.count(1)

    def failing(self: Sequence, token_id: int, logprobs: Any, last: bool = True) -> str | None:
        target = self.request.prompt_token_ids == PROMPTS[1]["prompt_token_ids"]
        if target and next(calls) == 3:  # its third token
            raise RuntimeError(INJECTED)
        return add_token(self, token_id, logprobs, last)

    monkeypatch.setattr(Sequence, "add_token", failing)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "length",
                                                               "length"]
    assert len(outputs[1].outputs[0].token_ids) == 3
    assert [o.outputs[0].token_ids for i, o in enumerate(outputs) if i != 1] == \
        [e for i, e in enumerate(expected) if i != 1]
    kv_free(llm)


def _swap_llm(tiny_llama_dir) -> LLM:
    """16 KV blocks, room on the host for 3: of two requests preempted in one step, the
    first can be swapped out and the other is recomputed (step 70 of MIXED_PROMPTS)."""
    block = 16 * 1024  # one 16-token block of the tiny model in float32
    return LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=16 * block,
               max_model_len=1024, preemption="swap", swap_space=3 * block / 2**30)


def _mixed_prompts() -> list[dict[str, list[int]]]:
    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randrange(2, 400) for _ in range(rng.randrange(3, 61))]}
            for _ in range(32)]


def _watch_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch,
                 on_schedule: Callable[[SchedulerOutput], None]) -> None:
    schedule = llm.engine.scheduler.schedule

    def watched() -> SchedulerOutput:
        out = schedule()
        on_schedule(out)
        return out

    monkeypatch.setattr(llm.engine.scheduler, "schedule", watched)


def test_failed_swap_step_fails_only_the_swapped_out(tiny_llama_dir, monkeypatch, kv_free):
    """A step that swaps one request out and preempts another for recompute fails: the
    swapped one's KV copy may not have run (it ends), the recomputed one lost nothing."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    mixed: list[SchedulerOutput] = []
    llm = _swap_llm(tiny_llama_dir)
    _watch_steps(llm, monkeypatch, lambda out: mixed.append(out) if out.swapped_out_request_ids
                 and out.preempted_request_ids - out.swapped_out_request_ids else None)
    prompts = _mixed_prompts()
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert mixed, "the workload no longer preempts two requests in one step: retune it"
    target = mixed[0]
    recomputed = target.preempted_request_ids - target.swapped_out_request_ids
    ran = {s.request_id for s in target.scheduled}
    failing = {"now": False}
    llm = _swap_llm(tiny_llama_dir)
    _watch_steps(llm, monkeypatch,
                 lambda out: failing.update(now=out.step_id == target.step_id))
    step = llm.engine.runner.model.step

    def failing_step(*args: Any, **kwargs: Any) -> Any:
        if failing["now"]:
            raise RuntimeError(INJECTED)
        return step(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner.model, "step", failing_step)
    outputs = {o.request_id: o.outputs[0] for o in llm.generate(prompts, params)}
    errors = {i for i, o in outputs.items() if o.finish_reason == "error"}
    assert errors == ran | target.swapped_out_request_ids
    for request_id in recomputed:
        assert outputs[request_id].finish_reason == "length"
        assert outputs[request_id].token_ids == expected[int(request_id)]
    kv_free(llm)


# ---------------------------------------------------------------------- through the server
# The server's runner raises while this file exists; "once" in it: for one step only.
_PRELUDE = """
import os
from conveyor.runner import model_runner
_execute = model_runner.ModelRunner.execute
def _maybe_failing(self, out):
    path = os.environ["CONVEYOR_TEST_FAIL_FILE"]
    if out.scheduled and os.path.exists(path):
        with open(path) as f:
            once = f.read() == "once"
        if once:
            os.unlink(path)
        raise RuntimeError("injected step failure")
    return _execute(self, out)
model_runner.ModelRunner.execute = _maybe_failing
"""


@pytest.fixture(scope="module")
def fail_file() -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="conveyor-fail-"), "fail")
    os.environ["CONVEYOR_TEST_FAIL_FILE"] = path  # inherited by the server process
    yield path
    os.environ.pop("CONVEYOR_TEST_FAIL_FILE", None)


@pytest.fixture(scope="module")
def server(fail_file: str) -> ServerProcess:
    server = start_server("--max-model-len", "512", "--kv-cache-memory", "32MiB",
                          setup=_PRELUDE)
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()
    server.remove_log()


def _fail(path: str, mode: str) -> None:
    with open(path, "w") as f:
        f.write(mode)


def _assert_idle(server: ServerProcess) -> None:
    text = httpx.get(server.base_url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric_value(text, "conveyor:" + name) == 0, name
    stats = httpx.get(server.base_url + "/stats").json()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats


def test_server_failed_step_is_a_500_or_an_sse_error(server, fail_file):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 32, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body,
                      timeout=60) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        first = json.loads(next(lines)[6:])
        assert first["choices"][0]["text"] is not None
        _fail(fail_file, "once")
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert error["type"] == "server_error" and INJECTED not in error["message"]
    _fail(fail_file, "once")
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=server.model, prompt="Hello", max_tokens=4)
    assert info.value.status_code == 500
    assert httpx.get(server.base_url + "/health").status_code == 200
    _assert_idle(server)
    served = client.completions.create(model=server.model, prompt="Hello", max_tokens=4,
                                       extra_body={"ignore_eos": True})
    assert served.choices[0].finish_reason == "length" and served.usage.completion_tokens == 4
    _assert_idle(server)
    assert server.log_tail(1_000_000).count(f"RuntimeError: {INJECTED}") == 2


def test_server_exits_non_zero_when_steps_keep_failing(server, fail_file):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    _fail(fail_file, "always")
    for _ in range(MAX_CONSECUTIVE_STEP_FAILURES):
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=server.model, prompt="Hello", max_tokens=4)
        assert info.value.status_code in (500, 503)
    deadline = time.monotonic() + 30
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:  # until it exits, the server must not call itself healthy
            assert httpx.get(server.base_url + "/health", timeout=2).status_code == 503
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    assert server.proc.poll() not in (None, 0), server.log_tail()

"""Scheduler, driven by hand with a fake runner (no torch): budgets, admission, chunking,
preemption, aborts, stop conditions and the prefix cache. Every workload ends leak-free."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from conveyor.core.outputs import ModelRunnerOutput
from conveyor.request import Request, RequestStatus
from core_helpers import (
    OUTPUT_TOKEN_BASE,
    TokenFn,
    assert_no_leak,
    make_harness,
    make_request,
    scripted,
)

EOS = 2


def test_the_core_imports_without_torch() -> None:
    code = ("import sys; import conveyor.core.scheduler, conveyor.core.kv_cache_manager, "
            "conveyor.core.block_pool, conveyor.core.policy, conveyor.core.outputs, "
            "conveyor.request, conveyor.config; sys.path.insert(0, 'tests'); "
            "import core_helpers; assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=_repo_root(), timeout=60)
    assert done.returncode == 0, done.stderr


def _repo_root() -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parent.parent)


def _expected_outputs(request_id: str, n: int) -> list[int]:
    return [OUTPUT_TOKEN_BASE + i for i in range(n)]


# ---------------------------------------------------------------- budget and admission
def test_token_budget_and_max_num_seqs_hold_and_the_budget_is_used() -> None:
    h = make_harness(max_num_seqs=4, max_num_batched_tokens=32)
    requests = [make_request(f"r{i}", range(100 * i, 100 * i + 20), max_tokens=5)
                for i in range(10)]
    h.add(*requests)
    first = h.step()
    # r0 gets its 20 prompt tokens, r1 a 12-token chunk: the budget is spent exactly.
    assert [(s.request_id, s.num_new_tokens, s.samples) for s in first.scheduled] == \
        [("r0", 20, True), ("r1", 12, False)]
    assert first.total_num_scheduled_tokens == 32
    h.run()  # check_step asserts both caps at every step
    assert max(len(o.scheduled) for o in h.outputs) == 4
    assert max(o.total_num_scheduled_tokens for o in h.outputs) == 32
    for r in requests:
        assert r.output_token_ids == _expected_outputs(r.request_id, 5)
        assert r.status == RequestStatus.FINISHED_LENGTH


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room() -> None:
    h = make_harness(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    a, b = make_request("a", range(40), 3), make_request("b", range(100, 140), 3)
    h.add(a, b)
    first = h.step()
    assert [(s.request_id, s.num_new_tokens) for s in first.scheduled] == [("a", 40)]
    second = h.step()
    assert [(s.request_id, s.num_new_tokens) for s in second.scheduled] == [("a", 1), ("b", 40)]
    h.run()


def test_a_finished_requests_slot_is_refilled_in_the_very_next_step() -> None:
    h = make_harness(max_num_seqs=2)
    a, b, c = (make_request("a", range(5), 2), make_request("b", range(10, 15), 10),
               make_request("c", range(20, 25), 3))
    h.add(a, b, c)
    h.step()  # a, b admitted; c waits for a slot
    assert h.sched.num_waiting == 1
    h.step()  # a's second token: finished, blocks freed in update
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert "a" not in h.kv.block_tables
    out = h.step()
    assert [r.request_id for r in out.new_requests] == ["c"]
    assert out.finished_request_ids == {"a"}
    assert h.sched.num_running == 2
    h.run()


def test_fcfs_admission_order() -> None:
    h = make_harness(max_num_seqs=2, max_num_batched_tokens=16)
    rng = random.Random(7)
    ids = [f"r{i}" for i in range(8)]
    for rid in ids:
        h.add(make_request(rid, [rng.randrange(50) for _ in range(rng.randint(1, 30))],
                           rng.randint(1, 6)))
    h.run()
    admitted = [r.request_id for o in h.outputs for r in o.new_requests]
    assert admitted == ids


def test_long_prompt_is_chunked_while_running_decodes_get_a_token_every_step() -> None:
    h = make_harness(max_num_batched_tokens=16)
    d1, d2 = make_request("d1", range(4), 30), make_request("d2", range(10, 14), 30)
    h.add(d1, d2)
    h.step()
    long = make_request("long", range(100, 200), 2)  # 100 tokens, 14 per step
    h.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = h.step()
        by_id = {s.request_id: s for s in out.scheduled}
        assert by_id["d1"].num_new_tokens == 1 and by_id["d1"].samples
        assert by_id["d2"].num_new_tokens == 1 and by_id["d2"].samples
        chunks.append((by_id["long"].num_new_tokens, by_id["long"].samples))
    assert chunks == [(14, False)] * 7 + [(2, True)]
    h.run()
    assert long.output_token_ids == _expected_outputs("long", 2)


# ---------------------------------------------------------------- refusal at admission
def test_a_prompt_at_the_context_length_is_refused() -> None:
    h = make_harness(max_model_len=32)
    with pytest.raises(ValueError, match="maximum context length"):
        h.add(make_request("r", range(32), 1, max_model_len=32))
    h.add(make_request("ok", range(31), 1, max_model_len=32))
    assert h.sched.num_waiting == 1
    h.run()


def test_a_request_that_can_never_fit_in_the_cache_is_refused() -> None:
    h = make_harness(num_blocks=4, block_size=4)  # 16 tokens of KV
    with pytest.raises(ValueError, match="blocks"):
        # 10 + 8 tokens, but the last sampled token needs no KV: 17 tokens, 5 blocks
        h.add(make_request("big", range(10), 8))
    h.add(make_request("fits", range(10), 7))  # 16 tokens of KV: exactly the cache
    with pytest.raises(ValueError):
        h.add(make_request("huge", range(40), 1))
    h.run()
    assert not h.sched.has_unfinished_requests()
    assert h.kv.num_free_blocks == h.kv.num_blocks
    fits = make_request("fits", range(10), 6)
    h.add(fits)
    h.run()
    assert fits.num_output_tokens == 6


def test_a_duplicate_request_id_is_refused() -> None:
    h = make_harness()
    h.add(make_request("r", [1, 2, 3]))
    with pytest.raises(ValueError, match="already in use"):
        h.add(make_request("r", [4, 5]))
    h.run()


# ---------------------------------------------------------------- preemption
def test_preemption_victim_is_the_newest_it_resumes_first_and_recomputes() -> None:
    # 6 blocks of 4 tokens. a, b, c each grow to 16 tokens (4 blocks): they can't all fit.
    h = make_harness(num_blocks=6, block_size=4, enable_caching=False, max_num_seqs=3)
    a, b, c = (make_request(n, range(10 * i, 10 * i + 4), 12) for i, n in enumerate("abc"))
    d = make_request("d", range(90, 94), 12)
    h.add(a, b, c, d)
    while not h.sched.stats.num_preemptions:
        out = h.step()
    assert out.preempted_request_ids == {"c"}  # the most recently admitted
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert "c" not in h.kv.block_tables
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert h.sched.policy.peek() is c  # back at the front, ahead of d
    generated_before = list(c.output_token_ids)
    assert generated_before

    h.run()
    resumed = [(i, o) for i, o in enumerate(h.outputs)
               if "c" in {r.request_id for r in o.new_requests}][1]  # 0 = first admission
    step_c, out_c = resumed
    new_c = next(r for r in out_c.new_requests if r.request_id == "c")
    assert new_c.all_token_ids[:4] == c.prompt_token_ids
    assert len(new_c.all_token_ids) >= 4 + len(generated_before)
    item = next(s for s in out_c.scheduled if s.request_id == "c")
    assert item.num_computed_tokens == 0  # recompute from scratch (no prefix cache here)
    assert item.num_new_tokens == len(new_c.all_token_ids)
    step_d = next(i for i, o in enumerate(h.outputs)
                  if "d" in {r.request_id for r in o.new_requests})
    assert step_c < step_d or [r.request_id for r in out_c.new_requests].index("c") \
        < [r.request_id for r in out_c.new_requests].index("d")

    stats = h.sched.stats
    assert stats.num_preemptions == sum(r.num_preemptions for r in (a, b, c, d)) >= 1
    assert stats.num_preempted_tokens > 0
    for r in (a, b, c, d):
        assert r.output_token_ids == _expected_outputs(r.request_id, 12)
        assert r.status == RequestStatus.FINISHED_LENGTH


def test_preempted_request_resumes_from_its_cached_blocks() -> None:
    h = make_harness(num_blocks=6, block_size=4, enable_caching=True, max_num_seqs=3)
    reqs = [make_request(n, range(10 * i, 10 * i + 4), 12) for i, n in enumerate("abc")]
    h.add(*reqs)
    h.run()
    assert h.sched.stats.num_preemptions >= 1
    seen, resumes = set(), []
    for out in h.outputs:
        for new in out.new_requests:
            if new.request_id in seen:
                item = next(s for s in out.scheduled if s.request_id == new.request_id)
                resumes.append((item.num_computed_tokens, len(new.all_token_ids)))
            seen.add(new.request_id)
    # b was preempted after its blocks filled; its full blocks survived and are reused
    assert any(0 < computed < total for computed, total in resumes), resumes
    for r in reqs:
        assert r.output_token_ids == _expected_outputs(r.request_id, 12)
        assert r.num_cached_tokens == 0  # counts hits at first admission only


# ---------------------------------------------------------------- aborts
def test_abort_waiting_running_finished_and_unknown_ids() -> None:
    h = make_harness(max_num_seqs=1)
    running, waiting, done = (make_request("run", range(9), 50),
                              make_request("wait", range(20, 29), 5),
                              make_request("done", range(40, 45), 1))
    h.add(done)
    h.step()
    assert done.status.finished
    h.add(running, waiting)
    h.step()
    h.step()
    assert running.status == RequestStatus.RUNNING and waiting.status == RequestStatus.WAITING
    free_before = h.kv.num_free_blocks

    assert h.sched.abort_requests(["wait"]) == [waiting]
    assert h.sched.num_waiting == 0
    assert h.sched.abort_requests(["run"]) == [running]
    assert h.kv.num_free_blocks == h.kv.num_blocks > free_before  # freed at once
    assert running.status == RequestStatus.FINISHED_ABORTED
    assert running.status.finish_reason == "abort"
    for _ in range(2):  # finished, aborted and unknown ids: harmless, twice
        assert h.sched.abort_requests(["done", "run", "wait", "nope"]) == []
    assert not h.sched.has_unfinished_requests()
    assert_no_leak(h.sched)
    out = h.step()
    assert out.is_empty
    assert out.finished_request_ids == {"run", "wait"}
    assert done.status == RequestStatus.FINISHED_LENGTH  # untouched by the abort


def test_abort_between_schedule_and_update_is_ignored_by_update() -> None:
    h = make_harness()
    a, b = make_request("a", range(6), 5), make_request("b", range(10, 16), 5)
    h.add(a, b)
    out = h.sched.schedule()
    runner_out = h.runner.execute(out)
    h.sched.abort_requests(["a"])
    updated = h.sched.update(out, runner_out)
    assert updated == [b]
    assert a.output_token_ids == [] and a.status == RequestStatus.FINISHED_ABORTED
    h.run()
    assert b.num_output_tokens == 5


def test_abort_of_a_preempted_request() -> None:
    h = make_harness(num_blocks=6, block_size=4, enable_caching=False, max_num_seqs=3)
    reqs = [make_request(n, range(10 * i, 10 * i + 4), 12) for i, n in enumerate("abc")]
    h.add(*reqs)
    while not h.sched.stats.num_preemptions:
        h.step()
    assert reqs[2].status == RequestStatus.PREEMPTED
    assert h.sched.abort_requests(["c"]) == [reqs[2]]
    assert h.sched.num_waiting == 0
    h.run()
    assert [r.status for r in reqs] == [RequestStatus.FINISHED_LENGTH] * 2 \
        + [RequestStatus.FINISHED_ABORTED]


# ---------------------------------------------------------------- stop conditions
def _run_one(script: list[int], max_tokens: int | None = 10, **sampling: object) -> Request:
    h = make_harness(token_fn=scripted({"r": script}))
    r = make_request("r", range(3, 9), max_tokens, eos=(EOS,), **sampling)  # type: ignore[arg-type]
    h.add(r)
    h.run()
    return r


def test_stop_on_eos_keeps_the_eos_token() -> None:
    r = _run_one([10, 11, EOS, 12])
    assert r.output_token_ids == [10, 11, EOS]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.status.finish_reason == "stop"


def test_stop_on_stop_token_ids() -> None:
    r = _run_one([10, 11, 42, 12], stop_token_ids=[42])
    assert r.output_token_ids == [10, 11, 42]
    assert r.status.finish_reason == "stop"


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    r = _run_one([EOS, 42, 11, EOS, 12], min_tokens=3, stop_token_ids=[42])
    assert r.output_token_ids == [EOS, 42, 11, EOS]
    assert r.status.finish_reason == "stop"


def test_ignore_eos_runs_to_max_tokens() -> None:
    r = _run_one([EOS] * 10, max_tokens=5, ignore_eos=True)
    assert r.output_token_ids == [EOS] * 5
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.status.finish_reason == "length"


def test_max_tokens_finishes_with_length() -> None:
    r = _run_one([], max_tokens=4)
    assert r.num_output_tokens == 4
    assert r.status.finish_reason == "length"


def test_max_model_len_caps_the_output() -> None:
    h = make_harness(max_model_len=10)
    r = make_request("r", range(7), None, max_model_len=10)
    h.add(r)
    h.run()
    assert r.num_output_tokens == 3 and r.num_tokens == 10
    assert r.status.finish_reason == "length"


def test_eos_as_the_last_allowed_token_is_a_stop() -> None:
    r = _run_one([10, EOS], max_tokens=2)
    assert r.output_token_ids == [10, EOS]
    assert r.status.finish_reason == "stop"


def test_finish_requests_from_outside() -> None:
    h = make_harness()
    a, b = make_request("a", range(6), 20), make_request("b", range(10, 16), 4)
    h.add(a, b)
    h.step()
    h.step()
    h.sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert a.status.finish_reason == "stop"
    assert "a" not in h.kv.block_tables and h.sched.running == [b]
    h.sched.finish_requests(["a", "unknown"], RequestStatus.FINISHED_STOPPED)  # harmless
    out = h.step()
    assert "a" in out.finished_request_ids
    assert [s.request_id for s in out.scheduled] == ["b"]
    h.run()
    assert a.num_output_tokens == 2


def test_finish_requests_on_a_waiting_request_never_runs_it() -> None:
    h = make_harness(max_num_seqs=1)
    a, b = make_request("a", range(6), 3), make_request("b", range(10, 16), 3)
    h.add(a, b)
    h.step()  # a runs, b waits
    h.sched.finish_requests(["b"], RequestStatus.FINISHED_STOPPED)
    h.run()
    assert b.status == RequestStatus.FINISHED_STOPPED
    for _ in range(3):
        out = h.sched.schedule()
        assert all(s.request_id != "b" for s in out.scheduled), "a finished request ran"
    assert b.num_output_tokens == 0
    assert_no_leak(h.sched)


# ---------------------------------------------------------------- prefix caching
def test_prefix_cache_hits_across_requests() -> None:
    h = make_harness(num_blocks=32, block_size=4)
    first = make_request("first", range(1, 21), 3)
    h.add(first)
    h.run()
    assert first.num_cached_tokens == 0
    second = make_request("second", [*range(1, 17), 90, 91, 92, 93, 94], 3)
    h.add(second)
    out = h.step()
    [item] = out.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens) == (16, 5)
    assert second.num_cached_tokens == 16
    same = make_request("same", range(1, 21), 3)  # 5 full blocks: the last is recomputed
    h.add(same)
    out = h.step()
    item = next(s for s in out.scheduled if s.request_id == "same")
    assert (item.num_computed_tokens, item.num_new_tokens) == (16, 4)
    h.run()
    for r in (first, second, same):
        assert r.output_token_ids == _expected_outputs(r.request_id, 3)
    assert h.kv.pool.stats.hits >= 32


def test_prefix_cache_shared_by_running_requests() -> None:
    h = make_harness(num_blocks=32, block_size=4)
    a = make_request("a", range(1, 21), 8)
    h.add(a)
    h.step()
    b = make_request("b", [*range(1, 13), 70, 71], 8)
    h.add(b)
    out = h.step()
    item = next(s for s in out.scheduled if s.request_id == "b")
    assert item.num_computed_tokens == 12
    assert item.block_ids[:3] == h.kv.block_tables["a"][:3]
    assert all(h.kv.pool.blocks[i].ref_count == 2 for i in item.block_ids[:3])
    h.run()


def test_no_prefix_hits_with_caching_disabled() -> None:
    h = make_harness(enable_caching=False)
    h.add(make_request("a", range(20), 2))
    h.run()
    b = make_request("b", range(20), 2)
    h.add(b)
    out = h.step()
    assert out.scheduled[0].num_computed_tokens == 0 and b.num_cached_tokens == 0
    h.run()


def test_prefix_cache_stats_count_a_blocked_request_once() -> None:
    h = make_harness(num_blocks=4, block_size=4)
    # a holds 3 of 4 blocks for 4 steps; b (2 blocks) waits at the head of the queue.
    h.add(make_request("a", range(12), 4), make_request("b", range(100, 108), 2))
    h.run()
    assert h.kv.pool.stats.queries == 12 + 8


# ---------------------------------------------------------------- randomized stress
def _expected(request: Request, token_fn: TokenFn, eos: tuple[int, ...]) -> list[int]:
    params, out = request.sampling_params, list[int]()
    while True:
        out.append(token_fn(request.request_id, len(out)))
        if len(out) >= request.max_tokens:
            return out
        if len(out) < params.min_tokens:
            continue
        if (not params.ignore_eos and out[-1] in eos) or out[-1] in params.stop_token_ids:
            return out


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_randomized_stress(seed: int, async_scheduling: bool) -> None:
    """Random arrivals, aborts, stops and preemptions (recompute); with async scheduling
    too, where a step is scheduled before the last one's results are in: the outputs are
    the same, the KV is exact (shadow-KV checks) and nothing leaks."""
    rng = random.Random(seed)
    eos = (EOS,)

    def token_fn(request_id: str, index: int) -> int:
        return random.Random(f"{seed}/{request_id}/{index}").randrange(1, 40)

    num_blocks, block_size = rng.randint(10, 20), 4
    h = make_harness(num_blocks=num_blocks, block_size=block_size, token_fn=token_fn,
                     enable_caching=rng.random() < 0.7, max_num_seqs=rng.randint(2, 8),
                     max_num_batched_tokens=rng.randint(8, 48), max_model_len=64,
                     async_scheduling=async_scheduling)
    prefixes = [[rng.randrange(1, 60) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    pending = []
    for i in range(30):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 60) for _ in range(rng.randint(1, 24))]
        sampling: dict[str, object] = {}
        if rng.random() < 0.2:
            sampling["ignore_eos"] = True
        if rng.random() < 0.2:
            sampling["stop_token_ids"] = [rng.randrange(1, 40)]
        max_tokens = rng.randint(1, 30)
        if rng.random() < 0.2:
            sampling["min_tokens"] = rng.randint(0, max_tokens)
        pending.append(make_request(f"r{i}", prompt[:60], max_tokens, eos=eos,
                                    max_model_len=64, **sampling))
    admitted, aborted, refused = [], set(), 0
    steps = 0
    while pending or h.sched.has_unfinished_requests():
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                request = pending.pop(0)
                try:
                    h.add(request)
                    admitted.append(request)
                except ValueError:
                    refused += 1
                    needed = h.kv.blocks_needed(request.num_prompt_tokens + request.max_tokens)
                    assert needed > num_blocks
        if admitted and rng.random() < 0.05:
            victim = rng.choice(admitted).request_id
            if h.sched.abort_requests([victim, "unknown"]):
                aborted.add(victim)
        h.step()
        assert_no_leak(h.sched)
        steps += 1
        assert steps < 3000, "no progress"
    h.step()  # flush finished ids to the runner
    h.drain()
    assert_no_leak(h.sched)
    assert h.kv.num_free_blocks == h.kv.num_blocks
    assert admitted and refused < 30
    assert h.sched.stats.num_preemptions > 0  # the small cache did force preemptions
    for request in admitted:
        assert request.status.finished
        if request.request_id in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
            continue
        expected = _expected(request, token_fn, eos)
        assert request.output_token_ids == expected, request.request_id
        assert request.status != RequestStatus.FINISHED_ABORTED


def test_an_empty_step_is_harmless() -> None:
    h = make_harness()
    out = h.sched.schedule()
    assert out.is_empty and out.total_num_scheduled_tokens == 0
    assert h.sched.update(out, ModelRunnerOutput(sampled_token_ids={})) == []
    assert_no_leak(h.sched)


def test_a_config_with_lengths_left_to_derive_is_refused() -> None:
    """0 means "derive it" in EngineArgs; the scheduler must get the derived values."""
    from conveyor.config import SchedulerConfig
    from conveyor.core.kv_cache_manager import KVCacheManager
    from conveyor.core.scheduler import Scheduler

    with pytest.raises(ValueError, match="max_model_len and max_num_batched_tokens"):
        Scheduler(SchedulerConfig(), KVCacheManager(8, 4))
    resolved = SchedulerConfig().resolved(4096)
    assert (resolved.max_model_len, resolved.max_num_batched_tokens) == (4096, 2048)
    assert Scheduler(resolved, KVCacheManager(8, 4)).config is resolved

"""Scheduling policies: priority (displacement, aging, no thrash), per-tenant fairness, and a
randomized stress of every policy x preemption mode against the shadow-KV fake runner.
The engine tests use the tiny random Llama; every workload ends with all KV blocks free."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from conveyor import LLM, SamplingParams
from conveyor.request import Request
from core_helpers import (
    Harness,
    assert_no_leak,
    make_policy_harness,
    make_policy_request,
)

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def tiny(tiny_llama_dir: Any, **engine_args: Any) -> LLM:
    args: dict[str, Any] = dict(dtype="float32", kv_cache_memory=1 << 20, max_model_len=1024,
                                step_trace=True)
    args.update(engine_args)
    return LLM(model=str(tiny_llama_dir), **args)


def prompt_ids(rng: random.Random, n: int, vocab: int = 400) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(n)]


def drain(llm: LLM, max_steps: int = 5000) -> list[str]:
    """Step until idle; the request ids in the order they finished."""
    finished: list[str] = []
    for _ in range(max_steps):
        if not llm.engine.has_unfinished_requests():
            return finished
        finished += [o.request_id for o in llm.engine.step() if o.finished]
    raise AssertionError("the engine made no progress")


def no_thrash(h: Harness, history: dict[str, list[int]]) -> None:
    """Record each preemption's output count; a request is preempted again only after it
    produced a token since its previous preemption."""
    out = h.outputs[-1]
    for request_id in out.preempted_request_ids:
        if (request := h.sched.requests.get(request_id)) is None:
            continue  # the step before's results ended it (async scheduling)
        history.setdefault(request_id, []).append(request.num_output_tokens)
    for request_id, counts in history.items():
        assert all(a < b for a, b in zip(counts, counts[1:], strict=False)), \
            f"{request_id} preempted again before it made progress: outputs at each {counts}"


# ---------------------------------------------------------------- priority
def test_late_urgent_request_displaces_a_running_one_and_finishes_first(
        tiny_llama_dir, kv_free) -> None:
    llm = tiny(tiny_llama_dir, policy="priority", max_num_seqs=2)
    rng = random.Random(0)
    lows = [prompt_ids(rng, 12) for _ in range(4)]
    for i, p in enumerate(lows):
        llm.engine.add_request({"prompt_token_ids": p}, GREEDY, request_id=f"low{i}", priority=5)
    finished = []
    for _ in range(3):  # the batch is full (max_num_seqs=2) and decoding
        finished += [o.request_id for o in llm.engine.step() if o.finished]
    assert llm.stats().num_requests_running == 2
    urgent = prompt_ids(rng, 12)
    llm.engine.add_request({"prompt_token_ids": urgent}, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True), request_id="urgent", priority=0)
    finished += drain(llm)
    assert finished[0] == "urgent", finished
    stats = llm.stats()
    assert stats.num_preemptions >= 1
    trace = llm.engine.step_trace
    first = next(s for s in trace if any(e.request_id == "urgent" for e in s.scheduled))
    assert first.step == 4, "the urgent request waited although it may displace"
    assert any(p.startswith("low") for p in first.preempted), first
    kv_free(llm)


def _aging_run(aging_steps: int, max_steps: int = 300) -> tuple[Request, int, Harness]:
    """One priority-3 request, then a stream of priority-0 arrivals (one per step) that
    alone keeps max_num_seqs=2 saturated. Returns the low request and the step it finished
    (or -1), with the stream still arriving."""
    h = make_policy_harness(policy="priority", max_num_seqs=2, max_num_batched_tokens=64,
                            priority_aging_steps=aging_steps)
    low = make_policy_request("low", range(10, 18), 4, priority=3)
    h.add(low)
    history: dict[str, list[int]] = {}
    done_at = -1
    for step in range(max_steps):
        h.add(make_policy_request(f"hi{step}", range(20 + step % 7, 28 + step % 7), 3,
                                  priority=0))
        h.step()
        no_thrash(h, history)
        if done_at < 0 and low.status.finished:
            done_at = step
            break
    assert h.sched.num_waiting > 0, "the stream did not keep the batch saturated"
    return low, done_at, h


def test_aging_lets_a_low_priority_request_finish_under_a_stream_of_urgent_ones() -> None:
    low, done_at, h = _aging_run(aging_steps=2)
    assert done_at >= 0, "the low-priority request starved"
    assert low.num_output_tokens == 4
    assert low.num_preemptions <= low.num_output_tokens + 1
    for request in list(h.sched.requests.values()):
        h.sched.abort_requests([request.request_id])
    assert_no_leak(h.sched)


def test_without_aging_the_same_stream_starves_the_low_priority_request() -> None:
    """The control for the test above: the stream really is enough to starve."""
    low, done_at, h = _aging_run(aging_steps=10**6, max_steps=150)
    assert done_at < 0 and low.num_output_tokens < 4
    for request in list(h.sched.requests.values()):
        h.sched.abort_requests([request.request_id])
    assert_no_leak(h.sched)


def test_a_preempted_request_is_not_preempted_again_before_it_produced_a_token() -> None:
    # Two slots; urgent requests keep arriving while low ones run: every displacement must
    # leave its victim alone until it has produced a token.
    h = make_policy_harness(policy="priority", max_num_seqs=2, max_num_batched_tokens=32,
                            priority_aging_steps=4, enable_caching=False)
    history: dict[str, list[int]] = {}
    rng = random.Random(3)
    for i in range(6):
        h.add(make_policy_request(f"low{i}", range(30 * i, 30 * i + 9), 6, priority=2))
    for step in range(60):
        if step % 2 == 0:
            h.add(make_policy_request(f"hi{step}", prompt_ids(rng, 5), 2,
                                      priority=rng.choice([0, 1])))
        h.step()
        no_thrash(h, history)
    h.run()
    assert h.sched.stats.num_preemptions > 0 and history


def test_a_preempted_request_keeps_its_place_ahead_of_later_equals() -> None:
    h = make_policy_harness(policy="priority", max_num_seqs=1, max_num_batched_tokens=64,
                            priority_aging_steps=8)
    first = make_policy_request("first", range(10, 14), 20, priority=1)
    h.add(first)
    h.step()
    h.add(make_policy_request("later", range(40, 44), 2, priority=1))  # waits behind first
    for _ in range(6):
        h.step()
    h.add(make_policy_request("urgent", range(60, 64), 2, priority=0))  # displaces first
    h.step()
    assert first.num_preemptions == 1
    order = []
    while h.sched.has_unfinished_requests():
        out = h.step()
        order += [r.request_id for r in out.new_requests if r.request_id not in order]
    assert order.index("first") < order.index("later"), order
    assert_no_leak(h.sched)


# ---------------------------------------------------------------- fairness
def _tenant_tokens(llm: LLM, users: dict[str, str]) -> Counter[str]:
    """Tokens computed per tenant in the steps where every tenant still had a request
    waiting (both backlogged), from the step trace."""
    tokens: Counter[str] = Counter()
    tenants = set(users.values())
    for step in llm.engine.step_trace or []:
        if {users[r] for r in step.waiting} != tenants:
            continue
        for request_id, num_tokens, _ in step.scheduled:
            tokens[users[request_id]] += num_tokens
    return tokens


def _fair_workload(llm: LLM, counts: dict[str, int]) -> dict[str, str]:
    rng = random.Random(5)
    users = {}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    order = [t for t, n in counts.items() for _ in range(n)]
    for i, tenant in enumerate(order):  # the flooding tenant's requests come first
        request_id = f"{tenant}{i}"
        llm.engine.add_request({"prompt_token_ids": prompt_ids(rng, 10)}, params,
                               request_id=request_id, user=tenant)
        users[request_id] = tenant
    drain(llm)
    return users


def test_fair_share_holds_when_one_tenant_sends_ten_times_more(tiny_llama_dir, kv_free) -> None:
    llm = tiny(tiny_llama_dir, policy="fair", max_num_seqs=4)
    users = _fair_workload(llm, {"flood": 60, "light": 6})
    tokens = _tenant_tokens(llm, users)
    total = sum(tokens.values())
    assert total > 100, "the tenants were never backlogged together"
    share = tokens["light"] / total
    assert 0.4 <= share <= 0.6, (share, tokens)
    kv_free(llm)


def test_fcfs_lets_the_flooding_tenant_take_the_batch(tiny_llama_dir, kv_free) -> None:
    """The control: without the fair policy the light tenant gets far less than half."""
    llm = tiny(tiny_llama_dir, policy="fcfs", max_num_seqs=4)
    users = _fair_workload(llm, {"flood": 60, "light": 6})
    finished_light = max(i for i, s in enumerate(llm.engine.step_trace or [])
                         if any(users[r] == "light" for r in s.finished))
    assert finished_light > len(llm.engine.step_trace or []) * 0.8
    kv_free(llm)


def test_tenant_weights_shift_the_shares_two_to_one(tiny_llama_dir, kv_free) -> None:
    llm = tiny(tiny_llama_dir, policy="fair", max_num_seqs=6, tenant_weights="a=2,b=1")
    users = _fair_workload(llm, {"a": 30, "b": 30})
    tokens = _tenant_tokens(llm, users)
    ratio = tokens["a"] / max(tokens["b"], 1)
    assert 1.6 <= ratio <= 2.5, (ratio, tokens)
    kv_free(llm)


def test_a_newcomer_starts_from_a_running_tenants_service_not_zero() -> None:
    """Tenant A's two long requests run, none waits; B arrives, then both queue 8 short
    ones. B starts from A's service (no banked credit: A is active though its queue is
    empty), so the two alternate instead of B taking every admission first."""
    h = make_policy_harness(num_blocks=2048, block_size=4, policy="fair", max_num_seqs=4)
    for i in range(2):
        h.add(make_policy_request(f"A-long{i}", list(range(1 + 50 * i, 33 + 50 * i)), 300,
                                  user="A"))
    for _ in range(100):
        h.step()
    for tenant, first in (("B", 500), ("A", 600)):
        for i in range(8):
            h.add(make_policy_request(f"{tenant}{i}", [first + i] * 8 + list(range(100, 124)),
                                      16, user=tenant))
    assert h.sched.policy.served["B"] >= h.sched.policy.served["A"] - 32  # ~A's, not 0
    order: list[str] = []
    while h.sched.has_unfinished_requests():
        order += [r.request_id for r in h.step().new_requests
                  if r.request_id not in order and "long" not in r.request_id]
    first_a = next(i for i, rid in enumerate(order) if rid.startswith("A"))
    assert first_a <= 3, order  # (as it was: all eight of B's first)
    assert_no_leak(h.sched)


def test_the_fair_policy_forgets_idle_tenants_it_would_not_treat_apart() -> None:
    """A client that sends a new `user` per request: each tenant's service is dropped once it
    is idle at or below the floor (it would rejoin at the floor anyway), so the table does not
    grow with every user ever seen."""
    h = make_policy_harness(num_blocks=256, block_size=4, policy="fair", max_num_seqs=4)
    for i in range(40):
        h.add(make_policy_request(f"r{i}", [10 + i, 11, 12, 13, 14], 4, user=f"user-{i}"))
        h.step()
    h.run()
    h.add(make_policy_request("last", [5, 6, 7], 2, user="last"))
    # (the last few users keep theirs: above the floor, 0 with nobody else active)
    assert len(h.sched.policy.served) <= 8, h.sched.policy.served
    h.run()
    assert_no_leak(h.sched)


# ---------------------------------------------------------------- randomized stress
def _stress(policy: str, preemption: str, seed: int, async_scheduling: bool = False) -> Harness:
    rng = random.Random(seed)
    h = make_policy_harness(num_blocks=24, block_size=4, policy=policy, preemption=preemption,
                            num_swap_blocks=12, max_num_seqs=rng.choice([2, 4, 8]),
                            max_num_batched_tokens=rng.choice([8, 16, 32]),
                            priority_aging_steps=rng.choice([1, 4, 16]),
                            async_scheduling=async_scheduling)
    requests = [make_policy_request(f"r{i}", prompt_ids(rng, rng.randrange(1, 30), 40),
                                    rng.randrange(1, 12), priority=rng.randrange(4),
                                    user=rng.choice("ab")) for i in range(40)]
    history: dict[str, list[int]] = {}
    steps = 0
    while requests or h.sched.has_unfinished_requests():
        for _ in range(rng.randrange(3)):
            if requests:
                h.add(requests.pop())
        h.step()  # check_step + the shadow-KV check of every position attended
        no_thrash(h, history)
        steps += 1
        assert steps < 5000, "no progress"
    h.drain()
    assert_no_leak(h.sched)
    return h


@pytest.mark.parametrize("policy,preemption", [
    ("fcfs", "recompute"), ("fcfs", "swap"), ("priority", "recompute"), ("priority", "swap"), ("fair", "recompute"), ("fair", "swap"),
])
def test_randomized_policy_stress_keeps_kv_exact(policy: str, preemption: str) -> None:
    for seed in range(30):
        _stress(policy, preemption, seed)
        # a step scheduled before the last one's results: a victim may have a token in
        # flight (recompute drops its K/V, swap copies it after that step wrote it)
        _stress(policy, preemption, seed, async_scheduling=True)

"""Speculative decoding in the torch-free core: the n-gram proposer, drafts in the scheduler's
budget and KV cache, and the shadow-KV fake runner verifying them (tests/core_helpers.py).

The fake runner's outputs are a function of (request, output index) only, so every workload
must give the same tokens with speculation on and off; the shadow KV fails a step that reads
a slot holding someone else's prefix (or a rejected draft's) from the cache.
"""

from __future__ import annotations

import pytest

from conveyor.config import SpeculativeConfig
from conveyor.core.spec_decode import NgramProposer, SpecDecoder
from core_helpers import assert_no_leak, make_harness, make_request

# Not adaptive: a step's drafts do not depend on how long the (fake) steps happened to take.
SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4,
                         prompt_lookup_min=2, adaptive=False)
ADAPTIVE = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4,
                             prompt_lookup_min=2)
CYCLE = list(range(10, 18))  # a prompt of this cycle repeated: its continuation is predictable


def copy_fn(noise_every: int = 0):
    """Outputs continue each request's prompt cycle; every ``noise_every``-th output is a
    fresh token instead (a draft of it is rejected)."""

    def token_fn(request_id: str, index: int) -> int:
        if noise_every and index % noise_every == noise_every - 1:
            return 500 + index
        return CYCLE[index % len(CYCLE)]

    return token_fn


def cycle_prompt(times: int = 2) -> list[int]:
    return CYCLE * times


def run_outputs(spec: SpeculativeConfig | None, requests, **harness) -> tuple[dict, object]:
    h = make_harness(speculative=spec, **harness)
    reqs = [make_request(rid, prompt, max_tokens, **kw) for rid, prompt, max_tokens, kw
            in requests]
    h.add(*reqs)
    h.run()
    return {r.request_id: list(r.output_token_ids) for r in reqs}, h


# ---------------------------------------------------------------- proposer
def test_ngram_proposer_takes_the_longest_match_and_its_continuation() -> None:
    p = NgramProposer(min_n=2, max_n=3)
    # [7, 8] occurs at 0 ([7, 8, 1]) and [6, 7, 8] at 4 ([6, 7, 8, 2, 3]): the longer wins.
    tokens = [7, 8, 1, 9, 6, 7, 8, 2, 3, 5, 6, 7, 8]
    assert p.propose(tokens, 2) == [2, 3]
    assert p.propose(tokens, 5) == [2, 3, 5, 6, 7]
    assert p.propose([1, 2, 3, 4, 5], 4) == []  # no earlier occurrence
    assert p.propose([1, 2, 9, 1, 2], 0) == []
    assert NgramProposer(3, 4).propose([1, 2, 9, 1, 2], 3) == []  # shorter than min_n
    # a repeating run proposes its continuation, not the one token before the end
    assert p.propose([7] * 10, 4) == [7, 7, 7, 7]
    # token ids whose bytes straddle others' (int32 little-endian) still match only whole ids
    assert p.propose([256, 1, 0, 0, 1, 0, 0, 0, 256, 1], 2) == [0, 0]


# ---------------------------------------------------------------- scheduler and KV
def test_outputs_equal_speculation_off_and_drafts_are_accepted() -> None:
    requests = [(f"r{i}", cycle_prompt(2 + i % 2), 30 + i, {}) for i in range(4)]
    off, _ = run_outputs(None, requests, token_fn=copy_fn(noise_every=7))
    on, h = run_outputs(SPEC, requests, token_fn=copy_fn(noise_every=7))
    assert on == off
    stats = h.sched.spec.stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_pos[3] > 0  # whole runs of 4 accepted
    verifies = [s for out in h.outputs for s in out.scheduled if s.spec_token_ids]
    assert sum(len(s.spec_token_ids) for s in verifies) == stats.num_draft_tokens
    assert len(h.outputs) < sum(r[2] for r in requests) // len(requests) + 8


def test_drafts_count_against_the_token_budget() -> None:
    budget = 7
    requests = [(f"r{i}", cycle_prompt(), 24, {}) for i in range(3)]
    on, h = run_outputs(SPEC, requests, token_fn=copy_fn(), max_num_batched_tokens=budget)
    totals = [out.total_num_scheduled_tokens for out in h.outputs]
    assert max(totals) == budget  # check_step asserts <= budget each step
    assert any(s.spec_token_ids for out in h.outputs for s in out.scheduled)
    off, _ = run_outputs(None, requests, token_fn=copy_fn(), max_num_batched_tokens=budget)
    assert on == off


def test_rejected_slots_are_given_back_at_once_and_never_cached() -> None:
    """After every step, a running request holds no block its tokens do not need: the
    slots a rejection left unused are free again. A second request whose prompt is the first
    one's prompt + outputs reads the first's cached blocks: had a block with a rejected draft
    been published, the shadow KV check fails there."""
    h = make_harness(speculative=SPEC, token_fn=copy_fn(noise_every=5), block_size=4)
    first = make_request("a", cycle_prompt(), 40)
    h.add(first)
    while h.sched.has_unfinished_requests():
        out = h.step()
        for request in h.sched.running:
            assert len(h.kv.block_tables[request.request_id]) <= \
                h.kv.blocks_needed(request.num_tokens)
        assert any(s.spec_token_ids for s in out.scheduled) or len(h.outputs) < 40
    assert_no_leak(h.sched)
    assert h.sched.spec.stats.num_accepted_tokens < h.sched.spec.stats.num_draft_tokens
    second = make_request("b", first.all_token_ids[:-1], 4)
    h.add(second)
    h.run()
    assert second.num_cached_tokens >= len(first.all_token_ids) - 1 - 4


def test_preemption_in_the_middle_of_speculation_leaks_nothing() -> None:
    """12 blocks of 4 tokens for 4 requests growing to 50 tokens each: requests carrying drafts
    are preempted and recomputed; every block is free at the end, outputs unchanged."""
    requests = [(f"r{i}", cycle_prompt(), 34, {}) for i in range(4)]
    off, _ = run_outputs(None, requests, token_fn=copy_fn(noise_every=6), num_blocks=24)
    on, h = run_outputs(SPEC, requests, token_fn=copy_fn(noise_every=6), num_blocks=24)
    assert on == off
    assert h.sched.stats.num_preemptions > 0
    assert h.sched.spec.stats.num_drafts > 0


def test_abort_while_a_verify_runs_leaks_nothing() -> None:
    h = make_harness(speculative=SPEC, token_fn=copy_fn())
    h.add(make_request("a", cycle_prompt(), 30), make_request("b", cycle_prompt(3), 30))
    out = h.sched.schedule()
    while not any(s.spec_token_ids for s in out.scheduled):
        h.sched.update(out, h.runner.execute(out))
        out = h.sched.schedule()
    verifying = next(s.request_id for s in out.scheduled if s.spec_token_ids)
    h.sched.abort_requests([verifying])  # between schedule and update, as a failed step
    h.sched.update(out, h.runner.execute(out))
    h.sched.check_integrity()
    h.run()
    assert_no_leak(h.sched)


def test_drafts_stop_at_max_tokens_and_tokens_after_eos_are_dropped() -> None:
    eos = 13  # the cycle's 4th token: outputs 10, 11, 12, 13 -> stops inside a verify
    requests = [("len", cycle_prompt(), 11, {}), ("eos", cycle_prompt(), 40, {"eos": (eos,)})]
    on, h = run_outputs(SPEC, requests, token_fn=copy_fn())
    for out in h.outputs:
        for s in out.scheduled:
            if s.spec_token_ids:
                request_max = 11 if s.request_id == "len" else 40
                num_out = s.num_computed_tokens + 1 - len(cycle_prompt())
                assert num_out + len(s.spec_token_ids) <= request_max
    assert len(on["len"]) == 11
    assert on["eos"] == [10, 11, 12, 13]
    assert on == run_outputs(None, requests, token_fn=copy_fn())[0]


def test_requests_without_a_match_decode_plainly() -> None:
    """No n-gram match (distinct prompt and outputs): every step is a plain decode."""
    requests = [("plain", list(range(100, 130)), 20, {})]
    _, h = run_outputs(SPEC, requests, token_fn=lambda rid, i: 700 + i)
    assert all(not s.spec_token_ids and s.num_new_tokens in (1, 30)
               for out in h.outputs for s in out.scheduled)
    assert h.sched.spec.stats.num_drafts == 0


# ---------------------------------------------------------------- adaptivity
def test_drafting_backs_off_for_a_request_whose_drafts_fail() -> None:
    """Drafts always wrong: outputs 10, 11, x, 10, 11, y, ... (x, y fresh) match the prompt's
    [10, 11] every third step, whose continuation 12 is never right. Without a back-off the
    request would draft 20 times."""
    requests = [("bad", cycle_prompt(3), 60, {})]
    _, h = run_outputs(SPEC, requests,
                       token_fn=lambda rid, i: (CYCLE[0], CYCLE[1], 600 + i)[i % 3])
    stats = h.sched.spec.stats
    assert stats.num_accepted_tokens <= 1  # the first output's [17, 10] is the prompt's
    assert 0 < stats.num_drafts < 60 // 6


def test_cost_model_turns_speculation_off_when_steps_are_compute_bound() -> None:
    spec = SpecDecoder(ADAPTIVE)
    request = make_request("a", cycle_prompt(), 50)
    assert spec.num_to_draft(request, 8) == 4  # no measurements yet: full drafts
    for tokens in range(1, 65, 4):  # compute-bound: 1 ms per token, nothing fixed
        spec.record_step(tokens, 0.001 * tokens)
    spec.begin_step(64, 64)
    assert spec.num_to_draft(request, 8) == 0
    assert spec.stats.num_steps_off == 1
    memory_bound = SpecDecoder(ADAPTIVE)
    for tokens in range(1, 65, 4):  # 20 ms of weight reads, 0.01 ms per token
        memory_bound.record_step(tokens, 0.020 + 0.00001 * tokens)
    memory_bound.begin_step(4, 4)
    assert memory_bound.num_to_draft(request, 8) == 4
    fixed = SpecDecoder(SPEC)  # adaptive off: the same compute-bound steps change nothing
    for tokens in range(1, 65, 4):
        fixed.record_step(tokens, 0.001 * tokens)
    fixed.begin_step(64, 64)
    assert fixed.num_to_draft(request, 8) == 4 and fixed.stats.num_steps_off == 0


def test_draft_model_cost_is_charged_to_drafts() -> None:
    """Memory-bound steps (drafts pay with n-gram), but a draft model whose proposal costs
    as much per draft token as a whole step: drafting switches off, and the draft model's
    seconds do not count in the step's fitted cost (priced from the 8th drafting step on).
    A draft model ten times cheaper than the step drafts fully."""
    request = make_request("a", cycle_prompt(), 50)
    costly, cheap = SpecDecoder(ADAPTIVE), SpecDecoder(ADAPTIVE)
    for tokens in range(1, 65, 4):  # 20 ms of weight reads, 0.01 ms per token
        step = 0.020 + 0.00001 * tokens
        costly.record_step(tokens, step + 4 * step, num_drafts=4, draft_seconds=4 * step)
        cheap.record_step(tokens, step + 0.4 * step, num_drafts=4, draft_seconds=0.4 * step)
    a, b = costly.cost.fit()  # type: ignore[misc]
    assert a == pytest.approx(0.020) and b == pytest.approx(0.00001)
    costly.begin_step(4, 4)
    assert costly.num_to_draft(request, 8) == 0 and costly.stats.num_steps_off == 1
    early = SpecDecoder(ADAPTIVE)  # the same costly drafts, 7 of them: not priced yet
    for i, tokens in enumerate(range(1, 65, 4)):
        step, drafts = 0.020 + 0.00001 * tokens, 4 if i < 7 else 0
        early.record_step(tokens, step + drafts * step, drafts, drafts * step)
    early.begin_step(4, 4)
    assert early.num_to_draft(request, 8) == 4
    cheap.begin_step(1, 1)
    assert cheap.num_to_draft(request, 8) == 4


# ---------------------------------------------------------------- draft model
DRAFT = SpeculativeConfig(method="draft_model", model="draft.gguf", num_speculative_tokens=3,
                          adaptive=False)


def test_draft_model_drafts_are_left_to_the_runner() -> None:
    """method draft_model: the scheduler decides how many drafts each decode verifies and
    gives them slots, with no ids (the runner's draft model proposes them; here the fake
    runner's draft_fn, right except every 5th output). Prompts without any repetition draft
    too; outputs equal speculation off, rejected slots come back, nothing leaks."""
    requests = [(f"r{i}", list(range(100 + 40 * i, 130 + 40 * i)), 25, {}) for i in range(3)]
    token_fn = lambda rid, i: 700 + i  # noqa: E731
    draft_fn = lambda rid, i: 0 if i % 5 == 4 else 700 + i  # noqa: E731
    off, _ = run_outputs(None, requests, token_fn=token_fn)
    on, h = run_outputs(DRAFT, requests, token_fn=token_fn, draft_fn=draft_fn, block_size=4)
    assert on == off
    verifies = [s for out in h.outputs for s in out.scheduled if s.num_spec_tokens]
    assert verifies and all(not s.spec_token_ids and s.num_new_tokens == s.num_spec_tokens + 1
                            for s in verifies)
    stats = h.sched.spec.stats
    assert sum(s.num_spec_tokens for s in verifies) == stats.num_draft_tokens
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_pos[2] > 0
    assert len(h.outputs) < 25


# ---------------------------------------------------------------- grammar-forced drafts
def forced_fn(token_fn, every: int = 4, count: int = 3, wrong: int | None = None):
    """At every ``every``-th output index the next ``count`` outputs are forced (a grammar's
    next JSON key, say): ``token_fn``'s own tokens, except that with ``wrong`` the token at
    that place of the run is another one (a forced tokenization the mask does not allow:
    the verify rejects it there)."""

    def forced(request_id: str, index: int) -> list[int]:
        if index % every:
            return []
        run = [token_fn(request_id, index + j) for j in range(count)]
        if wrong is not None:
            run[wrong] = 1
        return run

    return forced


def forced_verifies(h) -> list:
    return [s for out in h.outputs for s in out.scheduled if s.spec_token_ids]


@pytest.mark.parametrize("spec", [None, SPEC], ids=["alone", "with-ngram"])
def test_grammar_forced_tokens_are_verified_as_drafts(spec) -> None:
    """Without speculative decoding (or in place of its n-gram drafts), a decode verifies
    the tokens its grammar forces: outputs unchanged, in fewer steps, every forced token
    accepted and counted, none past max_tokens, nothing leaks (12 blocks of 4 tokens for
    four requests of up to 40 tokens: preemptions too)."""
    token_fn = copy_fn(noise_every=7)
    requests = [(f"r{i}", cycle_prompt(), 20 + 3 * i, {}) for i in range(4)]
    off, h_off = run_outputs(spec, requests, token_fn=token_fn, num_blocks=12)
    on, h = run_outputs(spec, requests, token_fn=token_fn, forced_fn=forced_fn(token_fn),
                        num_blocks=12)
    assert on == off
    assert h.sched.stats.num_preemptions > 0
    assert len(h.outputs) < len(h_off.outputs)
    stats, max_tokens = h.sched.stats, {r[0]: r[2] for r in requests}
    forced = []  # the verifies at an output index where the grammar forced tokens
    for s in forced_verifies(h):
        index = s.num_computed_tokens + 1 - len(cycle_prompt())
        if run := forced_fn(token_fn)(s.request_id, index):
            assert s.spec_token_ids == run[:len(s.spec_token_ids)]
            assert index + len(s.spec_token_ids) < max_tokens[s.request_id]  # + the sampled
            forced.append(s)
    assert forced and stats.num_forced_draft_tokens == sum(len(s.spec_token_ids)
                                                           for s in forced)
    assert stats.num_forced_accepted_tokens == stats.num_forced_draft_tokens
    if spec is not None:  # the n-gram drafts' counters leave the forced ones out
        assert h.sched.spec.stats.num_draft_tokens == sum(
            len(s.spec_token_ids) for s in forced_verifies(h)) - stats.num_forced_draft_tokens


def test_a_refused_forced_token_is_rejected_and_its_slots_come_back() -> None:
    """A forced run whose second token the model does not write: the verify keeps the
    first, the rejected slots are free again, outputs are unchanged."""
    token_fn = copy_fn()
    requests = [(f"r{i}", cycle_prompt(), 24, {}) for i in range(3)]
    off, _ = run_outputs(None, requests, token_fn=token_fn)
    h = make_harness(token_fn=token_fn, forced_fn=forced_fn(token_fn, wrong=1))
    reqs = [make_request(rid, prompt, n) for rid, prompt, n, _ in requests]
    h.add(*reqs)
    while h.sched.has_unfinished_requests():
        h.step()
        for request in h.sched.running:
            assert len(h.kv.block_tables[request.request_id]) <= \
                h.kv.blocks_needed(request.num_tokens)
    assert_no_leak(h.sched)
    assert {r.request_id: list(r.output_token_ids) for r in reqs} == off
    stats = h.sched.stats
    assert 0 < stats.num_forced_accepted_tokens < stats.num_forced_draft_tokens


def test_forced_drafts_are_not_the_draft_models() -> None:
    """method draft_model: a decode with forced tokens verifies them (ids set), the others
    leave their drafts to the runner's draft model (no ids); outputs unchanged."""
    requests = [(f"r{i}", list(range(100 + 40 * i, 130 + 40 * i)), 25, {}) for i in range(3)]
    token_fn = lambda rid, i: 700 + i  # noqa: E731
    off, _ = run_outputs(None, requests, token_fn=token_fn)
    on, h = run_outputs(DRAFT, requests, token_fn=token_fn, draft_fn=token_fn,
                        forced_fn=forced_fn(token_fn, every=5))
    assert on == off
    verifies = [s for out in h.outputs for s in out.scheduled if s.num_spec_tokens]
    assert any(s.spec_token_ids for s in verifies) and any(not s.spec_token_ids
                                                           for s in verifies)
    assert h.sched.stats.num_forced_draft_tokens == sum(len(s.spec_token_ids)
                                                        for s in verifies)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_drafts_take_only_what_admission_left(preemption: str) -> None:
    """An urgent request arrives needing every free block just as a running one could draft
    across a block boundary: it is admitted beside it, nobody preempted (drafts were placed
    first and the priority policy displaced their owner to make room for it)."""
    from conveyor.core.kv_cache_manager import KVCacheManager
    from conveyor.core.scheduler import Scheduler
    from core_helpers import Harness, SwapFakeRunner, make_policy_request, scheduler_config

    cycle = list(range(10, 18))
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=8, prompt_lookup_max=4,
                             prompt_lookup_min=2, adaptive=False)
    kv = KVCacheManager(12, 4, True, 40)
    sched = Scheduler(scheduler_config(policy="priority", preemption=preemption), kv,
                      speculative=spec)
    h = Harness(sched, SwapFakeRunner(12, 4, lambda rid, i: cycle[i % 8] if rid == "a"
                                      else 700 + i, 40))
    h.add(make_policy_request("a", cycle * 2, 30, priority=5))
    h.step()  # a's prompt: 4 blocks, 8 free; its next decode could draft 8 tokens (2 blocks)
    h.add(make_policy_request("b", list(range(100, 124)), 2, priority=0))  # 24 tokens: 6
    out = h.step()
    assert {s.request_id for s in out.scheduled} == {"a", "b"} and not out.preempted_request_ids
    h.run()
    assert sched.stats.num_preemptions == 0
    assert sched.spec is not None and sched.spec.stats.num_draft_tokens > 0  # a still drafts
    assert_no_leak(sched)

"""KV-cache features end to end: preemption by recompute and by swap, prefix caching (hit
rate, identical outputs, forced hash collisions), and the static / reserve baselines.
Engine tests use the tiny random Llama; torch-free ones the shadow-KV harness. Every
workload ends with all KV blocks free."""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest
import torch

import conveyor.core.block_pool as block_pool
import conveyor.core.kv_cache_manager as kv_cache_manager
from conveyor import LLM, SamplingParams
from conveyor.core.block_pool import BlockHash
from conveyor.outputs import RequestOutput
from core_helpers import Harness, assert_no_leak, make_policy_harness, make_policy_request

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
BLOCK_BYTES = 16 * 1024  # one 16-token block of the tiny model in float32


def tiny(tiny_llama_dir: Any, **engine_args: Any) -> LLM:
    args: dict[str, Any] = dict(dtype="float32", kv_cache_memory=1 << 20, max_model_len=1024)
    args.update(engine_args)
    return LLM(model=str(tiny_llama_dir), **args)


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def prompts64() -> list[dict[str, list[int]]]:
    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randrange(2, 400) for _ in range(rng.randrange(3, 61))]}
            for _ in range(64)]


@pytest.fixture(scope="module")
def unconstrained(tiny_llama_dir, prompts64, kv_free) -> list[list[int]]:
    llm = tiny(tiny_llama_dir, kv_cache_memory=512 * BLOCK_BYTES)
    outputs = llm.generate(prompts64, GREEDY)
    assert llm.stats().num_preemptions == 0
    kv_free(llm)
    return token_ids(outputs)


# ---------------------------------------------------------------- preemption
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_64_requests_in_a_few_sequences_of_kv_match_an_unconstrained_run(
        tiny_llama_dir, prompts64, unconstrained, kv_free, preemption: str) -> None:
    # 12 blocks of 16 tokens; a request needs up to 5 (60 + 16 tokens): a few sequences fit.
    llm = tiny(tiny_llama_dir, kv_cache_memory=12 * BLOCK_BYTES, preemption=preemption,
               swap_space=24 * BLOCK_BYTES / 2**30)
    assert llm.stats().kv_blocks_total == 12
    outputs = llm.generate(prompts64, GREEDY)
    assert token_ids(outputs) == unconstrained
    stats = llm.stats()
    assert 0 < stats.num_preemptions <= 4 * len(prompts64), stats
    assert all(o.metrics.num_preemptions <= 16 for o in outputs)
    if preemption == "swap":
        assert stats.num_swapped_blocks > 0
    else:
        assert stats.num_swapped_blocks == 0 and stats.num_preempted_tokens > 0
    kv_free(llm)


# ---------------------------------------------------------------- int8 KV cache
def test_int8_kv_cache_halves_the_bytes_and_keeps_outputs_batch_invariant(
        tiny_llama_dir, prompts64, kv_free) -> None:
    """kv_cache_dtype="int8": each (token, KV head) row is quantized with its own scale, so
    a block costs about half (float32 model: a quarter) and a prompt's output does not
    depend on its batch, its chunking or preemption (quantization is per row)."""
    roomy = tiny(tiny_llama_dir, kv_cache_dtype="int8")
    cfg = roomy.engine.model_config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.head_dim + 4)
    assert roomy.engine.kv_layout.bytes_per_token == per_token
    assert roomy.engine.runner.kv_caches.dtype == torch.int8
    assert roomy.stats().kv_blocks_total == (1 << 20) // (per_token * 16)
    alone = [token_ids(roomy.generate(p, GREEDY))[0] for p in prompts64[:4]]
    together = token_ids(roomy.generate(prompts64, GREEDY))
    assert together[:4] == alone
    kv_free(roomy)
    for preemption in ("recompute", "swap"):
        tight = tiny(tiny_llama_dir, kv_cache_dtype="int8", preemption=preemption,
                     kv_cache_memory=12 * 16 * per_token, swap_space=24 * 16 * per_token / 2**30,
                     max_num_batched_tokens=16)
        assert token_ids(tight.generate(prompts64, GREEDY)) == together
        assert tight.stats().num_preemptions > 0
        kv_free(tight)


def test_int8_kv_cache_stays_close_to_the_models_dtype(kv_free) -> None:
    """The default model in float32 with a float32 and an int8 KV cache: greedy outputs of
    most prompts are identical (quantization moves each K/V element by at most half a step
    of max|row| / 127), and the others agree for their first tokens."""
    from conftest_models import default_gguf

    default_gguf()
    prompts = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
               "Once upon a time", "The three primary colors are", "import numpy as np\n",
               "Water boils at", "List three fruits:"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for kv_dtype in ("auto", "int8"):
        llm = LLM(dtype="float32", kv_cache_memory="32MiB", max_model_len=256,
                  kv_cache_dtype=kv_dtype)
        outputs[kv_dtype] = token_ids(llm.generate(prompts, params))
        kv_free(llm)
    same = [a == b for a, b in zip(outputs["auto"], outputs["int8"], strict=True)]
    assert sum(same) >= 6, same
    assert all(a[:4] == b[:4] for a, b in zip(outputs["auto"], outputs["int8"], strict=True))


def test_kv_cache_dtype_is_validated(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="block_size"):  # the int8 layout packs 16 positions
        tiny(tiny_llama_dir, kv_cache_dtype="int8", block_size=8)


def test_swapped_block_counter_counts_each_copy_once() -> None:
    for seed in (17,):  # a step with two swap preemptions (caching on, FCFS: no other bug)
        h = _stress_seed("fcfs", "swap", seed, caching=True)
        copies = sum(len(o.swap_out) for o in h.outputs)
        assert h.sched.stats.num_swapped_blocks == copies, f"seed {seed}"


def _displaced_mid_prefill(preemption: str) -> None:
    """A low-priority request's last prompt chunk (two full blocks) is scheduled, then an
    urgent arrival displaces it in the same step: the chunk never runs."""
    h = make_policy_harness(policy="priority", max_num_seqs=1, max_num_batched_tokens=16,
                            preemption=preemption, num_swap_blocks=32)
    low = make_policy_request("low", range(100, 124), 4, priority=5)
    h.add(low)
    h.step()
    h.add(make_policy_request("urgent", range(200, 204), 2, priority=0))
    h.run()  # the fake runner checks every position each request attends to
    assert low.num_preemptions == 1
    h.add(make_policy_request("twin", range(100, 124), 4))  # same prompt: prefix-cache hits
    h.run()
    assert_no_leak(h.sched)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_chunk_unscheduled_by_displacement_leaves_no_stale_prefix_blocks(
        preemption: str) -> None:
    _displaced_mid_prefill(preemption)


def _stress_seed(policy: str, preemption: str, seed: int, caching: bool = False) -> Harness:
    rng = random.Random(seed)
    h = make_policy_harness(num_blocks=24, block_size=4, enable_caching=caching, policy=policy,
                            preemption=preemption, num_swap_blocks=12,
                            max_num_seqs=rng.choice([2, 4, 8]),
                            max_num_batched_tokens=rng.choice([8, 16, 32]),
                            priority_aging_steps=rng.choice([1, 4, 16]))
    requests = [make_policy_request(f"r{i}", [rng.randrange(3, 40)
                                              for _ in range(rng.randrange(1, 30))],
                                    rng.randrange(1, 12), priority=rng.randrange(4),
                                    user=rng.choice("ab")) for i in range(40)]
    steps = 0
    while requests or h.sched.has_unfinished_requests():
        for _ in range(rng.randrange(3)):
            if requests:
                h.add(requests.pop())
        h.step()
        steps += 1
        assert steps < 5000
    assert_no_leak(h.sched)
    return h


@pytest.mark.parametrize("seed", [1, 3, 7])
def test_swap_in_and_a_displacing_swap_out_in_one_step_keep_kv_exact(seed: int) -> None:
    _stress_seed("priority", "swap", seed)  # caching off: only the swap copies can go wrong


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_a_displaced_request_is_not_readmitted_in_the_same_step(policy: str) -> None:
    _stress_seed(policy, "recompute", 20)  # caching off, recompute: the harness's check_step


# ---------------------------------------------------------------- prefix caching
@pytest.fixture(scope="module")
def system_prompted() -> list[dict[str, list[int]]]:
    rng = random.Random(11)
    system = [rng.randrange(2, 400) for _ in range(200)]
    return [{"prompt_token_ids": system + [rng.randrange(2, 400) for _ in range(rng.randrange(4, 20))]}
            for _ in range(12)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_shared_system_prompt_hits_the_cache_and_outputs_match_uncached(
        tiny_llama_dir, system_prompted, kv_free, kv_cache_dtype: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tiny_kv = functools.partial(tiny, kv_cache_dtype=kv_cache_dtype)
    uncached = tiny_kv(tiny_llama_dir, enable_prefix_caching=False)
    want = token_ids(uncached.generate(system_prompted, params))
    assert uncached.stats().prefix_cache_hits == 0
    kv_free(uncached)
    cached = tiny_kv(tiny_llama_dir)
    first = cached.generate(system_prompted[:1], params)  # warms the cache
    rest = cached.generate(system_prompted[1:], params)
    assert token_ids(first + rest) == want
    stats = cached.stats()
    hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries
    assert hit_rate > 0.75, stats
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 192 for o in rest), [o.num_cached_tokens for o in rest]
    kv_free(cached)


def _collide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block hashes to the same value (its tokens still ride along)."""
    def colliding(parent: BlockHash | None, tokens: Any) -> BlockHash:
        return BlockHash(0, tuple(tokens))

    monkeypatch.setattr(block_pool, "hash_block", colliding)
    monkeypatch.setattr(kv_cache_manager, "hash_block", colliding)


def test_forced_collision_between_different_blocks_is_a_miss(
        tiny_llama_dir, monkeypatch, kv_free) -> None:
    rng = random.Random(4)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 400) for _ in range(40)]}
               for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = token_ids(tiny(tiny_llama_dir, enable_prefix_caching=False).generate(prompts, params))
    _collide(monkeypatch)
    llm = tiny(tiny_llama_dir)
    assert token_ids(llm.generate(prompts, params)) == want
    assert token_ids(llm.generate(prompts[::-1], params)) == want[::-1]
    kv_free(llm)




def test_forced_collision_with_equal_block_tokens_at_another_position_cannot_corrupt(
        tiny_llama_dir, monkeypatch, kv_free) -> None:
    rng = random.Random(5)
    block = [rng.randrange(2, 400) for _ in range(16)]
    prompts = [{"prompt_token_ids": block + [5, 6, 7]},
               {"prompt_token_ids": block + block + [8, 9]}]  # its 2nd block = the 1st
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = token_ids(tiny(tiny_llama_dir, enable_prefix_caching=False).generate(prompts, params))
    _collide(monkeypatch)
    llm = tiny(tiny_llama_dir)
    got = [token_ids(llm.generate(p, params))[0] for p in prompts]
    kv_free(llm)
    assert got == want


def test_forced_collision_in_the_harness_is_caught_by_the_shadow_kv(monkeypatch) -> None:
    _collide(monkeypatch)
    h = make_policy_harness()
    block = list(range(10, 14))
    h.add(make_policy_request("a", block + [1, 2], 2))
    h.run()
    h.add(make_policy_request("b", block + block + [3], 2))
    h.run()


# ---------------------------------------------------------------- static and reserve
def test_static_batching_admits_nothing_while_a_batch_is_unfinished(
        tiny_llama_dir, prompts64, kv_free) -> None:
    llm = tiny(tiny_llama_dir, scheduling="static", max_num_seqs=8, step_trace=True)
    rng = random.Random(3)
    params = [SamplingParams(temperature=0, max_tokens=rng.choice([2, 4, 12]), ignore_eos=True)
              for _ in range(24)]
    outputs = llm.generate(prompts64[:24], params)
    assert [len(t) for t in token_ids(outputs)] == [p.max_tokens for p in params]
    started: set[str] = set()
    batch: set[str] = set()  # unfinished members of the current batch
    decoded = False
    batches = 0
    for step in llm.engine.step_trace or []:
        new = {r for r, _, _ in step.scheduled} - started
        if new:
            assert not (decoded and batch), \
                f"step {step.step}: {sorted(new)} admitted while {sorted(batch)} unfinished"
            if not batch:
                batches += 1
            batch |= new
            started |= new
        decoded |= any(kind == "decode" for _, _, kind in step.scheduled)
        batch -= set(step.finished)
        if not batch:
            decoded = False
    assert batches >= 3 and len(started) == 24
    continuous = tiny(tiny_llama_dir, max_num_seqs=8)
    assert token_ids(continuous.generate(prompts64[:24], params)) == token_ids(outputs)
    assert continuous.stats().num_steps < llm.stats().num_steps
    kv_free(llm)
    kv_free(continuous)


def test_reserve_allocation_limits_concurrency_versus_paged(
        tiny_llama_dir, prompts64, kv_free) -> None:
    # 64 blocks of 16 tokens; max_model_len 256 = 16 blocks: reserve fits 4 sequences.
    stats = {}
    outputs = {}
    for mode in ("reserve", "paged"):
        llm = tiny(tiny_llama_dir, kv_allocation=mode, max_model_len=256, max_num_seqs=32)
        outputs[mode] = token_ids(llm.generate(prompts64[:32], GREEDY))
        stats[mode] = llm.stats()
        kv_free(llm)
    assert stats["reserve"].kv_blocks_total == 64
    assert stats["reserve"].peak_num_requests_running == 64 // (256 // 16)
    assert stats["paged"].peak_num_requests_running >= 4 * 4
    assert stats["reserve"].peak_kv_utilization < 0.5 * stats["paged"].peak_kv_utilization
    assert stats["paged"].peak_kv_utilization > 0.6
    assert outputs["reserve"] == outputs["paged"]

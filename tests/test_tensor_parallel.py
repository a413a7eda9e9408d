"""Tensor parallelism on CPU (gloo): tiny random models at TP=2 against TP=1, KV leaks on
every rank, worker death, bad input. Each TP=2 engine is one spawned worker process."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import TINY_KV_MEMORY
from conveyor import LLM, SamplingParams
from conveyor.config import EngineArgs, ModelConfig
from conveyor.model.parallel import ShardPlan
from conveyor.runner.tensor_parallel import TensorParallelError

# float32 logprobs at TP=2 against TP=1: the row-parallel matmuls add their halves in
# another order (an all-reduce of two partial sums), a few float32 ulps per layer.
LOGPROB_TOLERANCE = 1e-4
PROMPTS = [[5, 9, 23, 7], [100, 3, 44, 8, 12, 19, 250, 31, 2, 17, 64, 90], [77] * 40]


def _llm(folder: Path, tp: int, **kwargs: Any) -> LLM:
    return LLM(model=str(folder), dtype="float32", max_model_len=256,
               kv_cache_memory=kwargs.pop("kv_cache_memory", TINY_KV_MEMORY),
               tensor_parallel_size=tp, **kwargs)


@pytest.fixture(scope="module")
def gqa_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    # 8 query heads, 2 KV heads: each rank holds one KV group of 4 query heads.
    return tiny_model_factory("llama-gqa", "llama", num_attention_heads=8,
                              num_key_value_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def tp1(gqa_dir: Path) -> Iterator[LLM]:
    yield _llm(gqa_dir, 1)


@pytest.fixture(scope="module")
def tp2(gqa_dir: Path) -> Iterator[LLM]:
    llm = _llm(gqa_dir, 2)
    yield llm
    llm.shutdown()


def _workers_mirror_rank0(llm: LLM) -> None:
    """Every other rank holds exactly rank 0's requests, and a cache of rank 0's blocks."""
    executor = llm.engine.executor
    assert executor is not None
    for state in executor.probe():
        assert state.request_ids == tuple(sorted(executor.tokens)), state
        assert state.num_kv_blocks == llm.stats().kv_blocks_total


def test_logprobs_and_greedy_tokens_match_tp1(tp1: LLM, tp2: LLM, kv_free: Any) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5, ignore_eos=True,
                            prompt_logprobs=1)  # (their LM head runs on every rank too)
    want, got = tp1.generate(PROMPTS, params), tp2.generate(PROMPTS, params)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert w.prompt_logprobs is not None and g.prompt_logprobs is not None
        for lp_w, lp_g in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:], strict=True):
            assert lp_w is not None and lp_g is not None and lp_w.keys() == lp_g.keys()
            assert all(abs(lp_g[t].logprob - lp.logprob) < LOGPROB_TOLERANCE
                       for t, lp in lp_w.items())
        assert w.outputs[0].logprobs is not None and g.outputs[0].logprobs is not None
        for step_w, step_g in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert step_w.keys() == step_g.keys()  # the same top 5 at every step
            for token, lp in step_w.items():
                assert abs(step_g[token].logprob - lp.logprob) < LOGPROB_TOLERANCE
    kv_free(tp2)
    _workers_mirror_rank0(tp2)


def test_kv_capacity_grows_with_ranks(tp1: LLM, tp2: LLM) -> None:
    # The same per-device budget holds twice the tokens: each rank keeps one of 2 KV heads.
    one, two = tp1.stats(), tp2.stats()
    assert (one.tensor_parallel_size, two.tensor_parallel_size) == (1, 2)
    assert two.kv_cache_tokens == 2 * one.kv_cache_tokens
    executor = tp2.engine.executor
    assert executor is not None
    rank0_bytes = executor.kv_caches.numel() * executor.kv_caches.element_size()
    assert [s.kv_cache_bytes for s in executor.probe()] == [rank0_bytes]
    assert rank0_bytes <= TINY_KV_MEMORY


def test_mix_preemption_and_abort_leave_every_rank_free(gqa_dir: Path, kv_free: Any) -> None:
    # 24 blocks of 16 tokens for 6 requests of up to 100 tokens: preemption; 32-token steps:
    # prompts go in chunks beside other requests' decodes.
    llm = _llm(gqa_dir, 2, kv_cache_memory=24 * 16 * 2 * 2 * 8 * 4,
               max_num_batched_tokens=32)
    try:
        engine = llm.engine
        params = SamplingParams(max_tokens=60, temperature=0.8, seed=1, ignore_eos=True)
        ids = [engine.add_request([3 + i] * (20 + 7 * i), params) for i in range(6)]
        for _ in range(40):
            engine.step()
        engine.abort_request(ids[:2])
        while engine.has_unfinished_requests():
            engine.step()
        assert llm.stats().num_preemptions > 0
        kv_free(llm)
        engine.step()  # an empty step tells every rank about the last finished requests
        _workers_mirror_rank0(llm)
        assert not engine.runner.tokens
    finally:
        llm.shutdown()


def test_killed_worker_fails_the_engine_not_hangs(gqa_dir: Path) -> None:
    llm = _llm(gqa_dir, 2)
    try:
        engine = llm.engine
        assert engine.executor is not None
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(engine.executor.processes[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1 .* killed by signal 9"):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - start < 10
        with pytest.raises(TensorParallelError):  # and it stays failed
            llm.generate([[1, 2]], SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()


def test_bad_tensor_parallel_size(gqa_dir: Path) -> None:
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            EngineArgs(tensor_parallel_size=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tensor_parallel_size=3 exceeds the model's "
                                         "num_key_value_heads=2"):
        _llm(gqa_dir, 3)


def test_shard_plan_covers_the_model_once() -> None:
    # The default SmolLM2's shape: 9 query heads in 3 KV groups, 1536 MLP columns, 49152 tokens.
    cfg = ModelConfig("llama", vocab_size=49153, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64)
    plans = [ShardPlan(cfg, r, 2) for r in range(2)]
    assert [p.kv_heads for p in plans] == [(0, 2), (2, 1)]
    assert [p.q_heads for p in plans] == [(0, 6), (6, 3)]
    assert [p.intermediate for p in plans] == [(0, 768), (768, 768)]
    assert [p.vocab for p in plans] == [(0, 24577), (24577, 24577)]  # the last row padded
    assert all(p.intermediate[1] % 32 == 0 for p in plans)  # GGUF blocks stay whole
    o_parts = [p.slice_of("model.layers.0.self_attn.o_proj.weight") for p in plans]
    assert [(s.dim, s.start, s.length) for s in o_parts if s] == [(1, 0, 384), (1, 384, 192)]
    assert plans[1].slice_of("model.layers.0.input_layernorm.weight") is None
    assert plans[0].cache_config().num_key_value_heads == 2


def _assert_shards_make_the_whole(ckpt: Any, size: int, cfg: ModelConfig | None = None) -> None:
    """Every rank's slices, read alone, concatenate to the whole tensors (and GGUF blocks);
    a slice that cuts blocks has no blocks (its matmul keeps the dequantized weight)."""
    cfg = cfg or ckpt.config
    whole, whole_blocks = dict(ckpt.tensors()), ckpt.block_weights()
    plans = [ShardPlan(cfg, r, size) for r in range(size)]
    parts = [dict(ckpt.tensors(p)) for p in plans]
    part_blocks = [ckpt.block_weights(p) for p in plans]
    for name, tensor in whole.items():
        part = plans[0].slice_of(name)
        if part is None:
            assert all(p[name].equal(tensor) for p in parts), name
            continue
        joined = torch.cat([p[name] for p in parts], part.dim).narrow(
            part.dim, 0, tensor.shape[part.dim])
        assert joined.equal(tensor), name
        if name in whole_blocks:
            cut_blocks = part.dim == 1 and any(
                s.start % 32 or s.length % 32 for s in (p.slice_of(name) for p in plans) if s)
            assert all((name in b) != cut_blocks for b in part_blocks), name
            if not cut_blocks:
                joined_blocks = torch.cat([b[name][1] for b in part_blocks], part.dim)
                assert joined_blocks.narrow(part.dim, 0, whole_blocks[name][1].shape[part.dim]
                                            ).equal(whole_blocks[name][1]), name


def test_gguf_shards_are_read_alone_and_make_the_whole(tmp_path: Path) -> None:
    qtype = "Q4_1"  # the default model's
    import gguf

    from conveyor.model.loader import load_checkpoint
    from test_loader import _tiny_model, _write_gguf

    state = _tiny_model("llama", tie=False).state_dict()
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(path, "llama", state, permute=True, qtype=gguf.GGMLQuantizationType[qtype])
    _assert_shards_make_the_whole(load_checkpoint(path), 2)  # whole blocks everywhere
    # K and V of 4 heads (MHA), split 4 ways: one 16-wide head per rank, so the O
    # projection's column slices cut its 32-wide blocks.
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in state if ".k_proj." in n or ".v_proj." in n]:
        state[name] = torch.randn(64, 64, generator=gen)
    _write_gguf(path, "llama", state, permute=True, qtype=gguf.GGMLQuantizationType[qtype])
    ckpt = load_checkpoint(path)
    _assert_shards_make_the_whole(ckpt, 4, dataclasses.replace(ckpt.config,
                                                               num_key_value_heads=4))


def test_safetensors_shards_make_the_whole(gqa_dir: Path) -> None:
    from conveyor.model.loader import load_checkpoint

    _assert_shards_make_the_whole(load_checkpoint(str(gqa_dir)), 2)

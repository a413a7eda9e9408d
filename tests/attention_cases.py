"""Paged-attention steps built as the runner builds them (decodes first, then prefill chunks,
each sequence on scattered blocks of a cache full of random values), and the check of a kernel
backend against the torch reference path, for tests/test_triton_attention.py (CPU, Triton's
interpreter) and tests/test_gpu_attention.py (CUDA); an engine on a backend against the
reference ops, and Triton's compile for GPUs in a process of its own, for those and
tests/test_triton_ops.py."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from conveyor.attention.metadata import AttentionMetadata, PrefillChunk
from conveyor.attention.paged import paged_attention
from conveyor.ops import ReferenceBackend

# q, k, v, kv_cache, metadata, scale -> out
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata,
                   float], torch.Tensor]


@dataclass(frozen=True)
class Seq:
    """One sequence of a step: num_computed keys already cached, query_len rows now."""

    num_computed: int
    query_len: int = 1
    decode: bool = False  # one row attending as a decode (in the batch's decode part)
    generated_rows: int = 0  # a prefill chunk's last rows that recompute generated tokens


@dataclass(frozen=True)
class Step:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, KVH, D]
    v: torch.Tensor
    kv_cache: torch.Tensor  # [2, blocks, block_size, KVH, D], random where nothing is written
    meta: AttentionMetadata
    scale: float


def make_step(seqs: list[Seq], *, num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype, device: str = "cpu",
              seed: int = 0) -> Step:
    """A step over ``seqs`` (decodes must come first), each on its own random blocks."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(s.num_computed + s.query_len) // block_size) for s in seqs]
    num_blocks = sum(need) + 3  # a few blocks no sequence owns
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, prefills = [], [], []
    rows = 0
    for s, n in zip(seqs, need, strict=True):
        table, order = order[:n], order[n:]
        tables.append(table)
        pos = range(s.num_computed, s.num_computed + s.query_len)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in pos)
        if not s.decode:
            has_table = s.num_computed > 0 or s.generated_rows > 0
            prefills.append(PrefillChunk(rows, s.query_len, s.num_computed,
                                         torch.tensor(table, device=device) if has_table
                                         else None, s.generated_rows))
        rows += s.query_len
    decodes = [i for i, s in enumerate(seqs) if s.decode]
    assert decodes == list(range(len(decodes))), "decodes come first"
    decode_tables = decode_lens = None
    if decodes:
        width = max(need[i] for i in decodes)
        decode_tables = torch.zeros((len(decodes), width), dtype=torch.int64)
        for i in decodes:
            decode_tables[i, :need[i]] = torch.tensor(tables[i])
        decode_tables = decode_tables.to(device)
        decode_lens = torch.tensor([seqs[i].num_computed + 1 for i in decodes], device=device)
    meta = AttentionMetadata(torch.tensor(slots, device=device), len(decodes), decode_tables,
                             decode_lens, prefills)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return Step(rand(rows, num_heads, head_dim), rand(rows, num_kv_heads, head_dim),
                rand(rows, num_kv_heads, head_dim),
                rand(2, num_blocks, block_size, num_kv_heads, head_dim), meta,
                1 / math.sqrt(head_dim))


def check_against_reference(kernel: Kernel, step: Step, atol: float) -> None:
    """The kernel's output and the cache it leaves match the torch reference path's
    (``paged_attention`` with the reference ops): the same K/V written to the same slots,
    each row attending to the keys its position sees."""
    ref_cache, cache = step.kv_cache.clone(), step.kv_cache.clone()
    expected = paged_attention(ReferenceBackend(), step.q, step.k, step.v, ref_cache, step.meta,
                               step.scale)
    out = kernel(step.q, step.k, step.v, cache, step.meta, step.scale)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert torch.equal(cache, ref_cache)
    err = (out.float() - expected.float()).abs().max().item()
    assert err <= atol, f"max |kernel - reference| = {err} > {atol}"


def generate_on(llm: Any, backend: ReferenceBackend, prompts: list[list[int]], params: Any,
                kv_free: Callable[[Any], None]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy token ids and their logprobs from ``llm`` with ``backend`` as its
    ops (``ModelRunner.use_backend``), every KV block free after."""
    llm.engine.runner.use_backend(backend)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    kv_free(llm)
    return [(list(o.outputs[0].token_ids),
             [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]) for o in outs]


def assert_generates_as_reference(llm: Any, backend: ReferenceBackend,
                                  prompts: list[list[int]], params: Any,
                                  kv_free: Callable[[Any], None]) -> None:
    """``backend`` gives the reference ops' greedy tokens, and their logprobs to 1e-4 (the
    reference ops run first: their prompts' full blocks may then be prefix-cache hits)."""
    reference_out = generate_on(llm, ReferenceBackend(), prompts, params, kv_free)
    backend_out = generate_on(llm, backend, prompts, params, kv_free)
    for (ref_ids, ref_lp), (ids, lp) in zip(reference_out, backend_out, strict=True):
        assert ids == ref_ids
        assert lp == pytest.approx(ref_lp, abs=1e-4)


def compile_in_subprocess(code: str, cache_dir: Any) -> list[list[str]]:
    """Run ``code`` (which compiles Triton kernels for GPUs and prints a line per kernel) in a
    Python process of its own, without ``TRITON_INTERPRET`` (this process imported triton to
    interpret); its output's lines, split."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache_dir), PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [line.split() for line in result.stdout.splitlines()]

"""Decode attention with verify rows (issue 11): what R rows of each of 64 requests cost.

A verify step lays out a request's last token and its drafts as R consecutive decode rows
that share the request's block table (context lengths L, L+1, ...). This times
``decode_attention`` (the C++ kernel of the engine's dtype here: bf16 with AVX-512, float32
on AVX2) for 64 requests x R rows at SmolLM2-135M's shapes (9 query heads, 3 KV heads,
head_dim 64, block size 16), one layer, and prints ms per layer, x30 layers, and the cost of
each row past the first: over a cache of rows, and where the CPU has AMX also over the same
K/V in the tile layout the engine uses there (``reference.is_tiles``).
Usage: python docs/results/verify_attention_rows.py [CONTEXT ...]
"""

from __future__ import annotations

import sys
import time

import torch

from conveyor.ops import amx_available, cpu_kernels, dot_kernels_available, reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
REQUESTS, LAYERS = 64, 30


def time_rows(cache: torch.Tensor, tables: torch.Tensor, context: int, rows: int,
              dtype: torch.dtype) -> float:
    """Seconds per call for REQUESTS x rows decode rows (rows of a request adjacent)."""
    per_row = tables.repeat_interleave(rows, 0).contiguous()
    lens = torch.tensor([context + r for _ in range(REQUESTS) for r in range(rows)])
    q = torch.randn(REQUESTS * rows, HEADS, HEAD_DIM).to(dtype)
    scale = HEAD_DIM ** -0.5
    for _ in range(3):
        cpu_kernels.decode_attention(q, cache, per_row, lens, scale)
    reps = 30
    start = time.perf_counter()
    for _ in range(reps):
        cpu_kernels.decode_attention(q, cache, per_row, lens, scale)
    return (time.perf_counter() - start) / reps


def main(contexts: list[int]) -> None:
    if not cpu_kernels.load_cpu_kernels():
        raise SystemExit("the C++ kernels did not build")
    dtype = torch.bfloat16 if amx_available() or dot_kernels_available() else torch.float32
    print(f"dtype {dtype}, {torch.get_num_threads()} threads, AMX: {amx_available()}")
    torch.manual_seed(0)
    for context in contexts:
        blocks = (context + 8 + BLOCK - 1) // BLOCK  # room for the drafts
        cache = torch.randn(2, REQUESTS * blocks + 1, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
        tables = torch.randperm(REQUESTS * blocks)[:REQUESTS * blocks].view(REQUESTS, blocks)
        caches = {"rows": cache}
        if amx_available() and dtype == torch.bfloat16:
            _, shape = reference.kv_cache_shape(cache.shape[1], BLOCK, KV_HEADS, HEAD_DIM,
                                                "auto", dtype, tiles=True)
            tiles = torch.zeros(shape, dtype=dtype)
            slots = torch.arange(cache.shape[1] * BLOCK)
            cpu_kernels.write_kv_(cache[0].flatten(0, 1), cache[1].flatten(0, 1), tiles, slots)
            caches["tiles"] = tiles
        for layout, kv in caches.items():
            one = None
            for rows in (1, 2, 3, 5):
                ms = time_rows(kv, tables, context, rows, dtype) * 1e3
                one = ms if one is None else one
                extra = ("" if rows == 1 else
                         f", each row past the first {(ms - one) / (rows - 1):.3f} ms")
                print(f"{layout}: context {context}, {REQUESTS} x {rows} rows: {ms:.3f} ms per "
                      f"layer, {ms * LAYERS:.1f} ms for {LAYERS} layers{extra}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [200, 400])

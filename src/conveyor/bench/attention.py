"""Paged attention alone, per backend: ``python -m conveyor.bench.attention`` on a CUDA
device times one layer's attention call (K/V write included) for decode-only steps at each
batch size and context length, and for a prefill chunk on a cached prefix, with the torch
reference, the Triton kernel and FlashInfer (those that import), and prints the time per call
(the per-step setup shared by a step's layers excluded) and the K/V bytes read per second
(the roofline of a decode: HBM bandwidth).

On CPU only ``--backends torch`` (and ``triton`` with ``TRITON_INTERPRET=1``, slowly) run:
that checks the command, not the kernels' speed.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from conveyor.attention.metadata import AttentionMetadata, PrefillChunk
from conveyor.attention.paged import paged_attention
from conveyor.ops import ReferenceBackend

TIMED_CALLS = 20


@dataclass(frozen=True)
class AttentionTiming:
    backend: str
    kind: str  # "decode" (batch of one-row sequences) or "prefill" (one chunk on a prefix)
    batch: int
    context: int  # keys per sequence (prefix + query rows)
    query_len: int
    us_per_call: float
    kv_gb_per_s: float  # the K/V bytes the call must read, per second


def _kernel(name: str) -> Callable[..., torch.Tensor]:
    if name == "torch":
        return lambda *a: paged_attention(ReferenceBackend(), *a)
    if name == "triton":
        from conveyor.attention.triton_paged import triton_paged_attention
        return triton_paged_attention
    from conveyor.attention.flashinfer_paged import flashinfer_paged_attention
    return flashinfer_paged_attention


def _meta(batch: int, context: int, query_len: int, block_size: int,
          device: torch.device) -> AttentionMetadata:
    """Sequences on consecutive blocks; decodes if query_len is 1, else prefill chunks."""
    nblocks = math.ceil(context / block_size)
    tables = torch.arange(batch * nblocks, device=device).view(batch, nblocks)
    pos = torch.arange(context - query_len, context, device=device)
    slots = (tables[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
    if query_len == 1:
        lens = torch.full((batch,), context, dtype=torch.int64, device=device)
        return AttentionMetadata(slots, batch, tables, lens, [])
    chunks = [PrefillChunk(i * query_len, query_len, context - query_len, tables[i])
              for i in range(batch)]
    return AttentionMetadata(slots, 0, None, None, chunks)


def _time(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    fn()  # compile / plan
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(TIMED_CALLS):
        fn()
    sync()
    return (time.perf_counter() - start) / TIMED_CALLS


def time_case(backend: str, batch: int, context: int, query_len: int, shape: tuple[int, ...],
              dtype: torch.dtype, block_size: int, device: torch.device) -> AttentionTiming:
    heads, kv_heads, head_dim = shape
    kernel = _kernel(backend)
    nblocks = batch * math.ceil(context / block_size)
    cache = torch.randn(2, nblocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    rows = batch * query_len
    q = torch.randn(rows, heads, head_dim, dtype=dtype, device=device)
    k, v = (torch.randn(rows, kv_heads, head_dim, dtype=dtype, device=device) for _ in "kv")
    # One metadata object for every call, as for the layers of one step: the per-step work
    # (the kernels' PagedBatch, a FlashInfer plan) is done by the untimed first call.
    meta = _meta(batch, context, query_len, block_size, device)
    seconds = _time(lambda: kernel(q, k, v, cache, meta, 1 / math.sqrt(head_dim)), device)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * cache.element_size()
    return AttentionTiming(backend, "decode" if query_len == 1 else "prefill", batch, context,
                           query_len, seconds * 1e6, kv_bytes / seconds / 1e9)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m conveyor.bench.attention", description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--backends", default="torch,triton,flashinfer")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--prefill", type=int, nargs=2, default=[512, 512], metavar=("PREFIX", "ROWS"),
                   help="a chunk of ROWS query rows on PREFIX cached keys (0 0: none)")
    p.add_argument("--shape", type=int, nargs=3, default=[32, 8, 128],
                   metavar=("HEADS", "KV_HEADS", "HEAD_DIM"), help="default: Llama-3-8B's")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cases = [(b, c, 1) for c in args.contexts for b in args.batches]
    if args.prefill[1]:
        cases.append((1, sum(args.prefill), args.prefill[1]))
    for backend in args.backends.split(","):
        try:
            _kernel(backend)
        except ImportError as exc:
            print(f"{backend}: not available ({exc})")
            continue
        for batch, context, query_len in cases:
            t = time_case(backend, batch, context, query_len, tuple(args.shape), dtype,
                          args.block_size, device)
            print(json.dumps(asdict(t)) if args.json else
                  f"{t.backend:10s} {t.kind:7s} batch {t.batch:4d} context {t.context:6d} "
                  f"rows {t.query_len:5d}: {t.us_per_call:9.1f} us  {t.kv_gb_per_s:8.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

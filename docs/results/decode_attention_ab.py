"""Decode attention alone, with an environment switch alternated call by call: B requests of
up to L positions (lengths drawn from L/2 ... L) in the tile-layout cache of 30 layers, each
layer's call in turn so that its K/V come from memory, as in a decode step. For a temporary
switch a kernel reads with `std::getenv` (CONVEYOR_EXP=mode); the outputs of every mode are
compared with mode 0's first (a prefetch or an order of work must not change a bit). Prints
each mode's median time a layer and the K/V bytes that imply (docs/benchmarks.md, seventh
session on Zen 4).

    PYTHONPATH=src python docs/results/decode_attention_ab.py 13 400 0,1 [threads]
"""

import os
import statistics
import sys
import time

import torch

from conveyor.ops import cpu_kernels
from conveyor.ops.reference import kv_cache_shape

batch, longest, modes = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
if len(sys.argv) > 4:
    torch.set_num_threads(int(sys.argv[4]))
assert cpu_kernels.load_cpu_kernels()
ops = torch.ops.conveyor
layers, heads, kv_heads, head_dim, bs = 30, 9, 3, 64, 16  # the default model's attention
per = (longest + bs) // bs
torch.manual_seed(0)
tables = torch.randperm(batch * per + 8)[: batch * per].view(batch, per).contiguous()
lens = torch.randint(longest // 2, longest + 1, (batch,))
dtype, shape = kv_cache_shape(batch * per + 8, bs, kv_heads, head_dim, "auto", torch.bfloat16,
                              tiles=True)
caches = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
slots = (tables[:, :, None] * bs + torch.arange(bs)).view(batch, -1)[:, :longest].reshape(-1)
for cache in caches:
    kv = torch.randn(2, batch * longest, kv_heads, head_dim).bfloat16()
    ops.write_kv_(kv[0], kv[1], cache, slots.contiguous())
queries = [torch.randn(batch, heads, head_dim).bfloat16() for _ in range(layers)]


def layer_time(mode: str) -> float:
    os.environ["CONVEYOR_EXP"] = mode
    start = time.perf_counter()
    for q, cache in zip(queries, caches, strict=True):
        ops.decode_attention(q, cache, tables, lens, 0.125)
    return (time.perf_counter() - start) / layers


os.environ["CONVEYOR_EXP"] = modes[0]
want = [ops.decode_attention(q, c, tables, lens, 0.125)
        for q, c in zip(queries, caches, strict=True)]
for mode in modes[1:]:
    os.environ["CONVEYOR_EXP"] = mode
    same = all(torch.equal(w, ops.decode_attention(q, c, tables, lens, 0.125))
               for w, q, c in zip(want, queries, caches, strict=True))
    print(f"mode {mode}: {'the same bits' if same else 'OTHER BITS'} as mode {modes[0]}")
times: dict[str, list[float]] = {mode: [] for mode in modes}
for _ in range(15):
    for mode in modes:
        times[mode].append(layer_time(mode))
kv_bytes = int(lens.sum()) * kv_heads * head_dim * 2 * 2
base = statistics.median(times[modes[0]])
for mode, t in times.items():
    m = statistics.median(t)
    print(f"B={batch} L<={longest} mode {mode}: {m * 1e6:.0f} us a layer, "
          f"{kv_bytes / m / 1e9:.1f} GB/s, {base / m:.2f}x mode {modes[0]}")

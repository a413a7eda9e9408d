"""How fast the reference workload could run at the rates the engine's kernels reach here: its
exact work (the matmuls' multiply-adds, the K/V bytes decode attention reads) over the best
rates measured in this process, with nothing else (no norms, no prefill attention, no
sampling, no scheduling). A bound from below on the workload's time, so from above on its
output tok/s, printed beside the workload itself run in the same process (docs/benchmarks.md,
issue 15).

    PYTHONPATH=src python docs/results/workload_bound.py
"""

import statistics
import time

import torch

from conveyor import LLM
from conveyor.bench.offline import Workload, bare_matmul_time

llm = LLM(max_model_len=2048, kv_cache_memory="1GiB", enable_prefix_caching=False)
engine = llm.engine
model, runner = engine.runner.model, engine.runner
cfg = engine.model_config
requests = Workload().prompts(llm)

# The work: prompt tokens go through the layers' matmuls (the LM head only for a prompt's last
# token), every later token through all of them; decode attention reads every earlier
# position's K/V in every layer.
layer_macs = sum(m.in_features * m.out_features for m in model._layer_linears())
head_macs = cfg.hidden_size * cfg.vocab_size
prompt_tokens = sum(len(p) for p, _ in requests)
decodes = sum(s.max_tokens - 1 for _, s in requests)
positions = sum(len(p) + j for p, s in requests for j in range(1, s.max_tokens))
prefill_macs = prompt_tokens * layer_macs + len(requests) * head_macs
decode_macs = decodes * (layer_macs + head_macs)
kv_bytes = positions * engine.kv_layout.bytes_per_token
outputs = sum(s.max_tokens for _, s in requests)


def layer_matmul_rate(rows: int) -> float:
    """Multiply-adds per second of the layers' matmuls (no LM head) at `rows` rows."""
    xs = [(m, torch.randn(rows, m.in_features, dtype=engine.dtype))
          for m in model._layer_linears()]
    for m, x in xs:
        m(x)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for m, x in xs:
            m(x)
        best = min(best, time.perf_counter() - start)
    return rows * layer_macs / best


def attention_rate(batch: int = 13, context: int = 400) -> float:
    """Bytes per second decode attention reads, every layer in turn over `batch` requests of
    `context` positions in the engine's own cache (blocks drawn at random, as after a while
    of serving): the K/V come from memory, as in a decode step."""
    bs = engine.kv_layout.block_size
    per = -(-context // bs)
    blocks = torch.randperm(engine.kv_layout.num_blocks)[: batch * per].view(batch, per)
    lens = torch.full((batch,), context, dtype=torch.long)
    qs = [torch.randn(batch, cfg.num_attention_heads, cfg.head_dim, dtype=engine.dtype)
          for _ in range(cfg.num_hidden_layers)]
    scale = cfg.head_dim ** -0.5
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for layer, q in enumerate(qs):
            model.backend.decode_attention(q, runner.kv_caches[layer], blocks, lens, scale)
        times.append(time.perf_counter() - start)
    return batch * context * engine.kv_layout.bytes_per_token / statistics.median(times)


def workload_time() -> float:
    """Seconds of the workload through `LLM.generate` (the second of two runs)."""
    for _ in range(2):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests])
        seconds = time.perf_counter() - start
    return seconds


measured = workload_time()
prefill_rate = layer_matmul_rate(2048)
decode_step = {b: bare_matmul_time(llm, b) for b in (13, 64)}
decode_rate = {b: b * (layer_macs + head_macs) / t for b, t in decode_step.items()}
kv_rate = attention_rate()
parts = {
    "prefill matmuls": prefill_macs / prefill_rate,
    "decode matmuls (all at the 64-row rate)": decode_macs / decode_rate[64],
    "decode attention": kv_bytes / kv_rate,
}
print(f"work: {prompt_tokens} prompt tokens, {outputs} output tokens; "
      f"{prefill_macs / 1e12:.3f} T prefill and {decode_macs / 1e12:.3f} T decode "
      f"multiply-adds; decode attention reads {kv_bytes / 1e9:.1f} GB")
print(f"rates: layer matmuls at 2048 rows {prefill_rate / 1e9:.0f} G multiply-adds/s; all "
      f"matmuls at 13 rows {decode_rate[13] / 1e9:.0f}, at 64 rows {decode_rate[64] / 1e9:.0f}; "
      f"decode attention {kv_rate / 1e9:.1f} GB/s")
for name, seconds in parts.items():
    print(f"  {name:42s} {seconds:6.2f} s")
total = sum(parts.values())
print(f"  {'sum':42s} {total:6.2f} s  ->  at most {outputs / total:.0f} output tok/s")
print(f"the workload itself, just before: {measured:.2f} s = {outputs / measured:.0f} output tok/s "
      f"({total / measured:.0%} of its time is the bound's)")

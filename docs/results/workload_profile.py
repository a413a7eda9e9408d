"""Where the reference workload's time goes, op by op: the workload once untimed (another
seed), then once under torch's profiler, each op's own time against the run's wall time; what
the ops leave of the wall time is Python (scheduling, sampling, outputs). `decode_layers` is
every layer of a decode-only step in one C++ call (matmuls and attention inside);
`linear` is the prefill's matmuls and the LM head (docs/benchmarks.md, issue 15).

    PYTHONPATH=src python docs/results/workload_profile.py
"""

import time
from dataclasses import replace

from torch.profiler import ProfilerActivity, profile

from conveyor import LLM
from conveyor.bench.offline import Workload

llm = LLM(kv_cache_memory="1GiB", max_model_len=2048, enable_prefix_caching=False)


def run(workload: Workload) -> tuple[int, float]:
    requests = workload.prompts(llm)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests],
                           [s for _, s in requests])
    return sum(len(o.outputs[0].token_ids) for o in outputs), time.perf_counter() - start


run(replace(Workload(), seed=7))
with profile(activities=[ProfilerActivity.CPU]) as prof:
    tokens, wall = run(Workload())
events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
print(f"{tokens / wall:.1f} output tok/s under the profiler, {wall:.2f} s")
for e in events[:12]:
    seconds = e.self_cpu_time_total / 1e6
    print(f"{e.key[:40]:40s} {e.count:6d} calls {seconds:6.2f} s {100 * seconds / wall:5.1f} %")
ops = sum(e.self_cpu_time_total for e in events) / 1e6
print(f"{'outside the ops (Python)':40s} {'':12s} {wall - ops:6.2f} s "
      f"{100 * (wall - ops) / wall:5.1f} %")

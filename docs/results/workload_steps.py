"""The reference workload's time by kind of step: steps with prefill chunks, and decode-only
steps by batch size (the engine's step trace), over RUNS runs in one process.

    PYTHONPATH=src python docs/results/workload_steps.py [RUNS]

Prefix caching is off, so that every run computes its prompts (the bench's rounds use other
seeds instead).
"""

import collections
import sys
import time

from conveyor import LLM
from conveyor.bench.offline import Workload, warm_up_on

BUCKETS = ((1, "decode, 1-7 requests"), (8, "decode, 8-15"), (16, "decode, 16-31"),
           (32, "decode, 32-64"))


def kind(step) -> str:
    if any(e.kind != "decode" for e in step.scheduled):
        return "with prefill chunks"
    return [name for least, name in BUCKETS if len(step.scheduled) >= least][-1]


llm = LLM(enable_prefix_caching=False, step_trace=True)
workload = Workload()
warm_up_on(llm, workload)
requests = workload.prompts(llm)
prompts = [{"prompt_token_ids": p} for p, _ in requests]
params = [s for _, s in requests]
trace = llm.engine.step_trace
assert trace is not None
for run in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    trace.clear()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    duration = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"run {run + 1}: {tokens / duration:.1f} output tok/s, {duration:.2f} s")
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])
    for step in trace:
        entry = kinds[kind(step)]
        entry[0] += 1
        entry[1] += step.duration
        entry[2] += len(step.scheduled)
    for name, (steps, seconds, rows) in sorted(kinds.items()):
        print(f"  {name}: {steps} steps, {seconds:.2f} s ({seconds / duration:.0%}), "
              f"{seconds / steps * 1e3:.1f} ms a step, {rows / steps:.1f} requests a step")
llm.engine.check_integrity()

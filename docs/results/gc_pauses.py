"""The cyclic garbage collector's passes during decode steps that stream their outputs (64
requests, DELTA outputs, as the server's engine loop takes them), per generation: how many,
how long. With `freeze`, the start-up heap is frozen first (gc.freeze, as `conveyor serve`
does before it serves): the full passes then skip it (docs/benchmarks.md, seventh session).

    PYTHONPATH=src python docs/results/gc_pauses.py [freeze] [SECONDS]
"""

import gc
import random
import sys
import time
from collections import defaultdict

from conveyor import LLM
from conveyor.sampling_params import RequestOutputKind, SamplingParams

freeze = "freeze" in sys.argv[1:]
seconds = float(next((a for a in sys.argv[1:] if a != "freeze"), 20))
llm = LLM(kv_cache_memory="2GiB", max_model_len=2048, enable_prefix_caching=False)
if freeze:
    gc.collect()
    gc.freeze()
engine = llm.engine
passes: dict[int, list[float]] = defaultdict(list)
started = [0.0]


def on_pass(phase: str, info: dict) -> None:
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        passes[info["generation"]].append(time.perf_counter() - started[0])


rng = random.Random(1)
params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)
for _ in range(64):
    engine.add_request({"prompt_token_ids": [rng.randrange(1000, 49000) for _ in range(100)]},
                       params)
for _ in range(10):
    engine.step()
gc.callbacks.append(on_pass)
start, steps, outputs = time.perf_counter(), 0, []
while time.perf_counter() - start < seconds:
    outputs.extend(engine.step())
    steps += 1
wall = time.perf_counter() - start
print(f"{'frozen' if freeze else 'not frozen'}: {steps} steps in {wall:.1f} s; "
      f"{len(gc.get_objects())} objects tracked, {gc.get_freeze_count()} frozen")
for generation, times in sorted(passes.items()):
    print(f"generation {generation}: {len(times)} passes, longest {max(times) * 1e3:.1f} ms, "
          f"{sum(times) * 1e3:.0f} ms in all ({100 * sum(times) / wall:.1f} % of the time)")

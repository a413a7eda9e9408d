"""The reference workload on three engines in one process, interleaved (this machine's speed
drifts by tens of percent within minutes, more than the differences measured): GGUF blocks
with int8 inputs (the default on CPUs with AVX512-VNNI and no AMX), the same blocks with
bf16 inputs (`int8_activations=False`), and the bf16 weights (`quantized_matmuls=False`).
Prints each engine's output tok/s per run and the ratios of their sums.

    python docs/results/int8_inputs_ab.py [--reps 3]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from conveyor import LLM
from conveyor.bench.offline import Workload

# No prefix caching: every run repeats the same prompts, and their prefill must count.
COMMON: dict[str, Any] = {"kv_cache_memory": "1GiB", "max_model_len": 2048,
                          "enable_prefix_caching": False}
ENGINES: dict[str, dict[str, Any]] = {
    "int8 inputs": {},
    "bf16 inputs": {"int8_activations": False},
    "bf16 weights": {"quantized_matmuls": False},
}


def run(llm: LLM, work: list) -> float:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], [s for _, s in work])
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    engines = {name: LLM(**COMMON, **extra) for name, extra in ENGINES.items()}
    work = Workload().prompts(next(iter(engines.values())))
    for llm in engines.values():  # warm-up: first touch of the KV cache, caches
        run(llm, work)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.reps):
        for name, llm in engines.items():
            rates[name].append(run(llm, work))
    for name, got in rates.items():
        print(f"{name}: {' '.join(f'{r:.1f}' for r in got)} output tok/s", flush=True)
    first = sum(rates["int8 inputs"])
    for name in list(engines)[1:]:
        print(f"int8 inputs / {name}: {first / sum(rates[name]):.3f}", flush=True)


if __name__ == "__main__":
    main()

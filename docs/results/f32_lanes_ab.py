"""The float32 matmuls on 8-lane (AVX2) against 16-lane (AVX-512) registers, in one process,
interleaved: the same engine and workload, only `cpu_kernels.f32_vector_lanes` switched.
Prints each workload's tok/s per run, the 16/8 ratio of their sums, and whether every
request's tokens were the same (they must be: the two widths give the same bits).

    python docs/results/f32_lanes_ab.py [--reps 3] [reference grounded-b1 grounded-b1-spec]

Needs a CPU with AVX-512 (else only 8 lanes exist).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from conveyor import LLM
from conveyor.bench.grounded import GroundedWorkload
from conveyor.bench.offline import Workload
from conveyor.ops import cpu_kernels

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
# No prefix caching: every run repeats the same prompts, and their prefill must count.
SMALL = {"dtype": "float32", "kv_cache_memory": "64MiB", "max_model_len": 1024,
         "max_num_seqs": 1, "enable_prefix_caching": False}
CASES: dict[str, tuple[dict[str, Any], Callable[[LLM], list]]] = {
    "reference": ({"dtype": "float32", "kv_cache_memory": "1GiB",
                   "enable_prefix_caching": False},
                  lambda llm: Workload().prompts(llm)),
    "grounded-b1": (SMALL, lambda llm: GroundedWorkload(num_requests=8).prompts(llm)),
    "grounded-b1-spec": ({**SMALL, "speculative_config": NGRAM},
                         lambda llm: GroundedWorkload(num_requests=8).prompts(llm)),
}


def run(llm: LLM, work: list, lanes: int) -> tuple[float, list[list[int]]]:
    cpu_kernels.f32_vector_lanes(lanes)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], [s for _, s in work])
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*", default=list(CASES))
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    for name in args.cases:
        engine_args, make = CASES[name]
        llm = LLM(**engine_args)
        work = make(llm)
        widest = cpu_kernels.f32_vector_lanes()
        for lanes in (8, widest):  # warm-up: first touch of the KV cache, caches
            run(llm, work, lanes)
        rates: dict[int, list[float]] = {8: [], widest: []}
        same = True
        for _ in range(args.reps):
            tokens = {}
            for lanes in (8, widest):
                rate, tokens[lanes] = run(llm, work, lanes)
                rates[lanes].append(rate)
            same &= tokens[8] == tokens[widest]
        print(f"{name}: 8 lanes {' '.join(f'{r:.1f}' for r in rates[8])} tok/s; "
              f"{widest} lanes {' '.join(f'{r:.1f}' for r in rates[widest])} tok/s; "
              f"ratio {sum(rates[widest]) / sum(rates[8]):.3f}; same tokens: {same}", flush=True)


if __name__ == "__main__":
    main()

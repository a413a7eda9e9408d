"""Where a decode step's host time goes: ``cProfile`` over engine steps of ``--batch``
requests decoding at once (a built-in shape, dummy weights), the functions sorted by their own
time. On a GPU the forward pass is a graph replay and sampling a device op, so what is left
is the Python that schedules, prepares inputs and takes outputs: the part async scheduling
hides when the GPU's share of a step is longer, and the floor of a step when it is not.

    PYTHONPATH=src python scripts/host_profile.py --model smollm2-135m --device cuda --batch 64
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from conveyor import LLM, SamplingParams
from conveyor.sampling_params import RequestOutputKind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a built-in shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lines", type=int, default=30)
    args = parser.parse_args()
    llm = LLM(model=args.model, load_format="dummy", device=args.device, dtype=args.dtype,
              max_model_len=2048, kv_cache_memory=2 << 30, max_num_seqs=max(args.batch, 8))
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps * 2 + 50, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    ids = [engine.add_request({"prompt_token_ids": [rng.randrange(100, 20000)
                                                    for _ in range(128)]}, params)
           for _ in range(args.batch)]
    for _ in range(20):  # prefill, graphs warm
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    plain = (time.perf_counter() - start) / args.steps
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    engine.abort_request(ids)
    print(f"{args.model} batch {args.batch} on {args.device}: {plain * 1e3:.3f} ms a step "
          "(without the profiler)")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.lines)


if __name__ == "__main__":
    main()

"""Same-process, interleaved on/off timing (cut-down issue-11 benchmark for a loaded machine).

    PYTHONPATH=src python docs/results/spec_decode_interleaved.py
"""

import time

from conveyor import LLM, SamplingParams
from conveyor.bench.grounded import GroundedWorkload
from conveyor.bench.offline import Workload

spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}
common = dict(max_model_len=1024, kv_cache_memory="64MiB")


def timed(llm: LLM, requests: list) -> tuple[float, int]:
    """Seconds and output tokens of one generate call over `requests`."""
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests])
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def rate(total: list[float]) -> float:
    return total[1] / total[0]


on1, off1 = LLM(max_num_seqs=1, speculative_config=spec, **common), LLM(max_num_seqs=1, **common)
totals = {"on": [0.0, 0], "off": [0.0, 0]}
for i, request in enumerate(GroundedWorkload(num_requests=2, seed=0).prompts(on1)):
    order = (("on", on1), ("off", off1)) if i % 2 == 0 else (("off", off1), ("on", on1))
    for name, llm in order:
        dt, n = timed(llm, [request])
        totals[name][0] += dt
        totals[name][1] += n
        print(name, "grounded batch1 req", i, f"{dt:.1f}s {n} tokens", flush=True)
s = on1.stats()
print(f"GROUNDED batch 1: on {rate(totals['on']):.2f} tok/s, off {rate(totals['off']):.2f} "
      f"tok/s, ratio {rate(totals['on']) / rate(totals['off']):.2f}, mean accepted length "
      f"{s.spec_decode_mean_accepted_length:.2f}, acceptance {s.spec_decode_acceptance_rate:.2f}",
      flush=True)

greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
reference = [(p, greedy) for p, _ in Workload(num_requests=8, seed=0).prompts(on1)]
onb, offb = LLM(speculative_config=spec, **common), LLM(**common)
totals = {"on": [0.0, 0], "off": [0.0, 0]}
for name, llm in (("on", onb), ("off", offb), ("off", offb), ("on", onb)):
    dt, n = timed(llm, reference)
    totals[name][0] += dt
    totals[name][1] += n
    print(name, f"reference 8 requests {dt:.1f}s {n} tokens", flush=True)
s = onb.stats()
print(f"REFERENCE (8 random prompts, 24 tokens, all at once): ratio "
      f"{rate(totals['on']) / rate(totals['off']):.2f}, drafts {s.spec_decode_num_drafts}, "
      f"accepted {s.spec_decode_num_accepted_tokens}, steps off {s.spec_decode_num_steps_off}",
      flush=True)

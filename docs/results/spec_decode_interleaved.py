"""Same-process, interleaved on/off timing (cut-down issue-11 benchmark for a loaded machine)."""
import time

from conveyor import LLM, SamplingParams
from conveyor.bench.grounded import GroundedWorkload
from conveyor.bench.offline import Workload

spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
common = dict(max_model_len=1024, kv_cache_memory="64MiB")
on1 = LLM(max_num_seqs=1, speculative_config=spec, **common); off1 = LLM(max_num_seqs=1, **common)
g = GroundedWorkload(num_requests=2, seed=0).prompts(on1)
def timed(llm, reqs):
    t = time.perf_counter(); outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [s for _, s in reqs])
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs), [o.outputs[0].token_ids for o in outs]
tot = {"on": [0, 0], "off": [0, 0]}
for i, r in enumerate(g):
    for name, llm in (("on", on1), ("off", off1)) if i % 2 == 0 else (("off", off1), ("on", on1)):
        dt, n, ids = timed(llm, [r]); tot[name][0] += dt; tot[name][1] += n
        print(name, "grounded batch1 req", i, f"{dt:.1f}s {n} tokens", flush=True)
s = on1.stats()
print(f"GROUNDED batch 1: on {tot['on'][1]/tot['on'][0]:.2f} tok/s, off {tot['off'][1]/tot['off'][0]:.2f} tok/s, ratio {tot['on'][1]/tot['on'][0]/(tot['off'][1]/tot['off'][0]):.2f}, mean accepted length {s.spec_decode_mean_accepted_length:.2f}, acceptance {s.spec_decode_acceptance_rate:.2f}", flush=True)
ref = [(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) for p, _ in Workload(num_requests=8, seed=0).prompts(on1)]
tot = {}
onb = LLM(speculative_config=spec, **common); offb = LLM(**common)
b0 = onb.stats()
for name, llm in (("on", onb), ("off", offb), ("off", offb), ("on", onb)):
    dt, n, _ = timed(llm, ref); tot.setdefault(name, [0, 0]); tot[name][0] += dt; tot[name][1] += n
    print(name, f"reference 8 requests {dt:.1f}s {n} tokens", flush=True)
s = onb.stats()
print(f"REFERENCE (8 random prompts, 24 tokens, all at once): ratio {tot['on'][1]/tot['on'][0]/(tot['off'][1]/tot['off'][0]):.2f}, drafts {s.spec_decode_num_drafts}, accepted {s.spec_decode_num_accepted_tokens}, steps off {s.spec_decode_num_steps_off}", flush=True)

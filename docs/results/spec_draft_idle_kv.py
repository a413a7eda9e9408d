"""What an idle draft model costs: the same grounded requests on three engines in one
process, after a warm-up each, two rounds: no speculation with the KV budget (64 MiB), no
speculation with the block count the draft leaves (65 blocks), and the draft loaded at
64 MiB. Prints output tokens/s, prefix-cache hits and drafts per run.

    PYTHONPATH=src python docs/results/spec_draft_idle_kv.py DRAFT_FOLDER
(DRAFT_FOLDER from docs/results/make_layer_draft.py, 12 layers)
"""

import sys
import time

from conveyor import LLM
from conveyor.bench.grounded import GroundedWorkload

w = GroundedWorkload(num_requests=8)
base = dict(dtype="float32", max_model_len=1024, max_num_seqs=1)
engines = {
    "off, 64 MiB": LLM(kv_cache_memory="64MiB", **base),
    "off, 65 blocks": LLM(kv_cache_memory=65 * 16 * 46080, **base),
    "draft, 64 MiB": LLM(kv_cache_memory="64MiB", speculative_config={
        "method": "draft_model", "model": sys.argv[1], "num_speculative_tokens": 4}, **base),
}
reqs = w.prompts(engines["off, 64 MiB"])


def once(llm: LLM) -> tuple[float, int, int]:
    b, t = llm.stats(), time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [s for _, s in reqs])
    dt, a = time.perf_counter() - t, llm.stats()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return (n / dt, a.prefix_cache_hits - b.prefix_cache_hits,
            a.spec_decode_num_drafts - b.spec_decode_num_drafts)


for llm in engines.values():
    once(llm)
for r in range(2):
    for name, llm in engines.items():
        tps, hits, drafts = once(llm)
        print(f"round {r}  {name:15} {tps:6.1f} tok/s  {hits:4} prefix hits  {drafts} drafts")

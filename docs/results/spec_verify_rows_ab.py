"""Batch 1, one process, interleaved (issue 11): the prefill and the decode phase of 8
grounded requests without speculation, with n-gram speculation whose verifies are decode
rows (the engine's layout), and with verifies laid out as chunks (the earlier layout, the
runner's ``verify_as_decodes`` off). Prefix caching off, so every prompt pays its prefill.

    PYTHONPATH=src python docs/results/spec_verify_rows_ab.py
"""

import time

from conveyor import LLM
from conveyor.bench.grounded import GroundedWorkload

base = dict(dtype="float32", max_model_len=1024, max_num_seqs=1, kv_cache_memory="64MiB",
            enable_prefix_caching=False)
spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}
off, on = LLM(**base), LLM(speculative_config=spec, **base)
requests = GroundedWorkload(num_requests=8, seed=1).prompts(off)


def phases(llm: LLM, verify_as_decodes: bool = True) -> tuple[float, float]:
    """Seconds in the requests' first steps (prefill) and in the rest (decoding)."""
    engine = llm.engine
    engine.runner.verify_as_decodes = verify_as_decodes
    prefill = decode = 0.0
    for ids, params in requests:
        engine.add_request({"prompt_token_ids": ids}, params)
        start = time.perf_counter()
        engine.step()
        first = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        prefill, decode = prefill + first - start, decode + time.perf_counter() - first
    return prefill, decode


for llm in (off, on):
    phases(llm)  # warm-up
for r in range(3):
    for name, llm, flag in (("off", off, True), ("on, verify rows as decodes", on, True),
                            ("on, verify as a chunk", on, False)):
        p, d = phases(llm, flag)
        print(f"round {r}  {name:27} prefill {p:6.2f} s  decode {d:6.2f} s", flush=True)

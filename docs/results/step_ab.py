"""Decode steps with an environment switch off and on, alternated step by step in one engine:
the comparison that held steady on a machine whose speed drifts 15-50 % within minutes
(docs/benchmarks.md, sixth session on Zen 4). For a temporary switch a change reads with
`std::getenv` (C++) or `os.environ` (Python) on every call; the script sets and clears it.

    PYTHONPATH=src python docs/results/step_ab.py CONVEYOR_EXP 1x300,13x400,64x250 [STEPS]

Each configuration BxL decodes B requests of L-token prompts; the steps go off, off, on, on,
... (pairs, so that neither side always follows the other) and the medians are compared.
"""

import os
import random
import statistics
import sys
import time

from conveyor import LLM
from conveyor.sampling_params import RequestOutputKind, SamplingParams

switch, configs = sys.argv[1], sys.argv[2].split(",")
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 120
llm = LLM(kv_cache_memory="2GiB", max_model_len=2048, enable_prefix_caching=False)
engine = llm.engine
vocab = engine.model_config.vocab_size


def set_switch(on: bool) -> None:
    if on:
        os.environ[switch] = "1"
    else:
        os.environ.pop(switch, None)


for config in configs:
    batch, prompt_len = map(int, config.split("x"))
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    ids = [engine.add_request({"prompt_token_ids": [rng.randrange(1000, vocab)
                                                    for _ in range(prompt_len)]}, params)
           for _ in range(batch)]
    while engine.scheduler.num_waiting or any(r.num_output_tokens < 2
                                              for r in engine.scheduler.running):
        engine.step()
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(steps):
        on = (i // 2) % 2 == 1
        set_switch(on)
        start = time.perf_counter()
        engine.step()
        times[on].append(time.perf_counter() - start)
    set_switch(False)
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{batch} requests x {prompt_len} tokens: off {off * 1e3:.2f} ms, on {on * 1e3:.2f} "
          f"ms a step: {off / on:.3f}x", flush=True)
engine.check_integrity()

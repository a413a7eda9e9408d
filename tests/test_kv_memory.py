"""The KV cache and the swap space hold their memory from the start, then stay flat.

In a fresh process (nothing else grows its memory): resident memory right after the engine
starts already includes every byte of the KV cache and the swap space, and a workload that
cycles through all the blocks adds little to it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import json, os, random, sys
from conveyor import LLM, SamplingParams

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = rss()
llm = LLM(model=sys.argv[1], dtype="float32", kv_cache_memory="64MiB", max_model_len=1024,
          preemption="swap", swap_space=0.0625)
started = rss()
layout = llm.engine.kv_layout
rng = random.Random(0)
vocab = llm.engine.model_config.vocab_size
# Requests of 1,000 random tokens: their freed blocks stay in the prefix cache, so the free
# list hands out every block before any is used twice.
num = layout.num_blocks * layout.block_size // 1000 + 48
prompts = [{"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(1000)]}
           for _ in range(num)]
llm.generate(prompts, SamplingParams(max_tokens=1))
print(json.dumps({"before": before, "started": started, "after": rss(),
                  "kv": layout.num_bytes, "swap": layout.num_swap_bytes,
                  "steps": llm.stats().num_steps}))
"""


def test_kv_cache_is_resident_from_the_start(tiny_llama_dir: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tiny_llama_dir)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    m = json.loads(done.stdout.strip().splitlines()[-1])
    assert m["kv"] >= 60 << 20 and m["swap"] >= 60 << 20, m
    assert m["started"] - m["before"] >= m["kv"] + m["swap"], m
    # Cycling through every block adds far less than the cache (were its pages untouched
    # at start, the workload would add all of them); what it adds are activations.
    assert m["after"] - m["started"] < 0.5 * m["kv"], m

"""Greedy outputs of the default model at tensor_parallel_size=2 against 1, in float32.

    TORCH_EXTENSIONS_DIR=... PYTHONPATH=src python docs/results/tp_greedy_parity.py [--max-tokens 48]

For every prompt: whether the greedy tokens are equal; where they first differ, the top-2
logprobs of both runs at that step (a near-tie: the all-reduce adds the row-parallel halves
in another order than one matmul does, which moves float32 logits by ulps). Prints one JSON
object (docs/results/tp-greedy-parity.json holds a run's).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from conveyor import LLM, SamplingParams

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain what a KV cache is in two sentences."}],
    [{"role": "user", "content": "List three prime numbers and say why they are prime."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "How do I reverse a list in Python?"}],
]


def _top2(step: dict[int, Any]) -> list[tuple[int, float]]:
    return sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda x: -x[1])[:2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=48)
    opts = parser.parse_args()
    params = SamplingParams(max_tokens=opts.max_tokens, temperature=0.0, logprobs=2,
                            ignore_eos=True)
    runs = []
    for tp in (1, 2):
        llm = LLM(dtype="float32", max_model_len=1024, tensor_parallel_size=tp)
        runs.append(llm.chat(PROMPTS, params))
        llm.shutdown()
        del llm
    report = []
    for i, (one, two) in enumerate(zip(*runs, strict=True)):
        a, b = one.outputs[0], two.outputs[0]
        diff = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True))
                     if x != y), None)
        entry: dict[str, Any] = {"prompt": i, "equal": diff is None, "tokens": len(a.token_ids)}
        if diff is not None and a.logprobs and b.logprobs:
            entry.update(first_difference=diff, tp1_top2=_top2(a.logprobs[diff]),
                         tp2_top2=_top2(b.logprobs[diff]))
        # the largest logprob gap of the chosen token while the runs agree
        agree = len(a.token_ids) if diff is None else diff
        entry["max_logprob_delta_while_equal"] = max(
            (abs(a.logprobs[j][t].logprob - b.logprobs[j][t].logprob)
             for j, t in enumerate(a.token_ids[:agree])), default=0.0) if a.logprobs and \
            b.logprobs else None
        report.append(entry)
    print(json.dumps({"max_tokens": opts.max_tokens, "prompts": report}, indent=1))


if __name__ == "__main__":
    main()

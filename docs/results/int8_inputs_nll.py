"""What int8 inputs (`int8_activations`) cost in quality: the default model's mean negative
log-likelihood (and perplexity) of real text, this repository's docs and README, with int8
inputs, with bf16 inputs (`int8_activations=False`) and in float32. Prints one line each.

    python docs/results/int8_inputs_nll.py

int8 inputs exist on CPUs with AVX512-VNNI and no AMX; elsewhere the first two lines are the
same engine.
"""

from __future__ import annotations

import math
from pathlib import Path

from conveyor import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [(ROOT / "docs" / name).read_text()[:6000]
         for name in ("benchmarks.md", "deploy.md", "design-notes.md")] + [
    (ROOT / "README.md").read_text()[:6000]]
CONFIGS = {"int8 inputs": {"int8_activations": True},
           "bf16 inputs": {"int8_activations": False},
           "float32": {"dtype": "float32"}}


def main() -> None:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    for name, args in CONFIGS.items():
        llm = LLM(max_model_len=4096, **args)
        total, count = 0.0, 0
        for out in llm.generate(TEXTS, params):
            assert out.prompt_logprobs is not None
            for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:],
                                    strict=True):
                assert entry is not None
                total -= entry[token].logprob
                count += 1
        print(f"{name}: {count} tokens, mean NLL {total / count:.4f}, "
              f"perplexity {math.exp(total / count):.3f}", flush=True)
        del llm


if __name__ == "__main__":
    main()

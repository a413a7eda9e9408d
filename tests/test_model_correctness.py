"""conveyor against Hugging Face transformers on the same weights: greedy ids must be identical.

Both sides run float32. The tiny random models (Llama MHA, Llama GQA, Llama with tied
embeddings, Qwen2 with q/k/v bias, Qwen3 with q/k norm) are saved as safetensors by
transformers and loaded by conveyor's HF loader; the default SmolLM2 GGUF is dequantized by
transformers' own GGUF loader on the reference side.
"""

from __future__ import annotations

import random

import pytest

from conftest_models import TINY_VARIANTS, assert_greedy_matches_reference
from conveyor import LLM, SamplingParams

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

def _random_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """A handful of token-id prompts: 1 token, short, one spanning several KV blocks."""
    rng = random.Random(seed)
    lengths = [1, 7, 40]
    return [[rng.randrange(2, vocab_size) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("name,arch,overrides", TINY_VARIANTS, ids=[v[0] for v in TINY_VARIANTS])
def test_tiny_model_greedy_matches_transformers(name, arch, overrides, tiny_model_factory,
                                                hf_tiny_model, greedy_reference,
                                                kv_free) -> None:
    folder = tiny_model_factory(f"ref-{name}", arch, seed=len(name), **overrides)
    reference = hf_tiny_model(folder)
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=1 << 20,
              max_model_len=1024, block_size=8)
    prompts = _random_prompts(reference.config.vocab_size)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert_greedy_matches_reference(outputs, prompts, reference, greedy_reference, MAX_TOKENS,
                                    name)
    kv_free(llm)


def test_tiny_models_are_distinct(tiny_model_factory, hf_tiny_model, greedy_reference) -> None:
    """The comparison above could pass vacuously if every variant collapsed to one output."""
    prompt = [5, 6, 7, 8, 9]
    seen = set()
    for name, arch, overrides in TINY_VARIANTS:
        model = hf_tiny_model(tiny_model_factory(f"ref-{name}", arch, seed=len(name),
                                                 **overrides))
        tokens, logits = greedy_reference(model, prompt, 8)
        seen.add(tuple(tokens))
        # Well-separated logits: the top two of each step differ by far more than float noise.
        for row in logits:
            top2 = row.topk(2).values
            assert float(top2[0] - top2[1]) > 1e-3
    assert len(seen) >= 4


DEFAULT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
]


def test_default_gguf_greedy_matches_transformers(default_llm, hf_default_model,
                                                  greedy_reference, kv_free) -> None:
    max_tokens = 10
    outputs = default_llm.generate(
        DEFAULT_PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    for text, output in zip(DEFAULT_PROMPTS, outputs, strict=True):
        expected, _ = greedy_reference(hf_default_model, output.prompt_token_ids, max_tokens)
        assert output.outputs[0].token_ids == expected, text
    kv_free(default_llm)


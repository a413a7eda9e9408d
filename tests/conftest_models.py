"""Shared, cached reference objects for the loader, tokenizer and model tests (real files, no
mocks).

transformers is the reference. Loading its GGUF tokenizer or dequantizing the default model
takes seconds, so each is done once per test session.
"""

from __future__ import annotations

import os
import tempfile
from functools import lru_cache

import pytest
import torch

from conveyor.model.loader import default_model_path


def default_gguf() -> str:
    """The default SmolLM2 GGUF, or skip the test when the package is not installed."""
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@lru_cache(maxsize=1)
def hf_gguf_tokenizer():  # transformers tokenizer built from the same GGUF
    from transformers import AutoTokenizer

    path = default_gguf()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@lru_cache(maxsize=1)
def hf_gguf_config():
    from transformers import AutoConfig

    path = default_gguf()
    return AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@lru_cache(maxsize=1)
def hf_gguf_state_dict() -> dict[str, torch.Tensor]:
    """transformers' own GGUF loader output (dequantized, q/k un-permuted) for the default model.

    Called directly rather than through from_pretrained, which wants `accelerate` for GGUF.
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_gguf_config())
    out = load_gguf_checkpoint(default_gguf(), return_tensors=True, model_to_load=model)
    return out["tensors"]


@lru_cache(maxsize=1)
def hf_tokenizer_folder() -> str:
    """A folder with tokenizer.json/tokenizer_config.json saved by transformers."""
    folder = tempfile.mkdtemp(prefix="conveyor-tok-")
    hf_gguf_tokenizer().save_pretrained(folder)
    return folder


# Tiny random models checked against transformers: (name, architecture, config overrides).
TINY_VARIANTS = [
    ("llama", "llama", {}),
    ("llama-gqa", "llama", {"num_attention_heads": 8, "num_key_value_heads": 2,
                            "head_dim": 8}),
    ("llama-tied", "llama", {"tie_word_embeddings": True}),
    ("qwen2", "qwen2", {}),
    ("qwen3", "qwen3", {"num_key_value_heads": 2}),
]


def assert_greedy_matches_reference(outputs, prompts, reference, greedy_reference,
                                    max_tokens: int, name: str) -> None:
    """Each output (greedy, ``ignore_eos``) equals transformers' greedy ids for its prompt."""
    for prompt, output in zip(prompts, outputs, strict=True):
        expected, _ = greedy_reference(reference, prompt, max_tokens)
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == expected, f"{name}: prompt of {len(prompt)}"
        assert output.outputs[0].finish_reason == "length"

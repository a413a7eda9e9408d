"""int8 inputs for the GGUF block matmuls (``int8_activations``, csrc/vnni_blocks.cpp) on CPUs
with AVX512-VNNI and no AMX: the default model takes them where the CPU runs them, and the
inputs' rounding costs little: the model scores real text nearly as well as with bf16 inputs
or in float32. (That a row's result does not depend on its batch is tested by
test_dot_kernels.py and, engine-level in the default configuration, test_batch_invariance.py.)
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from block_helpers import random_q4k_blocks
from conftest_models import default_gguf
from conveyor import LLM, SamplingParams, ops
from conveyor.model.layers import Q4_K, PackedLinear

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _matmuls(llm: LLM) -> list[PackedLinear]:
    model = llm.engine.runner.model
    linears = [*model._layer_linears(), model.lm_head]
    return [m for m in linears if isinstance(m, PackedLinear)]


def _mean_nll(llm: LLM, texts: list[str]) -> float:
    """Mean negative log-likelihood of each text's tokens after its first."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    total, count = 0.0, 0
    for out in llm.generate(texts, params):
        assert out.prompt_logprobs is not None
        for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
            assert entry is not None
            total -= entry[token].logprob
            count += 1
    return total / count


@pytest.fixture(scope="module")
def texts() -> list[str]:
    default_gguf()  # skips the test when the model package is not installed
    if not ops.vnni_blocks_available():
        pytest.skip("int8 inputs need AVX512-VNNI and no AMX (bf16 block matmuls)")
    # Real English prose about this project, ~1,500 tokens.
    return [(DOCS / name).read_text()[:3000] for name in ("design-notes.md", "benchmarks.md")]


def test_the_default_model_takes_int8_inputs_and_scores_text_nearly_as_well(texts) -> None:
    int8 = LLM(max_model_len=2048, kv_cache_memory="64MiB")
    assert all(m.blocks is not None and m.int8_inputs for m in _matmuls(int8))
    with_int8 = _mean_nll(int8, texts)
    del int8
    bf16 = LLM(max_model_len=2048, kv_cache_memory="64MiB", int8_activations=False)
    assert all(m.blocks is not None and not m.int8_inputs for m in _matmuls(bf16))
    with_bf16 = _mean_nll(bf16, texts)
    del bf16
    exact = _mean_nll(LLM(max_model_len=2048, kv_cache_memory="64MiB", dtype="float32"), texts)
    # Perplexity within 2 % of bf16 inputs' and float32's (measured: +0.6 %); a wrong layout
    # or scale would cost far more (the model scores ~3.4 nats a token).
    assert abs(with_bf16 - exact) < 0.02
    assert with_int8 != with_bf16 and abs(with_int8 - with_bf16) < math.log(1.02)


def test_a_q4_k_matmul_reads_its_blocks_with_int8_inputs_only() -> None:
    """Q4_K (Q4_K_M files' main type) is read in place with int8 inputs; without them (or
    where they do not run) the matmul keeps its bf16 weight."""
    if not ops.vnni_blocks_available():
        pytest.skip("int8 inputs need AVX512-VNNI and no AMX (bf16 block matmuls)")
    raw = random_q4k_blocks(64, 512, seed=0)
    weight = torch.from_numpy(dequantize(raw.reshape(64, -1), GGMLQuantizationType.Q4_K).copy())
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    dense = PackedLinear(weight.to(torch.bfloat16), None)
    assert not dense.use_blocks(torch.from_numpy(raw), Q4_K, int8_activations=False)
    assert dense.blocks is None
    linear = PackedLinear(weight.to(torch.bfloat16), None)
    assert linear.use_blocks(torch.from_numpy(raw), Q4_K, int8_activations=True)
    assert linear.int8_inputs and linear.blocks is not None
    got, want = linear(x).float(), dense(x).float()
    assert 0 < (got - want).abs().max() < 0.02 * want.abs().max()

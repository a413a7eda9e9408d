"""The AMX matmul kernel: decode matmuls on GGUF blocks (ops/csrc/quant_linear.cpp) against
oneDNN on the same weights. (Prefill attention, with AMX tiles or without: test_dot_kernels.py.)

The matmul kernel rebuilds the bf16 weights the loader makes of the blocks (gguf-py's dequantization,
then rounding to bf16) and multiplies them in the order oneDNN's AMX kernel does, so every
result must be bit-identical to oneDNN's on up to 64 rows, and a row's result must not depend
on how many rows share the call: that is what lets the engine switch between the two by batch
size without changing any output. The kernel needs AMX-BF16; without it the engine
keeps the bf16 weights and these tests skip.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from block_helpers import TYPES, bf16_weight, random_blocks
from conftest_models import default_gguf
from conveyor import ops


@pytest.fixture(scope="module")
def qops():
    assert ops.load_cpu_kernels(), "the C++ kernels must build on this machine (g++ and ninja)"
    if not ops.amx_available():
        pytest.skip("quantized_linear needs a CPU with AMX-BF16")
    return torch.ops.conveyor


def onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 64])
def test_quantized_linear_is_bit_identical_to_onednn(qops, qtype, rows) -> None:
    out_features, in_features = 80, 1536  # 5 row tiles; 48 blocks
    raw = random_blocks(qtype, out_features, in_features, seed=rows)
    weight = bf16_weight(raw, qtype)
    blocks = qops.pack_block_weights(torch.from_numpy(raw), int(qtype))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    expected = onednn(x, weight, None)
    assert expected.abs().max() > 0.1  # a real product, not zeros
    assert torch.equal(qops.quantized_linear(x, blocks, None), expected)
    assert torch.equal(qops.quantized_linear(x, blocks, bias), onednn(x, weight, bias))


@pytest.mark.parametrize("rows", [65, 80, 130, 300])
def test_quantized_linear_gives_a_row_the_same_bits_in_any_batch(qops, rows) -> None:
    """Past 64 rows (4 accumulator tiles) the kernel sweeps the weights once per 64 tokens;
    every row still gets the bits it gets alone, which are oneDNN's for that row."""
    qtype = GGMLQuantizationType.Q4_0
    raw = random_blocks(qtype, 48, 576, seed=rows)
    weight = bf16_weight(raw, qtype)
    blocks = qops.pack_block_weights(torch.from_numpy(raw), int(qtype))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    together = qops.quantized_linear(x, blocks, bias)
    for start in range(0, rows, 64):
        piece = x[start:start + 64]
        assert torch.equal(together[start:start + 64], onednn(piece, weight, bias))
    for row in (0, 63, 64, rows - 1):
        assert torch.equal(together[row:row + 1], qops.quantized_linear(x[row:row + 1], blocks, bias))


def test_linear_picks_blocks_or_packed_weight_with_the_same_results(qops) -> None:
    """ops.linear reads the blocks up to quantized_linear_max_rows rows, oneDNN beyond (where
    oneDNN's one call gives the rows the bits of smaller calls, else halves): a row's result
    is the same in every batch."""
    qtype = GGMLQuantizationType.Q4_1
    raw = random_blocks(qtype, 48, 576, seed=3)
    weight = bf16_weight(raw, qtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    blocks = qops.pack_block_weights(torch.from_numpy(raw), int(qtype))
    limit = qops.quantized_linear_max_rows()
    assert limit >= 64
    x = torch.randn(limit + 30, 576).to(torch.bfloat16)
    together = qops.linear(x, packed, blocks, None)  # too many rows: oneDNN
    assert torch.equal(together[:64], onednn(x[:64], weight, None))
    for rows in (1, 64, 65, limit):
        assert torch.equal(qops.linear(x[:rows], packed, blocks, None), together[:rows])
    with pytest.raises(RuntimeError, match="row"):
        qops.quantized_linear(x[:0], blocks, None)


def test_pack_block_weights_refuses_what_it_cannot_read(qops) -> None:
    raw = torch.zeros(32, 2, 20, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="Q4_0"):
        qops.pack_block_weights(raw, int(GGMLQuantizationType.Q6_K))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        qops.pack_block_weights(raw[:20], int(GGMLQuantizationType.Q4_1))
    with pytest.raises(RuntimeError, match="uint8"):
        qops.pack_block_weights(raw, int(GGMLQuantizationType.Q8_0))  # 20-byte blocks
    with pytest.raises(RuntimeError, match="pack_block_weights"):
        qops.quantized_linear(torch.zeros(1, 64, dtype=torch.bfloat16), raw, None)


def test_block_weights_are_the_loaders_weights() -> None:
    """The raw blocks the loader hands over decode to exactly the weights it loads, rotary
    permutation (q, k) included."""
    from conveyor.model.gguf_loader import (
        gguf_block_weights,
        gguf_model_config,
        iter_gguf_tensors,
        open_gguf,
    )

    reader = open_gguf(default_gguf())
    config = gguf_model_config(reader)
    blocks = gguf_block_weights(reader, config)
    wanted = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"}
    checked = set()
    for name, weight in iter_gguf_tensors(reader, config):
        if name in wanted:
            qtype, raw = blocks[name]
            decoded = dequantize(raw.numpy().reshape(raw.shape[0], -1), GGMLQuantizationType(qtype))
            assert np.array_equal(decoded, weight.numpy()), name
            checked.add(name)
        if checked == wanted:
            break
    assert checked == wanted
    assert len(blocks) == 7 * config.num_hidden_layers + 1  # every matrix of the Q4_1 file


def test_default_model_decodes_from_blocks_with_unchanged_outputs(kv_free) -> None:
    """bf16 SmolLM2: every matmul takes its GGUF blocks, and greedy outputs of a batch are
    the same as with the bf16 weights alone."""
    from conveyor import LLM, SamplingParams

    if not ops.amx_available():
        pytest.skip("quantized_linear needs a CPU with AMX-BF16")
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3,"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for quantized in (True, False):
        default_gguf()  # skips the test when the model package is not installed
        llm = LLM(dtype="bfloat16", kv_cache_memory="32MiB", max_model_len=512,
                  quantized_matmuls=quantized)
        model = llm.engine.runner.model
        linears = [m for m, _ in model.matmul_layers()[:-1]] + [model.lm_head]
        assert all((m.blocks is not None) == quantized for m in linears)
        outputs[quantized] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        kv_free(llm)
    assert outputs[True] == outputs[False]

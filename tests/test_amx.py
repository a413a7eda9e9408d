"""The AMX kernels: decode matmuls on GGUF blocks (ops/csrc/quant_linear.cpp) against oneDNN
on the same weights, and prefill attention (ops/csrc/prefill_attention.cpp) against SDPA.

The matmul kernel rebuilds the bf16 weights the loader makes of the blocks (gguf-py's dequantization,
then rounding to bf16) and multiplies them in the order oneDNN's AMX kernel does, so every
result must be bit-identical to oneDNN's: that is what lets the engine switch between the two
by batch size without changing any output. The kernel needs AMX-BF16; without it the engine
keeps the bf16 weights and these tests skip.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from conftest_models import default_gguf
from conveyor import ops
from conveyor.model.gguf_loader import BLOCK_BYTES

TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


@pytest.fixture(scope="module")
def qops():
    assert ops.load_cpu_kernels(), "the C++ kernels must build on this machine (g++ and ninja)"
    if not ops.amx_available():
        pytest.skip("quantized_linear needs a CPU with AMX-BF16")
    return torch.ops.conveyor


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """GGUF blocks of random weights: uint8 [rows, cols / 32, block bytes]."""
    rng = np.random.default_rng(seed)
    nbytes = BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (rows, cols // 32, nbytes), dtype=np.uint8)
    # Scales of realistic size (random bytes would make NaN and inf fp16 scales).
    raw[..., 0:2] = rng.uniform(1e-3, 2e-2, (rows, cols // 32)).astype(np.float16)[..., None].view(np.uint8)
    if qtype == GGMLQuantizationType.Q4_1:  # m, the block's minimum
        raw[..., 2:4] = rng.uniform(-0.2, 0.0, (rows, cols // 32)).astype(np.float16)[..., None].view(np.uint8)
    return raw


def bf16_weight(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """What the loader makes of the blocks: gguf-py's float32 values, rounded to bf16."""
    rows = raw.shape[0]
    values = dequantize(raw.reshape(rows, -1), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16)


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


def test_linear_picks_blocks_or_packed_weight_with_the_same_results(qops) -> None:
    """ops.linear reads the blocks up to quantized_linear_max_rows rows, oneDNN beyond."""
    qtype = GGMLQuantizationType.Q4_1
    raw = random_blocks(qtype, 48, 576, seed=3)
    weight = bf16_weight(raw, qtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    blocks = qops.pack_block_weights(torch.from_numpy(raw), int(qtype))
    limit = qops.quantized_linear_max_rows()
    x = torch.randn(limit + 30, 576).to(torch.bfloat16)
    together = qops.linear(x, packed, blocks, None)  # too many rows: oneDNN
    assert torch.equal(together, onednn(x, weight, None))
    for rows in (1, limit):
        assert torch.equal(qops.linear(x[:rows], packed, blocks, None), together[:rows])
    with pytest.raises(RuntimeError, match="rows"):
        qops.quantized_linear(x, blocks, None)


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


# --- prefill attention -----------------------------------------------------------------------

def _masked_sdpa(q, k, v, offset: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """SDPA in `dtype` with the prefill mask: query i sees keys <= offset + i."""
    pos_q = torch.arange(q.shape[0]) + offset
    mask = torch.arange(k.shape[0])[None, :] <= pos_q[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).to(dtype), k.transpose(0, 1).unsqueeze(0).to(dtype),
        v.transpose(0, 1).unsqueeze(0).to(dtype), attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1).float()


@pytest.mark.parametrize("length,offset,heads,kv_heads,head_dim", [
    (1, 0, 9, 3, 64), (37, 0, 9, 3, 64), (300, 0, 9, 3, 64), (40, 100, 9, 3, 64),
    (33, 5, 4, 4, 128), (17, 0, 6, 2, 32), (16, 16, 2, 1, 96)])
def test_prefill_attention_is_as_close_to_float32_as_sdpa(qops, length, offset, heads, kv_heads,
                                                          head_dim) -> None:
    gen = torch.Generator().manual_seed(length + offset)
    q = torch.randn(length, heads, head_dim, generator=gen).to(torch.bfloat16)
    k = torch.randn(offset + length, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(offset + length, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    scale = head_dim ** -0.5
    exact = _masked_sdpa(q, k, v, offset, scale, torch.float32)
    sdpa_error = (_masked_sdpa(q, k, v, offset, scale, torch.bfloat16) - exact).abs().max()
    out = qops.prefill_attention(q, k, v, offset, scale)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert (out.float() - exact).abs().max() <= 2 * sdpa_error + 1e-3
    # strided views, as the model passes them (q, k, v side by side in one row)
    qkv = torch.cat([q.flatten(1), k[offset:].flatten(1), v[offset:].flatten(1)], 1)
    if offset == 0:
        kv = heads * head_dim
        views = [qkv[:, :kv], qkv[:, kv:kv + kv_heads * head_dim], qkv[:, kv + kv_heads * head_dim:]]
        qs, ks, vs = (t.unflatten(1, (-1, head_dim)) for t in views)
        assert torch.equal(qops.prefill_attention(qs, ks, vs, 0, scale), out)


def test_prefill_attention_refuses_bad_shapes(qops) -> None:
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="offset"):
        qops.prefill_attention(q, q[:3], q[:3], 0, 0.125)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        qops.prefill_attention(q[..., :48], q[..., :48], q[..., :48], 0, 0.125)
    with pytest.raises(RuntimeError, match="bf16"):
        qops.prefill_attention(q.float(), q.float(), q.float(), 0, 0.125)


def test_default_model_bf16_outputs_do_not_depend_on_chunks_or_batch(kv_free) -> None:
    """bf16 SmolLM2 with both AMX kernels: a prompt's greedy output is the same alone, split
    into 16-token chunks next to running decodes, and in a batch."""
    from conveyor import LLM, SamplingParams

    if not ops.amx_available():
        pytest.skip("the AMX kernels need a CPU with AMX-BF16")
    default_gguf()
    prompt = ("Write a short story about a lighthouse keeper who finds a message in a bottle "
              "on a stormy night, and what she does next.")
    others = ["The capital of France is", "def fib(n):", "1, 2, 3,"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    big = LLM(dtype="bfloat16", kv_cache_memory="32MiB", max_model_len=512)
    (alone,) = big.generate(prompt, params)
    together = big.generate([*others, prompt], params)
    kv_free(big)
    small = LLM(dtype="bfloat16", kv_cache_memory="32MiB", max_model_len=512,
                max_num_batched_tokens=16)
    chunked = small.generate([*others, prompt], params)
    assert small.stats().num_steps > 3
    kv_free(small)
    want = alone.outputs[0].token_ids
    assert together[-1].outputs[0].token_ids == want
    assert chunked[-1].outputs[0].token_ids == want
    assert [o.outputs[0].token_ids for o in chunked] == [o.outputs[0].token_ids for o in together]

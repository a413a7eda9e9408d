"""The AVX512-BF16 kernels (CPUs without AMX): matmuls on pair tiles or GGUF blocks
(Q4_K and Q6_K too; ops/csrc/dot_linear.cpp, dot_blocks.cpp; with AVX512-VNNI, blocks with
int8 inputs, vnni_blocks.cpp), and prefill attention (ops/csrc/prefill_attention.cpp, which
takes AMX tiles where the CPU has them and vdpbf16ps elsewhere).

What makes the engine batch-invariant on such CPUs is tested here at the kernel level: a row's
matmul result does not depend on how many rows share the call (on blocks or bf16 weights); a
query row's attention does not depend on its chunk. The kernels need
a CPU with AVX512-BF16; elsewhere the engine runs float32 and these tests skip.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from block_helpers import (
    TYPES,
    bf16_weight,
    dequantized_parts,
    k_quant_parts,
    masked_sdpa,
    random_blocks,
    random_q4k_blocks,
    random_q6k_blocks,
)
from conveyor import ops


@pytest.fixture(scope="module")
def kops():
    assert ops.load_cpu_kernels(), "the C++ kernels must build on this machine (g++ and ninja)"
    if not torch.ops.conveyor.dot_linear_available():
        pytest.skip("the dot kernels need a CPU with AVX512-BF16")
    return torch.ops.conveyor


@pytest.mark.parametrize("out_features,in_features", [(80, 576), (48, 70), (576, 1536), (16, 2)])
def test_dot_linear_is_as_close_to_float32_as_onednn(kops, out_features, in_features) -> None:
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    x = torch.randn(70, in_features, generator=gen).to(torch.bfloat16)
    exact = x.float() @ w.float().T + bias.float()
    onednn_error = (torch.nn.functional.linear(x, w, bias).float() - exact).abs().max()
    got = kops.dot_linear(x, kops.pack_dot_weight(w), bias)
    assert got.shape == (70, out_features) and got.dtype == torch.bfloat16
    assert (got.float() - exact).abs().max() <= 2 * onednn_error + 1e-6


@pytest.fixture(scope="module")
def vnni(kops):
    if not kops.vnni_blocks_available():
        pytest.skip("int8 inputs need a CPU with AVX512-VNNI")
    return kops


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_the_batch(kops, qtype) -> None:
    """On blocks (bf16 or, with VNNI, int8 inputs) and on bf16 pair tiles, a row gets the same
    bits alone, in a decode-sized batch or in a prefill-sized one (over 256 rows: two token
    passes; 4-16 rows read int8 records in place, 8 rows at a time)."""
    out_features, in_features = 80, 1536  # 5 row tiles: one full task of 4 and a partial one
    raw = random_blocks(qtype, out_features, in_features, seed=int(qtype))
    blocks = kops.pack_dot_blocks(torch.from_numpy(raw), int(qtype), torch.bfloat16)
    tiles = kops.pack_dot_weight(bf16_weight(raw, qtype))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    weights = [blocks, tiles]
    if kops.vnni_blocks_available():
        weights.append(kops.pack_vnni_blocks(torch.from_numpy(raw), int(qtype)))
    for w in weights:
        together = kops.dot_linear(x, w, bias)
        for start, rows in [(0, 1), (7, 1), (3, 2), (10, 3), (10, 5), (20, 13), (30, 16),
                            (40, 64), (1, 299)]:
            part = slice(start, start + rows)
            assert torch.equal(kops.dot_linear(x[part], w, bias), together[part])
    # ops.linear picks the kernel by the weight's layout (pair tiles are not oneDNN's)
    assert torch.equal(kops.linear(x, tiles, blocks, bias), kops.dot_linear(x, blocks, bias))
    assert torch.equal(kops.linear(x, tiles, None, bias), kops.dot_linear(x, tiles, bias))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_block_matmuls_are_the_exact_gguf_weights(kops, qtype, rows) -> None:
    """The blocks' product is the exact weights' (d * q + m in float32, not rounded to bf16):
    closer to the float32 product than the bf16 weights' own."""
    out_features, in_features = 48, 576
    raw = random_blocks(qtype, out_features, in_features, seed=rows)
    exact = torch.from_numpy(dequantize(raw.reshape(out_features, -1), qtype).copy())
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    want = x.float() @ exact.T
    blocks = kops.pack_dot_blocks(torch.from_numpy(raw), int(qtype), torch.bfloat16)
    got = kops.dot_linear(x, blocks, None).float()
    bf16_weights = kops.dot_linear(x, kops.pack_dot_weight(exact.to(torch.bfloat16)), None).float()
    assert want.abs().max() > 0.1  # a real product, not zeros
    assert (got - want).abs().max() <= (bf16_weights - want).abs().max()


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "both"])
def test_k_quant_blocks_are_the_exact_gguf_weights(kops, kind) -> None:
    """Q4_K and Q6_K (llama.cpp's Q4_K_M files) on bf16 inputs, repacked per 32 with float32
    scales (Q6_K's per 16 inputs: two sums per block), and a weight fused from both in records
    of one kind (``k_mixed``): closer to the product with gguf-py's float32 weights than the
    bf16 weights' own, on both ways of reading the blocks, the same bits for a row whatever
    the batch."""
    parts = k_quant_parts(kind)
    mixed = len(parts) > 1
    w = torch.cat([kops.pack_dot_blocks(torch.from_numpy(raw), int(qtype), torch.bfloat16, mixed)
                   for qtype, raw in parts])
    exact = dequantized_parts(parts)
    x = torch.randn(150, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    together = kops.dot_linear(x, w, None)
    want = x.float() @ exact.T
    bf16_weights = kops.dot_linear(x, kops.pack_dot_weight(exact.to(torch.bfloat16)), None).float()
    assert want.abs().max() > 0.1  # a real product, not zeros
    assert (together.float() - want).abs().max() <= (bf16_weights - want).abs().max()
    for start, rows in [(0, 1), (7, 2), (10, 3), (10, 5), (40, 64), (1, 149)]:
        part = slice(start, start + rows)
        assert torch.equal(kops.dot_linear(x[part], w, None), together[part])
    with pytest.raises(RuntimeError, match="k_mixed records are for Q4_K and Q6_K"):
        kops.pack_dot_blocks(torch.from_numpy(random_blocks(TYPES[0], 16, 32, 0)), 2,
                             torch.bfloat16, True)


def _int8_inputs_product(x: torch.Tensor, raw, qtype) -> torch.Tensor:
    """What vnni_blocks.cpp computes, spelled out in float64: each token's inputs per block of
    32 as int8 (dx = max |x| / 127, q = round(x * (127 / max |x|)) in float32), each block's
    sum d * dx * sum (q_w - 8) q_x (Q8_0: the int8 q_w), plus for Q4_1 (m + 8d) * sum x."""
    blocks = raw.shape[1]
    xf = x.float().view(x.shape[0], blocks, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    qx = torch.round(xf * inv).double()
    dx = (amax / 127).double()
    d = torch.from_numpy(raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float64))
    if qtype == GGMLQuantizationType.Q8_0:
        qw = torch.from_numpy(raw[..., 2:].view(np.int8).astype(np.float64))
    else:
        nibbles = raw[..., 4 if qtype == GGMLQuantizationType.Q4_1 else 2:]
        qw = torch.from_numpy(np.concatenate([nibbles & 15, nibbles >> 4], -1).astype(np.float64)) - 8
    ints = torch.einsum("mbk,nbk->mnb", qx, qw)  # exact: integers below 2^53
    y = (ints * d[None] * dx[..., 0][:, None, :]).sum(-1)
    if qtype == GGMLQuantizationType.Q4_1:
        m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
        y += ((m + 8 * d)[None] * xf.double().sum(-1)[:, None, :]).sum(-1)
    return y


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 13, 70])
def test_int8_inputs_are_the_blocks_product_on_8_bit_inputs(vnni, qtype, rows) -> None:
    """With int8 inputs the product is the exact GGUF weights' against each token's inputs
    rounded to 8 bits per block of 32 (the scheme in float64, to the output's bf16 rounding),
    and so within the inputs' rounding of the exact float32 product."""
    out_features, in_features = 48, 576
    raw = random_blocks(qtype, out_features, in_features, seed=rows + 10)
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, in_features, generator=gen) * 3).to(torch.bfloat16)
    x[0, :32] = 0  # a block of zeros: scale 0, no division by it
    got = vnni.dot_linear(x, vnni.pack_vnni_blocks(torch.from_numpy(raw), int(qtype)), None)
    scheme = _int8_inputs_product(x, raw, qtype)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert ((got.double() - scheme).abs() <= scheme.abs() * 2**-8 + 1e-4 * scheme.abs().max()).all()
    exact = x.float() @ torch.from_numpy(dequantize(raw.reshape(out_features, -1), qtype).copy()).T
    error = (got.float() - exact).abs().max() / exact.abs().max()
    assert 0 < error < 0.02  # the inputs' rounding shows, and stays small


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K],
                         ids=lambda t: t.name)
def test_int8_inputs_read_k_quant_blocks(vnni, qtype) -> None:
    """Q4_K and Q6_K (llama.cpp's Q4_K_M files: 256 weights per block; Q4_K a 6-bit scale and
    min per 32, Q6_K 6-bit values and an int8 scale per 16) repacked per 32 with exact float32
    scales: the same product as on the dequantized weights but for the inputs' rounding, on
    the kernel's three paths (up to 3 tokens, 4 records' sums in registers; up to 16, records
    read in place 8 tokens at a time; more, unpacked first), and the same bits for a row
    whatever the batch."""
    rows, cols = 48, 512
    make = random_q4k_blocks if qtype == GGMLQuantizationType.Q4_K else random_q6k_blocks
    raw = make(rows, cols, seed=7)
    exact = torch.from_numpy(dequantize(raw.reshape(rows, -1), qtype).copy())
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    w = vnni.pack_vnni_blocks(torch.from_numpy(raw), int(qtype))
    got = vnni.dot_linear(x, w, None)
    want = x.float() @ exact.T
    assert 0 < ((got.float() - want).abs().max() / want.abs().max()) < 0.02
    for part in (slice(0, 1), slice(3, 5), slice(5, 8), slice(20, 33), slice(10, 50)):
        assert torch.equal(vnni.dot_linear(x[part], w, None), got[part])
    with pytest.raises(RuntimeError, match=rf"{qtype.name} blocks must be uint8 \[rows"):
        vnni.pack_vnni_blocks(torch.zeros(16, 2, 20, dtype=torch.uint8), int(qtype))


def test_int8_inputs_read_q4_k_and_q6_k_parts_as_one_weight(vnni) -> None:
    """A matmul fused from Q4_K and Q6_K parts (q, k and v of a Q4_K_M file's layer): both
    repacked to records of one kind (``k_mixed``) and concatenated, the product on the
    parts' dequantized weights but for the inputs' rounding, as each type's own records
    give it, on the kernel's three paths."""
    parts = k_quant_parts("both")
    exact = dequantized_parts(parts)
    w = torch.cat([vnni.pack_vnni_blocks(torch.from_numpy(raw), int(qtype), True)
                   for qtype, raw in parts])
    q4k = parts[0][1]
    own = vnni.pack_vnni_blocks(torch.from_numpy(q4k), int(GGMLQuantizationType.Q4_K))
    for rows in (2, 13, 40):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        got = vnni.dot_linear(x, w, None)
        want = x.float() @ exact.T
        assert 0 < ((got.float() - want).abs().max() / want.abs().max()) < 0.02
        alone = vnni.dot_linear(x, own, None).float()  # Q4_K's own records
        assert ((got[:, :48].float() - alone).abs() <= 2**-7 * alone.abs().max()).all()
    with pytest.raises(RuntimeError, match="k_mixed records are for Q4_K and Q6_K"):
        vnni.pack_vnni_blocks(torch.from_numpy(random_blocks(TYPES[0], 16, 32, 0)), 2, True)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_int8_inputs_carry_nan_and_inf_through(vnni, qtype) -> None:
    """A NaN or an infinity among a row's inputs makes that row's outputs NaN, as the bf16
    kernels' (not a finite value from a NaN rounded to an integer); other rows are untouched."""
    raw = random_blocks(qtype, 32, 128, seed=3)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[1, 40], x[4, 7] = float("nan"), float("inf")
    for rows in (slice(0, 2), slice(0, 6)):  # read in place, and unpacked
        got = vnni.dot_linear(x[rows], vnni.pack_vnni_blocks(torch.from_numpy(raw), int(qtype)), None)
        assert got[1].isnan().all() and got[0].isfinite().all()
    assert got[4].isnan().all() and got[[2, 3, 5]].isfinite().all()


def test_dot_kernels_refuse_what_they_cannot_read(kops) -> None:
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kops.pack_dot_weight(torch.zeros(20, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kops.pack_dot_blocks(torch.zeros(20, 2, 20, dtype=torch.uint8), 3, torch.bfloat16)
    with pytest.raises(RuntimeError, match="pack_vnni_blocks: rows must be a multiple of 16"):
        kops.pack_vnni_blocks(torch.zeros(20, 2, 20, dtype=torch.uint8), 3)
    with pytest.raises(RuntimeError, match="pack_dot_weight"):
        kops.dot_linear(torch.zeros(1, 64, dtype=torch.bfloat16),
                        torch.zeros(16, 64, dtype=torch.bfloat16), None)
    tiles = kops.pack_dot_weight(torch.zeros(16, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"x must be bf16 or float32 \[rows, 64\], got \[1, 32\]"):
        kops.dot_linear(torch.zeros(1, 32, dtype=torch.bfloat16), tiles, None)


# --- prefill attention -----------------------------------------------------------------------

@pytest.mark.parametrize("length,offset,heads,kv_heads,head_dim", [
    (1, 0, 9, 3, 64), (37, 0, 9, 3, 64), (300, 0, 9, 3, 64), (40, 100, 9, 3, 64),
    (33, 5, 4, 4, 128), (17, 0, 6, 2, 32), (16, 16, 2, 1, 96)])
def test_prefill_attention_is_as_close_to_float32_as_sdpa(kops, length, offset, heads, kv_heads,
                                                          head_dim) -> None:
    gen = torch.Generator().manual_seed(length + offset)
    q = torch.randn(length, heads, head_dim, generator=gen).to(torch.bfloat16)
    k = torch.randn(offset + length, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(offset + length, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    scale = head_dim ** -0.5
    exact = masked_sdpa(q, k, v, offset, scale, torch.float32)
    sdpa_error = (masked_sdpa(q, k, v, offset, scale, torch.bfloat16) - exact).abs().max()
    out = kops.prefill_attention(q, k, v, offset, scale)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert (out.float() - exact).abs().max() <= 2 * sdpa_error + 1e-3
    # strided views, as the model passes them (q, k, v side by side in one row)
    qkv = torch.cat([q.flatten(1), k[offset:].flatten(1), v[offset:].flatten(1)], 1)
    if offset == 0:
        kv = heads * head_dim
        views = [qkv[:, :kv], qkv[:, kv:kv + kv_heads * head_dim], qkv[:, kv + kv_heads * head_dim:]]
        qs, ks, vs = (t.unflatten(1, (-1, head_dim)) for t in views)
        assert torch.equal(kops.prefill_attention(qs, ks, vs, 0, scale), out)


def test_a_query_rows_attention_does_not_depend_on_its_chunk(kops) -> None:
    """A 150-token prompt at once, or as chunks of 7, 40 and 103 tokens over its cached prefix:
    every row's output is the same bits."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(150, 9, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(150, 3, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(150, 3, 64, generator=gen).to(torch.bfloat16)
    whole = kops.prefill_attention(q, k, v, 0, 0.125)
    start = 0
    for length in (7, 40, 103):
        end = start + length
        part = kops.prefill_attention(q[start:end], k[:end], v[:end], start, 0.125)
        assert torch.equal(part, whole[start:end])
        start = end


@pytest.mark.parametrize("kv_heads,head_dim,block_size", [(3, 64, 16), (2, 128, 32)])
def test_prefill_attention_over_a_tile_layout_cache_is_prefill_attention(
        kops, kv_heads, head_dim, block_size) -> None:
    """prefill_attention_tiles reads a chunk's keys and prefix where a tile-layout cache holds
    them (reference.is_tiles): the same bits as prefill_attention over those keys as rows,
    with and without a prefix, one row to a few hundred."""
    from conveyor.ops import reference

    gen = torch.Generator().manual_seed(head_dim)
    heads, num_blocks = 4 * kv_heads, 40
    _, shape = reference.kv_cache_shape(num_blocks, block_size, kv_heads, head_dim, "auto",
                                        torch.bfloat16, tiles=True)
    cache = torch.zeros(shape, dtype=torch.bfloat16)
    slots = torch.arange(num_blocks * block_size)
    k = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    kops.write_kv_(k, v, cache, slots)
    table = torch.randperm(num_blocks, generator=gen)[:24]
    rows = (table[:, None] * block_size + torch.arange(block_size)).reshape(-1)  # positions
    for offset, length in ((0, 37), (100, 40), (0, 300), (17, 1)):
        q = torch.randn(length, heads, head_dim, generator=gen).to(torch.bfloat16)
        keys = rows[:offset + length]
        expected = kops.prefill_attention(q, k[keys], v[keys], offset, head_dim ** -0.5)
        actual = kops.prefill_attention_tiles(q, cache, table, offset, head_dim ** -0.5)
        assert torch.equal(actual, expected)


def test_prefill_attention_refuses_bad_shapes(kops) -> None:
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="offset"):
        kops.prefill_attention(q, q[:3], q[:3], 0, 0.125)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kops.prefill_attention(q[..., :48], q[..., :48], q[..., :48], 0, 0.125)
    with pytest.raises(RuntimeError, match="bf16"):
        kops.prefill_attention(q.float(), q.float(), q.float(), 0, 0.125)

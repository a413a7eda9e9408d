"""The float32 matmul kernels (ops/csrc/f32_linear.cpp: AVX2 and FMA, on 16-lane registers
with AVX-512), which every float32 matmul takes on CPU: on lane tiles of a float32 weight or
on GGUF blocks.

What makes float32 serving batch-invariant is tested here at the kernel level: a row's result
does not depend on how many rows share the call (torch's own float32 matmul switches kernels
by row count and differs in the last bits). The engine-level guarantee, on the default model,
is tests/test_batch_invariance.py.
"""

from __future__ import annotations

import pytest
import torch
from gguf.quants import dequantize

from block_helpers import TYPES, dequantized_parts, k_quant_parts, random_blocks
from conveyor import ops

# (start, rows) slices of a 300-row call: alone, decode-sized, and over a token pass (64 rows).
PARTS = [(0, 1), (7, 1), (3, 2), (10, 3), (10, 5), (40, 64), (0, 65), (100, 144), (1, 299)]


@pytest.fixture(scope="module")
def kops():
    assert ops.load_cpu_kernels(), "the C++ kernels must build on this machine (g++ and ninja)"
    if not torch.ops.conveyor.f32_linear_available():
        pytest.skip("the float32 kernels need a CPU with AVX2 and FMA")
    return torch.ops.conveyor


def _exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("out_features,in_features", [(80, 576), (48, 70), (576, 1536), (8, 3)])
def test_lane_tiles_are_close_to_float64(kops, out_features, in_features) -> None:
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(70, in_features, generator=gen)
    exact = _exact(x, w, bias)
    got = kops.dot_linear(x, kops.pack_dot_weight(w), bias)
    assert got.shape == (70, out_features) and got.dtype == torch.float32
    # One sum per output, in order: a few float32 roundings per input (a wrong layout or a
    # missed input is off by the size of a product, ~1).
    assert (got.double() - exact).abs().max() <= 2e-6 * in_features ** 0.5 * exact.abs().max()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_the_batch(kops, qtype) -> None:
    """On blocks and on lane tiles, a row gets the same bits alone, in a decode-sized batch or
    in a prefill-sized one; 80 outputs are 10 lane tiles: two full tasks of 4 and a partial."""
    out_features, in_features = 80, 1536
    raw = random_blocks(qtype, out_features, in_features, seed=int(qtype))
    blocks = kops.pack_dot_blocks(torch.from_numpy(raw), int(qtype), torch.float32)
    exact_w = torch.from_numpy(dequantize(raw.reshape(out_features, -1), qtype).copy())
    tiles = kops.pack_dot_weight(exact_w)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    for w in (blocks, tiles):
        together = kops.dot_linear(x, w, bias)
        for start, rows in PARTS:
            part = slice(start, start + rows)
            assert torch.equal(kops.dot_linear(x[part], w, bias), together[part])
    # ops.linear picks the kernel by the weight's layout, with the blocks when given
    assert torch.equal(kops.linear(x, tiles, blocks, bias), kops.dot_linear(x, blocks, bias))
    assert torch.equal(kops.linear(x, tiles, None, bias), kops.dot_linear(x, tiles, bias))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_block_matmuls_are_the_exact_gguf_weights(kops, qtype, rows) -> None:
    """Both ways of reading the blocks (in registers up to 3 rows, through L1 beyond) give
    the product with gguf-py's float32 weights, to float32 accuracy."""
    out_features, in_features = 48, 576
    raw = random_blocks(qtype, out_features, in_features, seed=rows)
    exact_w = torch.from_numpy(dequantize(raw.reshape(out_features, -1), qtype).copy())
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    want = _exact(x, exact_w, None)
    got = kops.dot_linear(x, kops.pack_dot_blocks(torch.from_numpy(raw), int(qtype),
                                                   torch.float32), None)
    assert want.abs().max() > 0.1  # a real product, not zeros
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "both"])
def test_k_quant_blocks_are_the_exact_gguf_weights(kops, lanes, kind) -> None:
    """Q4_K and Q6_K (llama.cpp's Q4_K_M files), repacked per 32 with float32 scales (Q6_K's
    per 16 inputs: two sums per block), and a weight fused from both in records of one kind
    (``k_mixed``): the product with gguf-py's float32 weights to float32 accuracy, on both
    ways of reading the blocks, the same bits for a row whatever the batch, on 8 and 16
    lanes."""
    parts = k_quant_parts(kind)
    mixed = len(parts) > 1
    w = torch.cat([kops.pack_dot_blocks(torch.from_numpy(raw), int(qtype), torch.float32, mixed)
                   for qtype, raw in parts])
    exact_w = dequantized_parts(parts)
    x = torch.randn(150, 512, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(exact_w.shape[0], generator=torch.Generator().manual_seed(4))
    together = kops.dot_linear(x, w, bias)
    want = _exact(x, exact_w, bias)
    assert want.abs().max() > 0.1  # a real product, not zeros
    assert (together.double() - want).abs().max() <= 1e-5 * want.abs().max()
    for start, rows in [(0, 1), (7, 2), (10, 3), (10, 5), (40, 64), (1, 149)]:
        part = slice(start, start + rows)
        assert torch.equal(kops.dot_linear(x[part], w, bias), together[part])
        if lanes == 16:
            kops.f32_vector_lanes(8)
            assert torch.equal(kops.dot_linear(x[part], w, bias), together[part])
            kops.f32_vector_lanes(16)


def test_k_quant_records_are_refused_where_they_do_not_apply(kops) -> None:
    with pytest.raises(RuntimeError, match="k_mixed records are for Q4_K and Q6_K"):
        kops.pack_dot_blocks(torch.from_numpy(random_blocks(TYPES[0], 16, 32, 0)), 2,
                             torch.float32, True)
    with pytest.raises(RuntimeError, match=r"Q6_K blocks must be uint8 \[rows \(a multiple of 8"):
        kops.pack_dot_blocks(torch.zeros(8, 2, 20, dtype=torch.uint8), 14, torch.float32)


@pytest.fixture
def lanes(kops):
    """f32_vector_lanes, restored after the test."""
    widest = kops.f32_vector_lanes()
    yield widest
    kops.f32_vector_lanes(widest)


def test_avx512_registers_give_the_avx2_bits(kops, lanes) -> None:
    """With AVX-512 the kernels join two 8-row tiles in a 16-lane register and take 6 tokens
    at a time (AVX2: 3): every output keeps its lane's operations, so each result has the
    same bits as on 8 lanes; on blocks and lane tiles, with and without bias, for row counts
    around every register tile and task shape (24 and 40 outputs: an odd tile count, half a
    register). On an AVX2-only CPU there are only 8 lanes, and asking for 16 is refused."""
    if lanes == 8:
        with pytest.raises(RuntimeError, match="8 or 8 on this CPU"):
            kops.f32_vector_lanes(16)
        assert kops.f32_vector_lanes() == 8
        return
    assert lanes == 16
    gen = torch.Generator().manual_seed(5)
    weights = []
    for qtype in TYPES:
        raw = random_blocks(qtype, 80, 576, seed=int(qtype))
        weights.append(kops.pack_dot_blocks(torch.from_numpy(raw), int(qtype), torch.float32))
    for out_features, in_features in [(80, 576), (24, 70), (40, 33)]:
        weights.append(kops.pack_dot_weight(torch.randn(out_features, in_features,
                                                        generator=gen)))
    for w in weights:
        n = w.size(0) * 8
        k = w.size(1) * 32 if w.dtype == torch.uint8 else w.size(1)
        bias = torch.randn(n, generator=gen)
        for rows in (1, 2, 3, 4, 5, 6, 7, 13, 64, 65, 150):
            x = torch.randn(rows, k, generator=gen)
            for b in (bias, None):
                kops.f32_vector_lanes(8)
                narrow = kops.dot_linear(x, w, b)
                kops.f32_vector_lanes(16)
                assert torch.equal(kops.dot_linear(x, w, b), narrow), (w.shape, rows)
    with pytest.raises(RuntimeError, match="8 or 16 on this CPU"):
        kops.f32_vector_lanes(4)


def test_f32_kernels_refuse_what_they_cannot_read(kops) -> None:
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kops.pack_dot_weight(torch.zeros(20, 64))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kops.pack_dot_blocks(torch.zeros(20, 2, 20, dtype=torch.uint8), 3, torch.float32)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        kops.pack_dot_blocks(torch.zeros(16, 2, 20, dtype=torch.uint8), 3, torch.float16)
    with pytest.raises(RuntimeError, match="pack_dot_weight"):
        kops.dot_linear(torch.zeros(1, 64), torch.zeros(16, 64), None)
    tiles = kops.pack_dot_weight(torch.zeros(16, 64))
    with pytest.raises(RuntimeError, match=r"x must be \[rows, 64\]"):
        kops.dot_linear(torch.zeros(1, 32), tiles, None)
    with pytest.raises(RuntimeError, match=r"bias must be \[16\]"):
        kops.dot_linear(torch.zeros(1, 64), tiles, torch.zeros(8))

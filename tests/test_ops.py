"""The C++ CPU kernels (conveyor/ops/csrc) against the torch reference (conveyor/ops/reference).

Elementwise kernels compute in float32 and round where the reference rounds, so in bf16 and
fp16 nearly every element is identical and the rest differ by one unit in the last place
(float32 sums in another order); attention agrees to float32 summation order. Shapes cover the vector path (head_dim 64/128 with small groups), the scalar
path (other head dims, large groups) and row lengths that are not multiples of 16.
"""

from __future__ import annotations

import pytest
import torch

from conveyor import ops
from conveyor.model.layers import RotaryEmbedding
from conveyor.ops import reference

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module")
def kernels():
    assert ops.load_cpu_kernels(), "the C++ kernels must build on this machine (g++ and ninja)"
    assert isinstance(ops.select_backend(torch.device("cpu"), torch.float32),
                      ops.CpuKernelBackend)
    return torch.ops.conveyor


def _assert_same(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:  # a few units in the last place: sums in another order
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
        return
    eps = torch.finfo(dtype).eps  # one unit in the last place, relative
    torch.testing.assert_close(actual, expected, rtol=eps, atol=eps * 1e-3)
    # Bit-equal but for rare last-place differences (on CPUs without AVX-512 the kernels' sums
    # run in another order than torch's vectors: one value of a 576-wide row may round apart).
    assert (actual != expected).sum() <= max(1, 0.001 * actual.numel())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 576), (13, 576), (300, 100), (5, 7)])
def test_norms_and_silu_match_reference(kernels, dtype, rows, width) -> None:
    gen = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    w = torch.randn(width, generator=gen).to(dtype)
    residual = torch.randn(rows, width, generator=gen).to(dtype)
    _assert_same(kernels.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), dtype)

    x1, r1, x2, r2 = x.clone(), residual.clone(), x.clone(), residual.clone()
    kernels.add_rms_norm_(x1, r1, w, 1e-6)
    reference.add_rms_norm_(x2, r2, w, 1e-6)
    _assert_same(r1, r2, dtype)
    _assert_same(x1, x2, dtype)

    gate_up = torch.randn(rows, 2 * width, generator=gen).mul(4).to(dtype)
    _assert_same(kernels.silu_mul(gate_up), reference.silu_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (6, 6, 40)])
def test_rotary_and_kv_write_match_reference(kernels, dtype, heads, kv_heads, head_dim) -> None:
    gen = torch.Generator().manual_seed(heads * head_dim)
    t, num_blocks, block_size = 11, 8, 4
    table = RotaryEmbedding(head_dim, 512, 10000.0, None).cos_sin
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 512, (t,), generator=gen)
    a, b = qkv.clone(), qkv.clone()
    kernels.rotary_(a, positions, table, heads + kv_heads, head_dim)
    reference.rotary_(b, positions, table, heads + kv_heads, head_dim)
    _assert_same(a, b, dtype)
    assert torch.equal(a[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:])

    k = a[:, heads * head_dim:(heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v = a[:, (heads + kv_heads) * head_dim:].view(t, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    cache1 = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    cache2 = cache1.clone()
    kernels.write_kv_(k, v, cache1, slots)
    reference.write_kv_(k, v, cache2, slots)
    assert torch.equal(cache1, cache2)

    # An int8 cache: the same quantized rows and scales, bit for bit (a zero row included),
    # which read back within half a quantization step (max|row| / 127) of each value.
    k = k.clone()
    k[0, 0] = 0
    _, shape = reference.kv_cache_shape(num_blocks, block_size, kv_heads, head_dim, "int8",
                                        dtype)
    quant1 = torch.zeros(shape, dtype=torch.int8)
    quant2 = quant1.clone()
    kernels.write_kv_(k, v, quant1, slots)
    reference.write_kv_(k, v, quant2, slots)
    assert torch.equal(quant1, quant2)
    everything = torch.arange(num_blocks).unsqueeze(0)
    for plane, x in zip(reference.gather_kv(quant1, everything, head_dim, torch.float32), (k, v),
                        strict=True):
        restored = plane[0].transpose(0, 1)[slots]  # [T, KVH, D]
        step = x.float().abs().amax(-1, keepdim=True) / 127
        assert ((restored - x.float()).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(reference.gather_kv(quant1, everything, head_dim, torch.float32)[0][
        0].transpose(0, 1)[slots[0], 0], torch.zeros(head_dim))
    # read_kv_: the written rows read back as the cache holds them, as gather_kv reads them.
    read1, read2 = (k.clone(), v.clone()), (k.clone(), v.clone())
    kernels.read_kv_(*read1, quant1, slots)
    reference.read_kv_(*read2, quant1, slots)
    for got, want, plane in zip(read1, read2, reference.gather_kv(quant1, everything, head_dim,
                                                                   dtype), strict=True):
        assert torch.equal(got, want)
        assert torch.equal(got, plane[0].transpose(0, 1)[slots])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64),  # SmolLM2: vector path
    (8, 8, 64), (8, 2, 128),  # vector path, other group sizes
    (16, 2, 64), (4, 1, 48),  # scalar path: group of 8, head_dim not a multiple of 16
])
def test_decode_attention_matches_reference(kernels, dtype, heads, kv_heads, head_dim) -> None:
    gen = torch.Generator().manual_seed(heads * kv_heads * head_dim)
    num_blocks, block_size = 40, 16
    lens = torch.tensor([1, 16, 17, 100, 203])
    width = int((lens.max() + block_size - 1) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lens])
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    # q as the model passes it: a strided view into the fused qkv rows
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :heads * head_dim].view(len(lens), heads, head_dim)
    scale = head_dim ** -0.5
    actual = kernels.decode_attention(q, cache, tables, lens, scale)
    expected = reference.decode_attention(q, cache, tables, lens, scale)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)

    # The same K/V in an int8 cache: the kernel reads the rows with their scales as the
    # reference dequantizes them (to the model's dtype), with 16-bit queries and 8-bit
    # attention weights per 16 positions for VNNI: agreement to ~1 %.
    _, shape = reference.kv_cache_shape(num_blocks, block_size, kv_heads, head_dim, "int8",
                                        dtype)
    quant = torch.zeros(shape, dtype=torch.int8)
    reference.write_kv_(cache[0].reshape(-1, kv_heads, head_dim),
                        cache[1].reshape(-1, kv_heads, head_dim), quant,
                        torch.arange(num_blocks * block_size))
    actual = kernels.decode_attention(q, quant, tables, lens, scale)
    expected = reference.decode_attention(q, quant, tables, lens, scale)
    torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-2)


def _qkv_views(rows: int, heads: int, kv_heads: int, head_dim: int,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model passes them: strided views into fused bf16 qkv rows."""
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(torch.bfloat16)
    q = qkv[:, :heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(rows, kv_heads, head_dim)
    return q, k, v


def _tiles_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    element, shape = reference.kv_cache_shape(num_blocks, block_size, kv_heads, head_dim, "auto",
                                              torch.bfloat16, tiles=True)
    return torch.zeros(shape, dtype=element)


@pytest.mark.parametrize("kv_heads,head_dim,block_size", [(3, 64, 16), (2, 128, 32), (1, 32, 16)])
def test_the_tile_layout_holds_what_the_row_layout_holds(kernels, kv_heads, head_dim,
                                                         block_size) -> None:
    """A tile-layout cache (reference.is_tiles) written by the kernel and by the reference:
    the same bytes; read back (read_kv_, both) and gathered (gather_kv), the rows written."""
    gen = torch.Generator().manual_seed(kv_heads * head_dim)
    num_blocks = 12
    rows = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    tiles = _tiles_cache(num_blocks, block_size, kv_heads, head_dim)
    assert reference.is_tiles(tiles) and not reference.is_tiles(rows)
    written = tiles.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:100]
    _, k, v = _qkv_views(len(slots), 4 * kv_heads, kv_heads, head_dim, gen)
    reference.write_kv_(k, v, rows, slots)
    reference.write_kv_(k, v, tiles, slots)
    kernels.write_kv_(k, v, written, slots)
    assert torch.equal(written, tiles)
    tables = torch.randperm(num_blocks, generator=gen).view(3, 4)
    for got, want in zip(reference.gather_kv(tiles, tables, head_dim, torch.bfloat16),
                         reference.gather_kv(rows, tables, head_dim, torch.bfloat16),
                         strict=True):
        assert torch.equal(got, want)
    for read in (kernels.read_kv_, reference.read_kv_):
        k_read, v_read = torch.zeros_like(k), torch.zeros_like(v)
        read(k_read, v_read, tiles, slots)
        assert torch.equal(k_read, k) and torch.equal(v_read, v)
    assert torch.equal(reference.tiles_as_rows(tiles.unsqueeze(0), head_dim)[0], rows)


@pytest.fixture(scope="module")
def tile_kernels(kernels):
    if not ops.prefill_attention_available():
        pytest.skip("decode attention over the tile layout runs on AMX tiles or AVX512-BF16; "
                    "this CPU has neither")
    return kernels


def test_tile_layout_attention_gives_a_row_the_same_bits_in_any_batch(tile_kernels) -> None:
    """decode_attention over a tile-layout cache: as close to the reference as the row-layout
    kernel, and the same bits for a row alone, beside other requests and among a verify's
    rows (consecutive rows sharing a request's blocks, lengths L, L+1, ...). Without AMX
    (vdpbf16ps) a chunk's rows as decodes get the very bits the prefill kernel gives them."""
    tk = tile_kernels
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 60
    rows = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    tiles = _tiles_cache(num_blocks, block_size, kv_heads, head_dim)
    everything = torch.arange(num_blocks * block_size)
    _, k, v = _qkv_views(len(everything), heads, kv_heads, head_dim, gen)
    reference.write_kv_(k, v, rows, everything)
    tk.write_kv_(k, v, tiles, everything)
    lens = torch.tensor([1, 16, 17, 100, 101, 102, 103, 203, 300])
    width = int((lens.max() + block_size - 1) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lens])
    tables[4:7] = tables[3]  # a verify: rows 3-6 are one request's last token and 3 drafts
    q, _, _ = _qkv_views(len(lens), heads, kv_heads, head_dim, gen)
    scale = head_dim ** -0.5
    out = tk.decode_attention(q, tiles, tables, lens, scale)
    expected = reference.decode_attention(q, rows, tables, lens, scale)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    row_layout = tk.decode_attention(q, rows, tables, lens, scale)
    assert (out - expected).abs().max() <= (row_layout - expected).abs().max() * 2
    for i in range(len(lens)):
        alone = tk.decode_attention(q[i:i + 1], tiles, tables[i:i + 1], lens[i:i + 1], scale)
        assert torch.equal(alone, out[i:i + 1])
    verify = tk.decode_attention(q[3:7], tiles, tables[3:7], lens[3:7], scale)
    assert torch.equal(verify, out[3:7])
    # A prefill chunk's rows attend as decodes over this layout: 40 rows of one request
    # (positions 100-139) in one call, split over tasks of 16 query rows, against each alone.
    chunk_q, _, _ = _qkv_views(40, heads, kv_heads, head_dim, gen)
    chunk_tables, chunk_lens = tables[7:8].expand(40, -1).contiguous(), torch.arange(101, 141)
    assert tk.decode_attention(q[:0], tiles, tables[:0], lens[:0], scale).shape == (
        0, heads, head_dim)
    chunk = tk.decode_attention(chunk_q, tiles, chunk_tables, chunk_lens, scale)
    for i in (0, 5, 17, 39):
        assert torch.equal(chunk[i:i + 1], tk.decode_attention(
            chunk_q[i:i + 1], tiles, chunk_tables[i:i + 1], chunk_lens[i:i + 1], scale))
    # The same 40 queries as a prefill chunk at positions 100-139 (keys 0-139 in the cache).
    prefill = tk.prefill_attention_tiles(chunk_q, tiles, tables[7], 100, scale)
    torch.testing.assert_close(prefill, chunk, rtol=1e-2, atol=1e-2)
    if not ops.amx_available():
        assert torch.equal(prefill, chunk)


def test_kernels_refuse_out_of_range_indices(kernels) -> None:
    cache = torch.zeros(2, 4, 16, 1, 64)
    q = torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.decode_attention(q, cache, torch.tensor([[7]]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="context length"):
        kernels.decode_attention(q, cache, torch.tensor([[0]]), torch.tensor([17]), 1.0)
    k = torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="slot"):
        kernels.write_kv_(k, k, cache, torch.tensor([64]))
    table = RotaryEmbedding(64, 32, 10000.0, None).cos_sin
    with pytest.raises(RuntimeError, match="RoPE table"):
        kernels.rotary_(torch.zeros(1, 64), torch.tensor([32]), table, 1, 64)


def test_kernels_can_be_switched_off(monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_KERNELS", "0")
    ops.load_cpu_kernels.cache_clear()
    try:
        assert isinstance(ops.select_backend(torch.device("cpu"), torch.float32),
                          ops.ReferenceBackend)
    finally:
        monkeypatch.delenv("CONVEYOR_KERNELS")
        ops.load_cpu_kernels.cache_clear()
    assert isinstance(ops.select_backend(torch.device("cpu"), torch.float32),
                      ops.CpuKernelBackend)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_matches_reference_and_takes_the_first_of_ties(kernels, dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 1003, generator=gen).to(dtype)
    logits[2, 5] = logits[2, 900] = 50.0  # a tie: the first index wins, as in torch
    logits[3, 1002] = 50.0  # the maximum in the scalar tail
    logits[4] = -1.0  # all equal
    assert torch.equal(kernels.argmax(logits), reference.argmax(logits))
    assert kernels.argmax(logits)[2] == 5


@pytest.mark.parametrize("batch", [2, 10])
@pytest.mark.parametrize("arch_overrides,kv_dtype", [({}, "auto"), ({"attention_bias": True}, "auto"),
                                                    ({}, "int8"), ({}, "tiles")])
def test_fused_decode_layers_match_the_python_forward(kernels, arch_overrides, kv_dtype,
                                                      batch) -> None:
    """ops.decode_layers (model/cpu_decode.py) runs every layer of a decode-only batch in one
    C++ call: it must give bit-identical hidden states and KV writes to the layer-by-layer
    Python forward (in the engine's default dtype on this CPU: bf16 where it has bf16 matrix
    units, else float32). On two threads, 10 requests run as two shares side by side, each
    thread every layer for its own (but where the weights are oneDNN's)."""
    from conveyor.config import ModelConfig
    from conveyor.model.device import resolve_dtype
    from conveyor.model.llama import build_model

    dtype = resolve_dtype("auto", torch.device("cpu"))
    tiles = kv_dtype == "tiles"  # the tile layout: bf16, head_dim 32, blocks of 16
    if tiles and not (dtype == torch.bfloat16 and ops.prefill_attention_available()):
        pytest.skip("the tile-layout cache is read by AMX tiles or vdpbf16ps; this CPU has neither")

    cfg = ModelConfig(architecture="qwen2" if arch_overrides else "llama", vocab_size=300,
                      hidden_size=96 * (1 + tiles), intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16 * (1 + tiles),
                      **arch_overrides)
    model = build_model(cfg, dtype, torch.device("cpu"), None, seed=1)
    block_size, width = (16 if tiles else 4), (1 if tiles else 4)
    num_blocks = batch * width + 3
    element, shape = reference.kv_cache_shape(num_blocks, block_size, cfg.num_key_value_heads,
                                              cfg.head_dim, "auto" if tiles else kv_dtype, dtype,
                                              tiles)
    kv = torch.zeros(cfg.num_hidden_layers, *shape, dtype=element)
    # Each request owns its blocks; prompt lengths of 1-15 tokens, each then decodes one.
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2))[
        :batch * width].view(batch, width)
    lens = [9, 6, 1, 15, 4, 12, 2, 7, 14, 3][:batch]
    fused, python, fused_kv, shares = _fused_and_python_decode(
        model, kv, tables, lens, [1] * batch, block_size, kv_dtype)
    assert torch.equal(fused, python)
    assert torch.equal(fused_kv, kv)
    packed = model._fused_decode.weights.qkv[0]
    if batch == 2 or packed.is_mkldnn:
        assert shares == [0, batch]
    else:  # cut where the two shares' estimated costs are nearest
        assert len(shares) == 3 and 3 <= shares[1] <= 7, shares


def test_fused_decode_keeps_a_requests_rows_in_one_share(kernels) -> None:
    """A request with several rows in a decode-only step (a verify, or a float32 prefill
    chunk, whose rows run as decodes) writes K/V its later rows read in the same layer: the
    shares decode_layers runs side by side cut only between requests. One row of one
    request, nine of another: the only cut is after the first row (the cost-balanced one
    would fall inside the second request, and its rows would read K/V another thread writes
    at another time)."""
    from conveyor.config import ModelConfig
    from conveyor.model.llama import build_model

    cfg = ModelConfig(architecture="llama", vocab_size=300, hidden_size=96,
                      intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=16)
    model = build_model(cfg, torch.float32, torch.device("cpu"), None, seed=1)
    element, shape = reference.kv_cache_shape(12, 4, 2, 16, "auto", torch.float32)
    kv = torch.zeros(cfg.num_hidden_layers, *shape, dtype=element)
    tables = torch.tensor([[3, 7, 1, 0], [2, 9, 5, 8]])
    fused, python, fused_kv, shares = _fused_and_python_decode(model, kv, tables, [5, 3], [1, 9],
                                                               4, "auto")
    packed = model._fused_decode.weights.qkv[0]
    assert shares == ([0, 10] if packed.is_mkldnn else [0, 1, 10])
    assert torch.equal(fused, python)
    assert torch.equal(fused_kv, kv)


def _fused_and_python_decode(model, kv, tables, lens, rows, block_size, kv_dtype):
    """Prefill each prompt (the Python path), then one decode-only step of `rows[i]` rows of
    each request (positions lens[i], lens[i] + 1, ...) through the fused loop (on a copy of
    the cache) and the Python forward, on two threads; and the shares the fused loop cut the
    step into."""
    from conveyor.attention.metadata import AttentionMetadata, PrefillChunk

    with torch.inference_mode():
        for i, n in enumerate(lens):  # prefill each prompt (the Python path)
            pos = torch.arange(n)
            slots = tables[i][pos // block_size] * block_size + pos % block_size
            table = tables[i] if kv_dtype == "int8" else None  # int8: chunks read the cache
            meta = AttentionMetadata(slots, 0, None, None, [PrefillChunk(0, n, 0, table)])
            model(torch.randint(0, 300, (n,)), pos, kv, meta)
        which = torch.tensor([i for i, r in enumerate(rows) for _ in range(r)])
        pos = torch.tensor([n + j for n, r in zip(lens, rows, strict=True) for j in range(r)])
        slots = tables[which, pos // block_size] * block_size + pos % block_size
        meta = AttentionMetadata(slots, len(pos), tables[which], pos + 1, [])
        ids = torch.randint(0, 300, (len(pos),), generator=torch.Generator().manual_seed(5))
        assert model._fused_decode is not None  # model.step takes it for this batch
        fused_kv = kv.clone()
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            fused = model.step(ids, pos, fused_kv, meta)
            python = model(ids, pos, kv, meta)  # forward: the Python loop
            shares = torch.ops.conveyor.decode_shares(
                torch.zeros(len(pos), model.config.hidden_size), tables[which], pos + 1, kv,
                model.config.num_key_value_heads * model.config.head_dim,
                model._fused_decode.weights.qkv[0])
        finally:
            torch.set_num_threads(threads)
    return fused, python, fused_kv, shares


@pytest.mark.parametrize("dtype_name", ["auto", "float32"])
def test_forward_of_kept_rows_has_their_bits(kernels, dtype_name) -> None:
    """With ``keep`` (the runner passes a prefill step's sampling rows) the last layer's
    output projection and MLP run on those rows only: the same bits as the whole step's rows
    (the kernels are batch-invariant), and the same K/V written."""
    from conveyor.attention.metadata import AttentionMetadata, PrefillChunk
    from conveyor.config import ModelConfig
    from conveyor.model.device import resolve_dtype
    from conveyor.model.llama import build_model

    cfg = ModelConfig(architecture="llama", vocab_size=300, hidden_size=96,
                      intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=16)
    dtype = resolve_dtype(dtype_name, torch.device("cpu"))
    model = build_model(cfg, dtype, torch.device("cpu"), None, seed=1)
    element, shape = reference.kv_cache_shape(16, 4, 2, 16, "auto", dtype)
    kv = torch.zeros(cfg.num_hidden_layers, *shape, dtype=element)
    lens, tables = [9, 6], torch.tensor([[3, 7, 1], [2, 9, 0]])
    positions = torch.cat([torch.arange(n) for n in lens])
    slots = torch.cat([tables[i][torch.arange(n) // 4] * 4 + torch.arange(n) % 4
                       for i, n in enumerate(lens)])
    meta = AttentionMetadata(slots, 0, None, None, [PrefillChunk(0, 9, 0, None),
                                                    PrefillChunk(9, 6, 0, None)])
    ids = torch.randint(0, 300, (15,), generator=torch.Generator().manual_seed(4))
    keep = torch.tensor([8, 14])  # each prompt's last row
    kept_kv = kv.clone()
    with torch.inference_mode():
        every = model.step(ids, positions, kv, meta)
        kept = model.step(ids, positions, kept_kv, meta, keep)
    assert kept.shape == (2, 96)
    assert torch.equal(kept, every[keep])
    assert torch.equal(kept_kv, kv)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_write_decode_attention_is_the_write_then_the_attention(kernels, kv_dtype) -> None:
    """The fused decode op (each int8 attention task writes its own new row first) leaves the
    same cache bytes and gives the same outputs as write_kv_ followed by decode_attention."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 80
    dtype, shape = reference.kv_cache_shape(num_blocks, block_size, kv_heads, head_dim,
                                            kv_dtype, torch.bfloat16)
    cache = torch.zeros(shape, dtype=dtype)
    everything = torch.arange(num_blocks * block_size)
    reference.write_kv_(torch.randn(len(everything), kv_heads, head_dim, generator=gen).to(
        torch.bfloat16), torch.randn(len(everything), kv_heads, head_dim, generator=gen).to(
        torch.bfloat16), cache, everything)
    lens = torch.tensor([1, 16, 17, 100, 203])
    width = int((lens.max() + block_size - 1) // block_size)
    # Each request owns its blocks, as in the engine (a block being written is nobody else's).
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    slots = tables[torch.arange(len(lens)), (lens - 1) // block_size] * block_size \
        + (lens - 1) % block_size  # each request's newest position
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=gen).to(
        torch.bfloat16)
    q = qkv[:, :heads * head_dim].view(len(lens), heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(len(lens), kv_heads,
                                                                    head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(len(lens), kv_heads, head_dim)
    separate = cache.clone()
    kernels.write_kv_(k, v, separate, slots)
    expected = kernels.decode_attention(q, separate, tables, lens, head_dim ** -0.5)
    actual = kernels.write_decode_attention_(k, v, cache, slots, q, tables, lens,
                                             head_dim ** -0.5)
    assert torch.equal(cache, separate)
    assert torch.equal(actual, expected)


def test_a_packed_matmul_gives_a_row_the_same_bits_in_any_batch(kernels) -> None:
    """``PackedLinear`` (the engine's CPU matmul) at every batch size, in the engine's default
    dtype on this CPU: a row's result is the one it gets alone. With AMX the weights are
    oneDNN's, whose algorithm changes with the row count (it did for this shape at 150-256
    rows on a 2-core Xeon): ``ops.linear`` keeps oneDNN's one call only for the row counts
    where it gives each row the bits of smaller calls."""
    from conveyor.model.device import resolve_dtype
    from conveyor.model.layers import PackedLinear

    dtype = resolve_dtype("auto", torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    linear = PackedLinear((torch.randn(576, 1536, generator=gen) * 0.05).to(dtype), None)
    x = torch.randn(1100, 1536, generator=gen).to(dtype)
    alone = torch.cat([linear(x[i:i + 1]) for i in range(len(x))])
    for _ in range(2):  # a row count's first call checks oneDNN's, the next ones rely on it
        for rows in [*range(1, 300, 7), 512, 640, 1100]:
            assert torch.equal(linear(x[:rows]), alone[:rows]), rows

"""Paged attention over a ragged batch (CPU, and any device torch runs on).

The cache of one layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, or with
``kv_cache_dtype="int8"`` quantized rows with their scales, or (bf16 with AMX or AVX512-BF16) the
tile layout (``conveyor.ops.reference``). New K/V are written into their slots (``block_id *
block_size + offset``) for the whole batch first; then decodes attend together in one
``ops.decode_attention`` call, which on CPU is a C++ kernel reading the blocks where they lie (see
conveyor/ops), and prefill chunks attend one by one: causal inside the chunk, full over the cached
prefix (gathered block by block), with ``ops.prefill_attention`` (C++, AMX tiles or AVX512-BF16) in
bf16, else torch's SDPA; a chunk's generated tokens recomputed after a preemption attend as decodes,
and in float32 with the C++ kernels every row of a chunk does (a query's result then never depends
on its chunk). Over a tile-layout cache the prefill kernel reads the chunk's and its prefix's keys
where the cache holds them (``ops.prefill_attention_tiles``). A decode-only batch takes one
``ops.write_decode_attention_`` call (the write and the attention, fused for an int8 cache). ``ops``
is the model's ``OpsBackend``; its flags choose the paths (``prefill_attention_kernel``,
``prefill_rows_as_decodes``), and a backend with a ``step_attention`` kernel (CUDA) runs the whole
step through it instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.attention.metadata import AttentionMetadata, PrefillChunk
from conveyor.config import INT8_KV_SCALE_BYTES
from conveyor.ops import OpsBackend
from conveyor.ops.reference import gather_kv, is_tiles


def paged_attention(ops: OpsBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, blocks, block_size, KVH, D] -> [T, H, D]."""
    if ops.step_attention is not None and kv_cache.dtype != torch.int8:
        # one kernel for the whole step (CUDA: FlashInfer or Triton); the int8 cache's
        # layout is the CPU kernel's, which only the ops below read
        return ops.step_attention(q, k, v, kv_cache, meta, scale)
    nd = meta.num_decodes
    if not meta.prefills:  # decodes only: the K/V write and the attention in one op
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        return ops.write_decode_attention_(k, v, kv_cache, meta.slot_mapping, q,
                                           meta.decode_block_tables, meta.decode_context_lens,
                                           scale)
    ops.write_kv_(k, v, kv_cache, meta.slot_mapping)
    if kv_cache.dtype == torch.int8:  # prefills attend to the K/V as the cache holds them
        ops.read_kv_(k[nd:], v[nd:], kv_cache, meta.slot_mapping[nd:])
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode(ops, q[:nd], kv_cache, meta, scale)
    kernel = _kernel_prefill(ops, q)
    # (a head_dim the kernel does not take: SDPA would make a row's result depend on its
    # chunk where the kernel would not, so the rows attend as decodes instead)
    rows_as_decodes = ops.prefill_rows_as_decodes or (ops.prefill_attention_kernel
                                                      and not kernel)
    for chunk in meta.prefills:
        prompt = 0 if rows_as_decodes else chunk.query_len - chunk.generated_rows
        rows = slice(chunk.query_start, chunk.query_start + prompt)
        if prompt:
            out[rows] = _prefill(ops, q[rows], k[rows], v[rows], kv_cache, meta, chunk,
                                 scale, kernel)
        if prompt < chunk.query_len:
            gen = slice(rows.stop, chunk.query_start + chunk.query_len)
            out[gen] = _as_decodes(ops, q[gen], kv_cache, meta, chunk, prompt, scale)
    return out


def _kernel_prefill(ops: OpsBackend, q: torch.Tensor) -> bool:
    """Whether prefill chunks take ``ops.prefill_attention`` (the backend has the kernel in
    this dtype: C++ in bf16 with AMX tiles or AVX512-BF16, head_dim a multiple of 32 up to
    256) rather than SDPA."""
    return ops.prefill_attention_kernel and q.shape[-1] % 32 == 0 and q.shape[-1] <= 256


def _as_decodes(ops: OpsBackend, q: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, chunk: PrefillChunk, first: int, scale: float
                ) -> torch.Tensor:
    """A prefill chunk's rows from ``first`` (generated tokens recomputed after a preemption,
    or every row where the backend's ``prefill_rows_as_decodes``: float32 with the C++
    kernels, or bf16 at a head_dim its prefill kernel does not take, where no prefill
    attention kernel runs and SDPA's blocking makes a query's result depend on its chunk;
    its cost against SDPA: see docs/benchmarks.md), each attending as a decode: the decode
    kernel over its context in the cache."""
    n = q.shape[0]
    tables = _block_table(chunk, meta, kv_cache, q.shape[-1]).unsqueeze(0).expand(n, -1)
    tables = tables.contiguous()
    start = chunk.num_computed_tokens + first + 1
    lens = torch.arange(start, start + n, dtype=torch.int64, device=q.device)
    return ops.decode_attention(q, kv_cache, tables, lens, scale)


def _block_table(chunk: PrefillChunk, meta: AttentionMetadata, kv_cache: torch.Tensor,
                 head_dim: int) -> torch.Tensor:
    """The chunk's block table. A chunk given none has no prefix: its tokens are positions 0,
    1, ..., so every block_size-th of its slots (just written) names its next block."""
    if chunk.block_table is not None:
        return chunk.block_table
    if kv_cache.dtype == torch.int8:
        block_size = kv_cache.shape[3] // (head_dim + INT8_KV_SCALE_BYTES)
    else:
        block_size = kv_cache.shape[3] // head_dim if is_tiles(kv_cache) else kv_cache.shape[2]
    first = meta.slot_mapping[chunk.query_start:chunk.query_start + chunk.query_len:block_size]
    return first // block_size


def _decode(ops: OpsBackend, q: torch.Tensor, kv_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
    return ops.decode_attention(q, kv_cache, meta.decode_block_tables,
                                meta.decode_context_lens, scale)


def _prefill(ops: OpsBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             kv_cache: torch.Tensor, meta: AttentionMetadata, chunk: PrefillChunk,
             scale: float, kernel: bool) -> torch.Tensor:
    if kernel and is_tiles(kv_cache):  # the keys as the cache holds them (written above)
        table = _block_table(chunk, meta, kv_cache, q.shape[-1]).contiguous()
        return ops.prefill_attention_tiles(q, kv_cache, table, chunk.num_computed_tokens, scale)
    if kernel:
        if chunk.block_table is not None:  # the prefix's K/V (and the chunk's) from the cache
            kh, vh = gather_kv(kv_cache, chunk.block_table.unsqueeze(0), q.shape[-1], q.dtype)
            keys = chunk.num_computed_tokens + q.shape[0]
            k, v = kh[0, :, :keys].transpose(0, 1), vh[0, :, :keys].transpose(0, 1)
        return ops.prefill_attention(q, k, v, k.shape[0] - q.shape[0], scale)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
    if chunk.block_table is None:  # no prefix: attend to the fresh K/V
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        kh, vh = gather_kv(kv_cache, chunk.block_table.unsqueeze(0), q.shape[-1], q.dtype)
        # Query i sits at position num_computed + i and sees context positions <= that
        # (which also hides the unwritten tail of the last block).
        q_pos = torch.arange(q.shape[0], device=q.device) + chunk.num_computed_tokens
        k_pos = torch.arange(kh.shape[2], device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)  # [L, H, D]

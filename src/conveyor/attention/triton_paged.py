"""Paged attention in Triton: every query row of a step attends through the block table to
the K/V where they lie in the cache (no gather into a contiguous tensor).

One kernel serves decodes and prefill chunks alike, as vLLM's unified Triton attention does:
the step is a list of sequences, each with ``query_len`` query rows at the end of its
``seq_len`` keys (a decode is a sequence with one query row); row ``i`` sits at position
``seq_len - query_len + i`` and sees the keys at positions ``<=`` its own (causal inside the
chunk, full over the cached prefix). Grid: ``(sequence, KV head, query tile)``. A program takes
``BLOCK_Q`` query rows of one sequence times the ``G = num_heads / num_kv_heads`` query heads
sharing one KV head, as one ``[BLOCK_M = BLOCK_Q * G, head_dim]`` tile (GQA: each K/V tile is
loaded once for the G heads), and walks the keys it can see in tiles of ``TILE_N`` positions:
position ``n`` is slot ``block_table[n // block_size] * block_size + n % block_size``, read
from the cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` by its strides. Scores
and the online softmax (base 2) are float32; P is rounded to the cache's dtype before P V, as
in FlashAttention.

Under ``TRITON_INTERPRET=1`` (the CPU test in CI) the interpreter's ``tl.dot`` multiplies the
bit patterns of bfloat16 operands (triton-lang/triton#11584), so there bf16 tiles are widened
to float32 after they are loaded (P still rounded to bf16 first): the same kernel, exact
products instead of bf16 tensor-core products. ``kv_cache_dtype="int8"`` caches are not read
here (``cuda_paged_attention_backend`` says "torch" for them).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from conveyor.attention.metadata import AttentionMetadata
from conveyor.attention.paged_batch import PagedBatch, StepMemo, paged_batch
from conveyor.ops.reference import write_kv_

# Key positions per inner step: a multiple of 16 (tl.dot's smallest tile on a GPU), any block
# size (a tile may span several blocks, or part of one).
TILE_N = 32
# Query-tile rows (query rows x their GQA heads) for a step with prefill chunks; decode-only
# steps take the smallest tile that holds one row's G heads (at least 16).
PREFILL_BLOCK_M = 64
MIN_BLOCK_M = 16
# The head_dim tile's least width: tl.dot's smallest K on a GPU (Triton 3.6 refuses less);
# a smaller head_dim is padded and masked.
MIN_HEAD_DIM_P = 16
# The step's PagedBatch, built by its first layer.
_step_batch: StepMemo[PagedBatch] = StepMemo()


@triton.jit
def _paged_attention_kernel(
        out_ptr, q_ptr, cache_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr,
        scale_log2,
        stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_plane, stride_block, stride_slot, stride_kv_head, stride_table,
        NUM_QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        TILE: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    seq, kv_head, q_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # this sequence has fewer query tiles than the longest
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # keys before the first query row
    # Tile row m: query row q_tile * BLOCK_Q + m // G, query head kv_head * G + m % G.
    m = tl.arange(0, BLOCK_M)
    row = q_tile * BLOCK_Q + m // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + m % NUM_QUERIES_PER_KV
    row_ok = (m // NUM_QUERIES_PER_KV < BLOCK_Q) & (row < q_len)
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    token = (q_start + row).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head
                + d[None, :], mask=q_mask, other=0.0)
    q = q.to(DOT_DTYPE)
    q_pos = prefix + row  # [BLOCK_M]: the position of each row's token
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    # The keys the tile's last row can see (key 0 is seen by every row: m_i is finite after
    # the first step, and no row's sum is 0).
    num_keys = tl.minimum(seq_len, prefix + (q_tile + 1) * BLOCK_Q)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table
    cache_v = cache_ptr + stride_plane
    for start in range(0, num_keys, TILE):
        n = start + tl.arange(0, TILE)
        n_ok = n < num_keys
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = block * stride_block + (n % BLOCK_SIZE) * stride_slot + kv_head * stride_kv_head
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(cache_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        # s: [BLOCK_M, TILE] scores in units of log2
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=INPUT_PRECISION) * scale_log2
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_v + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        p = p.to(v.dtype).to(DOT_DTYPE)  # rounded as a bf16/fp16 kernel rounds it
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE),
                                            input_precision=INPUT_PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head
             + d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


def interpreted() -> bool:
    """Whether Triton runs kernels in its numpy interpreter: ``TRITON_INTERPRET=1`` when
    triton was imported (it decides then, for its library's functions too)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    if dtype == torch.float32 or (dtype == torch.bfloat16 and interpreted()):
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def kernel_constants(dtype: torch.dtype, group: int, head_dim: int, block_size: int,
                     max_query_len: int) -> dict[str, Any]:
    """The kernel's compile-time arguments for a launch: tile shapes and dot precision."""
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(group))
    if max_query_len > 1:
        block_m = max(block_m, PREFILL_BLOCK_M)
    dot_dtype = _dot_dtype(dtype)
    return dict(NUM_QUERIES_PER_KV=group, HEAD_DIM=head_dim,
                HEAD_DIM_P=max(MIN_HEAD_DIM_P, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
                BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE=TILE_N, DOT_DTYPE=dot_dtype,
                # float32 products exact (not TF32) on a GPU: float32 is the correctness setting
                INPUT_PRECISION="ieee" if dot_dtype == tl.float32 else None)


def attend(q: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch,
           scale: float) -> torch.Tensor:
    """q: [T, H, D] (rows in the batch's order); kv_cache: [2, blocks, block_size, KVH, D]
    -> [T, H, D]: each row's attention over the cached keys its position sees."""
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not q's {q.dtype}: the Triton "
                         "kernel reads caches of the model's dtype (kv_cache_dtype='auto')")
    _, _, block_size, kvh, d = kv_cache.shape
    t, h, q_dim = q.shape
    if q_dim != d:
        raise ValueError(f"q's head_dim {q_dim} is not the cache's {d}")
    if h % kvh:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {kvh}")
    out = torch.empty_like(q)
    if t == 0:
        return out
    const = kernel_constants(q.dtype, h // kvh, d, block_size, batch.max_query_len)
    grid = (batch.num_seqs, kvh, triton.cdiv(batch.max_query_len, const["BLOCK_Q"]))
    if q.stride(-1) != 1:
        q = q.contiguous()
    _paged_attention_kernel[grid](
        out, q, kv_cache, batch.block_tables, batch.query_start, batch.seq_lens,
        scale * 1.4426950408889634,  # log2(e): softmax in base 2
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        batch.block_tables.stride(0), **const)
    return out


def compile_for(capability: tuple[int, int], dtype: torch.dtype, group: int, head_dim: int,
                block_size: int, max_query_len: int) -> Any:
    """Compile the kernel for a CUDA compute capability, to a cubin, without a GPU (Triton
    ships ptxas): what a launch there would compile, checked where none runs. Needs triton
    imported without ``TRITON_INTERPRET``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreted():
        raise RuntimeError("TRITON_INTERPRET is set: the kernel is interpreted, not compiled")
    ptr = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    names = _paged_attention_kernel.arg_names
    const = kernel_constants(dtype, group, head_dim, block_size, max_query_len)
    signature = {n: "constexpr" if n in const else ptr if n.endswith("_ptr") else "i32"
                 for n in names}
    signature.update(block_tables_ptr="*i64", query_start_ptr="*i32", seq_lens_ptr="*i32",
                     scale_log2="fp32")
    return triton.compile(ASTSource(_paged_attention_kernel, signature, const),
                          target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32))


def triton_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float) -> torch.Tensor:
    """The Triton path of ``conveyor.attention.paged.paged_attention`` (same inputs and
    output, less ``ops``): q [T, H, D]; k, v [T, KVH, D] written into their slots first;
    kv_cache [2, blocks, block_size, KVH, D] -> [T, H, D]."""
    write_kv_(k, v, kv_cache, meta.slot_mapping)
    block_size = kv_cache.shape[2]
    batch = _step_batch.get(meta, block_size, lambda: paged_batch(meta, block_size))
    return attend(q, kv_cache, batch, scale)

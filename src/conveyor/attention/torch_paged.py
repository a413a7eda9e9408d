"""Reference paged attention in plain torch (CPU, and any device torch runs on).

The cache of one layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``. New K/V
are scattered into their slots (``block_id * block_size + offset``) for the whole batch
first, then each query attends to its request's context gathered block by block: decodes
together in one batched call, prefill chunks one by one (causal inside the chunk, full over
the cached prefix). Gathering whole blocks (not slots) copies 16-token rows, and SDPA on the
gathered ``[B, KVH, L, D]`` view (GQA without repeating K/V) is torch's fastest CPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.attention.metadata import AttentionMetadata, PrefillChunk


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, blocks, block_size, KVH, D] -> [T, H, D]."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    kvh, d = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)
    nd = meta.num_decodes
    if not meta.prefills:
        return _decode(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
    return out


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache: [blocks, bs, KVH, D]; block_tables: [B, n] -> [B, KVH, n * bs, D] (a view)."""
    b, n = block_tables.shape
    _, bs, kvh, d = cache.shape
    return cache.index_select(0, block_tables.view(-1)).view(b, n * bs, kvh, d).transpose(1, 2)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    assert meta.decode_block_tables is not None and meta.decode_mask is not None
    b, h, d = q.shape
    ks = _gather(k_cache, meta.decode_block_tables)
    vs = _gather(v_cache, meta.decode_block_tables)
    out = F.scaled_dot_product_attention(q.reshape(b, h, 1, d), ks, vs, attn_mask=meta.decode_mask,
                                         scale=scale, enable_gqa=True)
    return out.view(b, h, d)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
    if chunk.block_table is None:
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        kh = _gather(k_cache, chunk.block_table.unsqueeze(0))
        vh = _gather(v_cache, chunk.block_table.unsqueeze(0))
        # Query i sits at position num_computed + i and sees context positions <= that
        # (which also hides the unwritten tail of the last block).
        q_pos = torch.arange(chunk.query_len, device=q.device) + chunk.num_computed_tokens
        k_pos = torch.arange(kh.shape[2], device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)  # [L, H, D]

"""Reference paged attention in plain torch (CPU, and any device torch runs on).

The cache of one layer is ``[2, num_slots, num_kv_heads, head_dim]`` (a slot is
``block_id * block_size + offset``). New K/V are scattered into their slots, then each query
attends to its request's context gathered by slot: decodes together in one batched call,
prefill chunks one by one (causal inside the chunk, full over the cached prefix).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.attention.metadata import AttentionMetadata, PrefillChunk


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, slots, KVH, D] -> [T, H, D]."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    assert meta.decode_context_slots is not None and meta.decode_mask is not None
    b, n_ctx = meta.decode_context_slots.shape
    kvh, d = k_cache.shape[1], k_cache.shape[2]
    slots = meta.decode_context_slots.view(-1)
    # ks, vs: [B, KVH, n_ctx, D]
    ks = k_cache.index_select(0, slots).view(b, n_ctx, kvh, d).transpose(1, 2)
    vs = v_cache.index_select(0, slots).view(b, n_ctx, kvh, d).transpose(1, 2)
    # qg: [B, KVH, group, D]: the query heads sharing each KV head, as one matmul
    qg = q.view(b, kvh, -1, d)
    scores = torch.matmul(qg, ks.transpose(-1, -2)).float() * scale  # [B, KVH, group, n_ctx]
    scores.masked_fill_(~meta.decode_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(vs.dtype)
    return torch.matmul(probs, vs).view(b, -1, d)  # [B, H, D]


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    # q: [L, H, D] -> [1, H, L, D]
    qh = q.transpose(0, 1).unsqueeze(0)
    if chunk.context_slots is None:
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        kh = k_cache.index_select(0, chunk.context_slots).transpose(0, 1).unsqueeze(0)
        vh = v_cache.index_select(0, chunk.context_slots).transpose(0, 1).unsqueeze(0)
        # Query i sits at position num_computed + i and sees context positions <= that.
        q_pos = torch.arange(chunk.query_len, device=q.device) + chunk.num_computed_tokens
        k_pos = torch.arange(kh.shape[2], device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)  # [L, H, D]

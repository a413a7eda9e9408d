"""The hot-path ops in plain torch: the reference the C++ kernels must match, and the
implementation wherever the kernels are not built (another device, no compiler).

Each function has the signature and in-place behaviour of its kernel in csrc/cpu_ops.cpp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w * (x * rsqrt(mean(x^2) + eps)): normalised in float32, scaled in x's dtype (HF)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                  eps: float) -> None:
    """In place: residual += x, then x = rms_norm(residual)."""
    residual.add_(x)
    x.copy_(rms_norm(residual, w, eps))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
            num_heads: int, head_dim: int) -> None:
    """Rotate the first num_heads heads of each row of x [T, >= num_heads * D] in place
    ("rotate half" layout); cos_sin: float32 [max_positions, D] = cos | sin halves."""
    cos, sin = cos_sin.index_select(0, positions).unsqueeze(1).chunk(2, -1)
    cos, sin = torch.cat([cos, cos], -1).to(x.dtype), torch.cat([-sin, sin], -1).to(x.dtype)
    heads = x[:, :num_heads * head_dim].view(x.shape[0], num_heads, head_dim)
    # roll(h) = [h2, h1]: [h1 cos - h2 sin, h2 cos + h1 sin] with the sign folded into sin.
    heads.copy_(heads * cos + heads.roll(head_dim // 2, -1) * sin)


def write_kv_(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """k, v: [T, KVH, D] into kv_cache [2, blocks, bs, KVH, D] at flat slots [T]."""
    kvh, d = kv_cache.shape[-2:]
    kv_cache[0].view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache: [blocks, bs, KVH, D]; block_tables: [B, n] -> [B, KVH, n * bs, D] (a view).
    Gathering whole blocks (not slots) copies 16-token rows."""
    b, n = block_tables.shape
    _, bs, kvh, d = cache.shape
    return cache.index_select(0, block_tables.view(-1)).view(b, n * bs, kvh, d).transpose(1, 2)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, D], one query per request, attends to the first context_lens[b] cached
    positions of its blocks (block_tables [B, max_blocks], padding is ignored) -> [B, H, D]."""
    b, h, d = q.shape
    ks = gather_blocks(kv_cache[0], block_tables)
    vs = gather_blocks(kv_cache[1], block_tables)
    mask = torch.arange(ks.shape[2], device=q.device)[None, :] < context_lens[:, None]
    out = F.scaled_dot_product_attention(q.reshape(b, h, 1, d), ks, vs,
                                         attn_mask=mask.view(b, 1, 1, -1), scale=scale,
                                         enable_gqa=True)
    return out.view(b, h, d)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] in any float dtype -> int64 [rows]: the first index of each row's max."""
    return logits.argmax(dim=-1)

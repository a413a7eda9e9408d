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


# An int8 KV cache (kv_cache_dtype="int8") stores each (token, KV head) row as D int8 values
# followed by the row's float32 scale in 4 bytes: x ~= scale * q, scale = max|x| / 127.
INT8_SCALE_BYTES = 4


def kv_cache_row(head_dim: int, kv_cache_dtype: str, model_dtype: torch.dtype
                 ) -> tuple[torch.dtype, int]:
    """(element dtype, row width) of a cached (token, KV head) row."""
    if kv_cache_dtype == "int8":
        return torch.int8, head_dim + INT8_SCALE_BYTES
    return model_dtype, head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> int8 [..., D + 4]: round(x * (127 / max|x|)) (nearest even), then the
    float32 scale max|x| / 127 as 4 bytes. A row of zeros has scale 0."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # (a full tensor divided, not 127 / amax, which torch computes as reciprocal(amax) * 127)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = (xf * inv).round().clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, (amax / 127).view(torch.int8)], -1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., D + 4] -> [..., D] in dtype: scale * q, computed in float32."""
    d = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)


def write_kv_(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """k, v: [T, KVH, D] into kv_cache [2, blocks, bs, KVH, W] at flat slots [T] (an int8
    cache quantizes each row, W = D + 4)."""
    kvh, w = kv_cache.shape[-2:]
    if kv_cache.dtype == torch.int8:
        k, v = quantize_rows(k), quantize_rows(v)
    kv_cache[0].view(-1, kvh, w).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, kvh, w).index_copy_(0, slot_mapping, v)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """cache: [blocks, bs, KVH, W]; block_tables: [B, n] -> [B, KVH, n * bs, D] (a view).
    Gathering whole blocks (not slots) copies 16-token rows; an int8 cache's rows are
    dequantized to ``dtype``."""
    b, n = block_tables.shape
    _, bs, kvh, w = cache.shape
    rows = cache.index_select(0, block_tables.view(-1)).view(b, n * bs, kvh, w)
    if cache.dtype == torch.int8:
        assert dtype is not None, "an int8 cache is dequantized to the model's dtype"
        rows = dequantize_rows(rows, dtype)
    return rows.transpose(1, 2)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, D], one query per request, attends to the first context_lens[b] cached
    positions of its blocks (block_tables [B, max_blocks], padding is ignored) -> [B, H, D]."""
    b, h, d = q.shape
    ks = gather_blocks(kv_cache[0], block_tables, q.dtype)
    vs = gather_blocks(kv_cache[1], block_tables, q.dtype)
    mask = torch.arange(ks.shape[2], device=q.device)[None, :] < context_lens[:, None]
    out = F.scaled_dot_product_attention(q.reshape(b, h, 1, d), ks, vs,
                                         attn_mask=mask.view(b, 1, 1, -1), scale=scale,
                                         enable_gqa=True)
    return out.view(b, h, d)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] in any float dtype -> int64 [rows]: the first index of each row's max."""
    return logits.argmax(dim=-1)

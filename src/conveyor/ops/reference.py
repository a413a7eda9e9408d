"""The hot-path ops in plain torch: the reference the C++ kernels must match, and the
implementation wherever the kernels are not built (another device, no compiler).

Each function has the signature and in-place behaviour of its kernel in csrc/cpu_ops.cpp.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from conveyor.config import INT8_KV_SCALE_BYTES


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


# An int8 KV cache (kv_cache_dtype="int8") is [2, blocks, KVH, bs * (D + 4)] int8: each
# (plane, block, KV head) owns a head-block with the bs positions' D values, then their bs
# float32 scales (4 bytes each). A row x is stored as q = round(x * (127 / max|x|)), rounded to
# nearest even, with scale max|x| / 127 (x ~= scale * q). The values are laid out for the C++
# kernel (csrc/cpu_ops.cpp): K as [D / 4, bs, 4] (16 positions' 4 consecutive dims in one
# 64-byte vector), V as [bs / 4, D, 4] (16 dims' 4 consecutive positions in one vector);
# block_size must be a multiple of 16.


# A tile-layout cache (bf16 where the CPU has AMX or AVX512-BF16: ``OpsBackend.kv_cache_tiles``) is
# [2, blocks, KVH, bs * D] in the model's dtype: each (plane, block, KV head) owns a head-block laid
# out as the AMX products (and vdpbf16ps) read it, so that no step repacks the cache
# (csrc/cpu_ops.cpp): K, per 16 positions, as K^T in pairs of dims: [bs / 16, D / 32, 16 dim pairs,
# 16 positions, 2]; V in pairs of positions: [bs / 2, D, 2]. block_size must be a multiple of 16 and
# D of 32.


def is_tiles(kv_cache: torch.Tensor) -> bool:
    """Whether one layer's cache has the tile layout (above)."""
    return kv_cache.dim() == 4 and kv_cache.dtype != torch.int8


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   kv_cache_dtype: str, model_dtype: torch.dtype, tiles: bool = False
                   ) -> tuple[torch.dtype, tuple[int, ...]]:
    """(dtype, shape) of one layer's cache, K and V planes first (``tiles``: the tile
    layout, for a cache in the model's dtype)."""
    if kv_cache_dtype == "int8":
        return torch.int8, (2, num_blocks, num_kv_heads,
                            block_size * (head_dim + INT8_KV_SCALE_BYTES))
    if tiles:
        return model_dtype, (2, num_blocks, num_kv_heads, block_size * head_dim)
    return model_dtype, (2, num_blocks, block_size, num_kv_heads, head_dim)


def _tiles_views(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a tile-layout cache [2, blocks, KVH, bs * D]: K [blocks, bs / 16, 16, KVH,
    D / 32, 16, 2] and V [blocks, bs / 2, 2, KVH, D] (block, then position, then KV head)."""
    bs = kv_cache.shape[-1] // head_dim
    k = kv_cache[0].unflatten(-1, (bs // 16, head_dim // 32, 16, 16, 2)).permute(
        0, 2, 5, 1, 3, 4, 6)
    v = kv_cache[1].unflatten(-1, (bs // 2, head_dim, 2)).permute(0, 2, 4, 1, 3)
    return k, v


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (int8 [..., D], float32 scales [...]): round(x * (127 / max|x|)) (nearest
    even) and max|x| / 127 per row. A row of zeros has scale 0."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # (a full tensor divided, not 127 / amax, which torch computes as reciprocal(amax) * 127)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = (xf * inv).round().clamp_(-127, 127).to(torch.int8)
    return q, (amax / 127).squeeze(-1)


def _int8_views(kv_cache: torch.Tensor, head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of an int8 cache [2, blocks, KVH, bs * (D + 4)]: K values [blocks, bs, KVH,
    D / 4, 4] and V values [blocks, bs / 4, 4, KVH, D] (indexed by block, then position),
    and the K and V scales [blocks, bs, KVH]."""
    _, num_blocks, kvh, width = kv_cache.shape
    bs = width // (head_dim + INT8_KV_SCALE_BYTES)
    values = kv_cache[..., :bs * head_dim]
    k = values[0].unflatten(-1, (head_dim // 4, bs, 4)).permute(0, 3, 1, 2, 4)
    v = values[1].unflatten(-1, (bs // 4, head_dim, 4)).permute(0, 2, 4, 1, 3)
    scales = kv_cache[..., bs * head_dim:].view(torch.float32)  # [2, blocks, KVH, bs]
    return k, v, scales[0].transpose(1, 2), scales[1].transpose(1, 2)


def _tiles_at(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, head_dim: int
              ) -> tuple[tuple[torch.Tensor, tuple[torch.Tensor, ...]],
                         tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """_tiles_views of a tile-layout cache, each with the index of the slots' positions in it
    (K: block, 16-position group, position in it; V: block, position pair, which of the two)."""
    k_tiles, v_tiles = _tiles_views(kv_cache, head_dim)
    bs = kv_cache.shape[-1] // head_dim
    block, offset = slot_mapping // bs, slot_mapping % bs
    return ((k_tiles, (block, offset // 16, offset % 16)),
            (v_tiles, (block, offset // 2, offset % 2)))


def tiles_as_rows(kv_caches: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A copy of tile-layout caches [..., 2, blocks, KVH, bs * D] (any leading dims, e.g.
    layers) in the row layout [..., 2, blocks, bs, KVH, D]."""
    *lead, _, blocks, kvh, width = kv_caches.shape
    bs = width // head_dim
    flat = kv_caches.reshape(math.prod(lead), 2, blocks, kvh, width)
    rows = torch.empty(flat.shape[0], 2, blocks, bs, kvh, head_dim, dtype=kv_caches.dtype,
                       device=kv_caches.device)
    for i in range(flat.shape[0]):
        k, v = _tiles_views(flat[i], head_dim)
        rows[i, 0] = k.reshape(blocks, bs, kvh, head_dim)
        rows[i, 1] = v.reshape(blocks, bs, kvh, head_dim)
    return rows.view(*lead, 2, blocks, bs, kvh, head_dim)


def write_kv_(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """k, v: [T, KVH, D] into the cache at flat slots [T] (block * bs + offset): rows of
    [2, blocks, bs, KVH, D], quantized rows of an int8 cache, or a tile-layout cache's."""
    t, kvh, d = k.shape
    if is_tiles(kv_cache):
        (k_tiles, k_index), (v_tiles, v_index) = _tiles_at(kv_cache, slot_mapping, d)
        k_tiles[k_index] = k.view(t, kvh, d // 32, 16, 2)
        v_tiles[v_index] = v
        return
    if kv_cache.dtype != torch.int8:
        kv_cache[0].view(-1, kvh, d).index_copy_(0, slot_mapping, k)
        kv_cache[1].view(-1, kvh, d).index_copy_(0, slot_mapping, v)
        return
    k_values, v_values, k_scales, v_scales = _int8_views(kv_cache, d)
    bs = k_values.shape[1]
    block, offset = slot_mapping // bs, slot_mapping % bs
    kq, k_scale = quantize_rows(k)
    vq, v_scale = quantize_rows(v)
    k_values[block, offset] = kq.view(t, kvh, d // 4, 4)
    v_values[block, offset // 4, offset % 4] = vq
    k_scales[block, offset] = k_scale
    v_scales[block, offset] = v_scale


def read_kv_(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """In place: k, v [T, KVH, D] = the rows at these slots as an int8 cache holds them
    (scale * q in float32, rounded to k's dtype), or a tile-layout cache."""
    if is_tiles(kv_cache):
        (k_tiles, k_index), (v_tiles, v_index) = _tiles_at(kv_cache, slot_mapping, k.shape[-1])
        k.copy_(k_tiles[k_index].reshape(k.shape))
        v.copy_(v_tiles[v_index])
        return
    k_values, v_values, k_scales, v_scales = _int8_views(kv_cache, k.shape[-1])
    bs = k_values.shape[1]
    block, offset = slot_mapping // bs, slot_mapping % bs
    k.copy_(k_values[block, offset].flatten(-2).float() * k_scales[block, offset, :, None])
    v.copy_(v_values[block, offset // 4, offset % 4].float() * v_scales[block, offset, :, None])


def gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor, head_dim: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V of whole blocks: block_tables [B, n] -> two [B, KVH, n * bs, D] in dtype
    (an int8 cache's rows dequantized, scale * q in float32). Gathering whole blocks (not
    slots) copies 16-token rows."""
    b, n = block_tables.shape
    ids = block_tables.reshape(-1)
    if is_tiles(kv_cache):
        k_tiles, v_tiles = _tiles_views(kv_cache, head_dim)
        kvh = k_tiles.shape[3]
        k, v = (x[ids].reshape(b, -1, kvh, head_dim).transpose(1, 2) for x in (k_tiles, v_tiles))
        return k, v
    if kv_cache.dtype != torch.int8:
        _, _, bs, kvh, d = kv_cache.shape
        k, v = (kv_cache[i].index_select(0, ids).view(b, n * bs, kvh, d).transpose(1, 2)
                for i in (0, 1))
        return k, v
    k_values, v_values, k_scales, v_scales = _int8_views(kv_cache, head_dim)
    bs, kvh = k_values.shape[1:3]
    k = k_values[ids].reshape(b * n, bs, kvh, head_dim).float() * k_scales[ids, ..., None]
    v = v_values[ids].reshape(b * n, bs, kvh, head_dim).float() * v_scales[ids, ..., None]
    k, v = (x.to(dtype).reshape(b, n * bs, kvh, head_dim).transpose(1, 2) for x in (k, v))
    return k, v


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, D], one query per request, attends to the first context_lens[b] cached
    positions of its blocks (block_tables [B, max_blocks], padding is ignored) -> [B, H, D]."""
    b, h, d = q.shape
    ks, vs = gather_kv(kv_cache, block_tables, d, q.dtype)
    mask = torch.arange(ks.shape[2], device=q.device)[None, :] < context_lens[:, None]
    out = F.scaled_dot_product_attention(q.reshape(b, h, 1, d), ks, vs,
                                         attn_mask=mask.view(b, 1, 1, -1), scale=scale,
                                         enable_gqa=True)
    return out.view(b, h, d)


def write_decode_attention_(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, q: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """A decode-only batch: write_kv_, then decode_attention (the C++ kernel fuses them for
    an int8 cache)."""
    write_kv_(k, v, kv_cache, slot_mapping)
    return decode_attention(q, kv_cache, block_tables, context_lens, scale)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] in any float dtype -> int64 [rows]: the first index of each row's max."""
    return logits.argmax(dim=-1)

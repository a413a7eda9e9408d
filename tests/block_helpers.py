"""GGUF blocks of random weights and what the loader makes of them, for the matmul kernels'
tests (test_amx.py, test_dot_kernels.py), the comparison of a block-matmul model's first tokens
with its dense weights', and the masked-SDPA oracle of prefill attention."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from conveyor.model.gguf_loader import BLOCK_BYTES

TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """GGUF blocks of random weights: uint8 [rows, cols / 32, block bytes]."""
    rng = np.random.default_rng(seed)
    nbytes = BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (rows, cols // 32, nbytes), dtype=np.uint8)
    # Scales of realistic size (random bytes would make NaN and inf fp16 scales).
    raw[..., 0:2] = rng.uniform(1e-3, 2e-2, (rows, cols // 32)).astype(np.float16)[..., None].view(np.uint8)
    if qtype == GGMLQuantizationType.Q4_1:  # m, the block's minimum
        raw[..., 2:4] = rng.uniform(-0.2, 0.0, (rows, cols // 32)).astype(np.float16)[..., None].view(np.uint8)
    return raw


def random_q4k_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Q4_K blocks of random weights (256 per block: d and dmin fp16, 12 bytes of 6-bit scales
    and mins, 128 of nibbles): uint8 [rows, cols / 256, 144]."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    for at in (0, 2):  # d and dmin, of realistic size
        raw[..., at:at + 2] = rng.uniform(1e-3, 2e-2, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw


def random_q6k_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Q6_K blocks of random weights (256 per block: 128 bytes of low nibbles, 64 of high bits,
    16 int8 scales, d fp16): uint8 [rows, cols / 256, 210]."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
    raw[..., 208:210] = rng.uniform(1e-4, 2e-3, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw


def assert_first_tokens_close(blocks: list[Any], weights: list[Any], tolerance: float) -> None:
    """Each prompt's first-token top logprobs (CompletionOutputs with ``logprobs``) with block
    matmuls against the dense weights': at least 3 of the top tokens shared, each within
    ``tolerance`` nats."""
    for mine, theirs in zip(blocks, weights, strict=True):
        want = {t: lp.logprob for t, lp in (theirs.logprobs or [{}])[0].items()}
        got = {t: lp.logprob for t, lp in (mine.logprobs or [{}])[0].items()}
        shared = want.keys() & got.keys()
        assert len(shared) >= 3
        assert max(abs(want[t] - got[t]) for t in shared) < tolerance


def bf16_weight(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """What the loader makes of the blocks: gguf-py's float32 values, rounded to bf16."""
    rows = raw.shape[0]
    values = dequantize(raw.reshape(rows, -1), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16)


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float,
                dtype: torch.dtype) -> torch.Tensor:
    """SDPA in `dtype` with the prefill mask: query i sees keys <= offset + i."""
    pos_q = torch.arange(q.shape[0]) + offset
    mask = torch.arange(k.shape[0])[None, :] <= pos_q[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).to(dtype), k.transpose(0, 1).unsqueeze(0).to(dtype),
        v.transpose(0, 1).unsqueeze(0).to(dtype), attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1).float()

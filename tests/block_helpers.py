"""GGUF blocks of random weights and what the loader makes of them, for the matmul kernels'
tests (test_amx.py, test_dot_kernels.py, test_f32_kernels.py), a written Q4_K_M-style GGUF, the
comparison of a block-matmul model's first tokens with its dense weights', and the masked-SDPA
oracle of prefill attention."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from conveyor.model.gguf_loader import BLOCK_BYTES
from conveyor.model.layers import Q4_K, Q6_K

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


def k_quant_parts(kind: str) -> list[tuple[GGMLQuantizationType, np.ndarray]]:
    """Random K-quant weights of 512 inputs as (type, blocks) parts: "Q4_K" (48 rows), "Q6_K"
    (32 rows), or "both": a weight fused from the two as a Q4_K_M file's q, k and v can be
    (Q4_K, Q6_K, then the Q4_K part's first 16 rows again)."""
    q4k, q6k = random_q4k_blocks(48, 512, seed=1), random_q6k_blocks(32, 512, seed=2)
    return {"Q4_K": [(GGMLQuantizationType.Q4_K, q4k)],
            "Q6_K": [(GGMLQuantizationType.Q6_K, q6k)],
            "both": [(GGMLQuantizationType.Q4_K, q4k), (GGMLQuantizationType.Q6_K, q6k),
                     (GGMLQuantizationType.Q4_K, q4k[:16])]}[kind]


def dequantized_parts(parts: list[tuple[GGMLQuantizationType, np.ndarray]]) -> torch.Tensor:
    """gguf-py's float32 weights of k_quant_parts' parts, concatenated."""
    return torch.cat([torch.from_numpy(dequantize(raw.reshape(len(raw), -1), qtype).copy())
                      for qtype, raw in parts])


def write_k_quant_gguf(path: str) -> None:
    """A 2-layer llama GGUF laid out as llama.cpp's Q4_K_M files are: Q4_K matrices, Q6_K for
    attn_v, ffn_down and the LM head (random blocks, weights up to a few tenths),
    float16 embeddings, float32 norms; 256 and 512 features (K-quants hold 256 a block)."""
    import gguf

    hidden, ffn, rng = 256, 512, np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in ((writer.add_block_count, 2), (writer.add_context_length, 512),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, ffn),
                       (writer.add_head_count, 4), (writer.add_head_count_kv, 2),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_freq_base, 5e5),
                       (writer.add_bos_token_id, 1), (writer.add_eos_token_id, 2)):
        add(value)

    def blocks(qtype: int, rows: int, cols: int) -> np.ndarray:
        if qtype == Q4_K:
            raw = random_q4k_blocks(rows, cols, seed=int(rng.integers(1 << 30)))
            at, scale = (0, 2), 2e-4  # d and dmin
        else:
            raw = random_q6k_blocks(rows, cols, seed=int(rng.integers(1 << 30)))
            at, scale = (208,), 1e-4  # d
        for a in at:
            raw[..., a:a + 2] = (rng.uniform(0.5, 1.0, raw.shape[:2]) * scale).astype(
                np.float16)[..., None].view(np.uint8)
        return raw.reshape(rows, -1)

    writer.add_tensor("token_embd.weight", rng.normal(0, 1, (49152, hidden)).astype(np.float16))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output.weight", blocks(Q6_K, 49152, hidden),
                      raw_dtype=GGMLQuantizationType.Q6_K)
    shapes = {"attn_q": (Q4_K, hidden, hidden), "attn_k": (Q4_K, 128, hidden),
              "attn_v": (Q6_K, 128, hidden), "attn_output": (Q4_K, hidden, hidden),
              "ffn_gate": (Q4_K, ffn, hidden), "ffn_up": (Q4_K, ffn, hidden),
              "ffn_down": (Q6_K, hidden, ffn)}
    for i in range(2):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
        for name, (qtype, rows, cols) in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", blocks(qtype, rows, cols),
                              raw_dtype=GGMLQuantizationType(qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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

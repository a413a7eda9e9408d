"""The CPU fused decode loop: a decode-only step's decoder layers in one C++ call.

A fast path beside the model (``CausalLM.forward`` stays the math): ``CpuFusedDecode.of``
gathers, once, the weights ``cpu_kernels.decode_layers`` reads, where the backend has the loop
(``OpsBackend.fused_decode``) and it can run this model: oneDNN-packed or dot-tiled matmuls
(``CausalLM.pack_linears``) without padded rows, no q/k norm, one rank (the loop has no
all-reduce between layers). It runs the same ops in the same order as the Python loop, so its
outputs and KV writes are bit-identical to ``forward``'s (tests/test_ops.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conveyor.attention.metadata import AttentionMetadata
from conveyor.model.layers import PackedLinear
from conveyor.ops import CpuKernelBackend
from conveyor.ops.cpu_kernels import DecodeLayersWeights, DecodeShape

if TYPE_CHECKING:
    from conveyor.model.llama import CausalLM


class CpuFusedDecode:
    """``model``'s decode-only steps through ``decode_layers`` (from the embeddings to the
    final norm)."""

    def __init__(self, model: CausalLM, backend: CpuKernelBackend,
                 weights: DecodeLayersWeights) -> None:
        self.model = model
        self.backend = backend
        self.weights = weights
        cfg = model.config
        self.shape = DecodeShape(cfg.rms_norm_eps, cfg.num_attention_heads,
                                 cfg.num_key_value_heads, cfg.head_dim)

    @classmethod
    def of(cls, model: CausalLM) -> CpuFusedDecode | None:
        """The fused loop for ``model`` with its backend, or None where it cannot run it."""
        backend = model.backend
        if not backend.fused_decode or model.config.qk_norm or model.tp.size > 1:
            return None
        # Only the C++ kernels have the loop (the flag says so; this narrows the type).
        assert isinstance(backend, CpuKernelBackend)
        weights = _decode_weights(model)
        return None if weights is None else cls(model, backend, weights)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A decode-only batch (no prefill chunk): input_ids, positions [B] -> [B, hidden]."""
        assert not meta.prefills
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        model = self.model
        x = model.tp.embed(model.embed_tokens, input_ids)
        cos_sin = model.rotary.cos_sin
        assert isinstance(cos_sin, torch.Tensor)
        return self.backend.decode_layers(x, positions, cos_sin, kv_caches, meta.slot_mapping,
                                          meta.decode_block_tables, meta.decode_context_lens,
                                          self.weights, self.shape)


def _decode_weights(model: CausalLM) -> DecodeLayersWeights | None:
    """Every layer's weights in ``decode_layers``' order; None if a matmul is not packed as
    the loop takes it (its weight's packed rows as they are: no padding)."""
    names = ("qkv", "o", "gate_up", "down")
    dense: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    blocks: dict[str, list[torch.Tensor | None]] = {name: [] for name in names}
    input_norms: list[torch.Tensor] = []
    post_norms: list[torch.Tensor] = []
    qkv_bias: list[torch.Tensor | None] = []
    for layer in model.decoder_layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        for name, linear in zip(names, linears, strict=True):
            if not isinstance(linear, PackedLinear) or linear.padding:
                return None
            dense[name].append(linear.packed)
            blocks[name].append(linear.blocks)
        input_norms.append(layer.input_layernorm.weight)
        post_norms.append(layer.post_attention_layernorm.weight)
        qkv_bias.append(attn.qkv_proj.bias)
    return DecodeLayersWeights(
        input_norms, post_norms, dense["qkv"], qkv_bias, dense["o"], dense["gate_up"],
        dense["down"], blocks["qkv"], blocks["o"], blocks["gate_up"], blocks["down"],
        model.norm.weight)

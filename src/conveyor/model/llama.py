"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k norm).

Runs one flattened batch of tokens (no batch dimension, no padding): ``[T, hidden]``.
Q/K/V and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.attention.metadata import AttentionMetadata
from conveyor.attention.paged import paged_attention
from conveyor.config import EngineArgs, ModelConfig
from conveyor.model.cpu_decode import CpuFusedDecode
from conveyor.model.layers import (
    PackedLinear,
    RMSNorm,
    RotaryEmbedding,
    can_pack_linears,
    matmul_kernels,
    weights_per_block,
)
from conveyor.model.parallel import TensorParallel
from conveyor.ops import OpsBackend, ReferenceBackend, select_backend

if TYPE_CHECKING:
    from conveyor.model.loader import Checkpoint

logger = logging.getLogger(__name__)

# Std of dummy weights: small enough that activations stay finite through deep stacks.
DUMMY_INIT_STD = 0.02


class Attention(nn.Module):
    """Q/K/V (fused) and output projections, with Qwen3's optional per-head q/k norms."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


Matmul = Callable[[torch.Tensor], torch.Tensor]

# A decoder layer's matmuls: (submodule, our fused linear, the HF projections it holds).
LAYER_MATMULS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                 ("self_attn", "o_proj", ("o_proj",)),
                 ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
                 ("mlp", "down_proj", ("down_proj",)))


def _weight(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


@dataclass(slots=True)
class _LayerRefs:
    """One decoder layer's weights and matmuls as plain references, so the forward loop reads
    them without walking nn.Module attributes."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_proj: Matmul
    o_proj: Matmul
    gate_up_proj: Matmul
    down_proj: Matmul
    q_norm: torch.Tensor | None  # Qwen3's per-head norms' weights
    k_norm: torch.Tensor | None

    @classmethod
    def of(cls, layer: DecoderLayer) -> _LayerRefs:
        attn, mlp = layer.self_attn, layer.mlp
        return cls(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                   attn.qkv_proj.forward, attn.o_proj.forward, mlp.gate_up_proj.forward,
                   mlp.down_proj.forward, _weight(attn.q_norm), _weight(attn.k_norm))


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head, over a ragged token batch.

    With tensor parallelism (``tp``), ``cfg`` is this rank's shard's config
    (``ShardPlan.local_config``: its heads, MLP columns and vocabulary rows) and the forward
    pass adds the collectives: a vocabulary-parallel embedding, an all-reduce after each
    row-parallel matmul (O, down) and an all-gather of the logits.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp if tp is not None else TensorParallel(None)
        # Given its (uninitialised) weight, the embedding skips the random init, whose
        # normal_ on the meta device imports torch._dynamo (~3 s at every start).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling_dict)
        self.lm_head: nn.Linear | PackedLinear | None = (
            None if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.backend: OpsBackend = ReferenceBackend()
        self._refs: list[_LayerRefs] | None = None  # built on first forward
        # The backend's fused decode loop for this model, where it has one and can run it
        self._fused_decode: CpuFusedDecode | None = None

    def use_backend(self, backend: OpsBackend) -> None:
        """Run the hot path with these ops (``conveyor.ops.select_backend`` chose at load)."""
        self.backend = backend
        self._weights_changed()

    def _weights_changed(self) -> None:
        """The matmuls or the backend changed: rebuild what holds references to them."""
        self._refs = None
        self._fused_decode = CpuFusedDecode.of(self)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
             meta: AttentionMetadata, keep: torch.Tensor | None = None) -> torch.Tensor:
        """One engine step's hidden states [T, hidden] (with ``keep``: those rows only): a
        decode-only batch through the backend's fused decode loop where it runs this model
        (``model/cpu_decode.py``: it computes every row, then ``keep`` selects), any other
        batch through ``forward``."""
        if self._fused_decode is not None and not meta.prefills:
            hidden = self._fused_decode(input_ids, positions, kv_caches, meta)
            return hidden if keep is None else hidden[keep]
        return self(input_ids, positions, kv_caches, meta, keep)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: [layers, 2, blocks, bs, KVH, D] (or another
        layout of ``reference.kv_cache_shape``) -> [T, hidden]; with ``keep`` (row indices)
        only those rows' [len(keep), hidden].

        Each layer: x = the previous MLP output (the embeddings first), residual = the
        stream before it; every residual add is fused with the norm that follows it. Every
        row's K/V are written, but the last layer's output projection and MLP run only on
        the kept rows (in a prefill chunk, only the last row samples a token: ~1/layers of
        the step's matmuls). With batch-invariant matmuls (the CPU kernels) a kept row's
        bits are those it has without ``keep``.
        """
        if self._refs is None:
            self._refs = [_LayerRefs.of(layer) for layer in self.decoder_layers]
        ops, eps = self.backend, self.config.rms_norm_eps
        x, residual = self.tp.embed(self.embed_tokens, input_ids), None
        cos_sin = self.rotary.cos_sin
        assert isinstance(cos_sin, torch.Tensor)
        last = len(self._refs) - 1
        for i, (layer, kv_cache) in enumerate(zip(self._refs, kv_caches, strict=True)):
            if residual is None:
                residual, x = x, ops.rms_norm(x, layer.input_norm, eps)
            else:
                ops.add_rms_norm_(x, residual, layer.input_norm, eps)
            rows = keep if i == last else None
            x = self._attention(layer, x, positions, cos_sin, kv_cache, meta, rows)
            if rows is not None:
                residual = residual[rows]
            ops.add_rms_norm_(x, residual, layer.post_norm, eps)
            x = self.tp.all_reduce(layer.down_proj(ops.silu_mul(layer.gate_up_proj(x))))
        if residual is None:  # no layers
            x = ops.rms_norm(x, self.norm.weight, eps)
            return x if keep is None else x[keep]
        ops.add_rms_norm_(x, residual, self.norm.weight, eps)
        return x

    def _attention(self, layer: _LayerRefs, x: torch.Tensor, positions: torch.Tensor,
                   cos_sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                   keep: torch.Tensor | None) -> torch.Tensor:
        """A layer's attention, through its output projection (of the ``keep`` rows only)."""
        cfg = self.config
        t, h, kvh, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = h * d, kvh * d
        qkv = layer.qkv_proj(x)
        v = qkv[:, q_size + kv_size:].view(t, kvh, d)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = qkv[:, :q_size + kv_size].split([q_size, kv_size], -1)
            # each head normalised as a row, through the backend (one kernel per norm)
            norm, eps = self.backend.rms_norm, cfg.rms_norm_eps
            qk = torch.cat([norm(q.reshape(t * h, d), layer.q_norm, eps).view(t, -1),
                            norm(k.reshape(t * kvh, d), layer.k_norm, eps).view(t, -1)], -1)
        else:
            qk = qkv  # q and k are adjacent in the fused output: rotated in place, in one op
        self.backend.rotary_(qk, positions, cos_sin, h + kvh, d)
        q = qk[:, :q_size].view(t, h, d)
        k = qk[:, q_size:q_size + kv_size].view(t, kvh, d)
        out = paged_attention(self.backend, q, k, v, kv_cache, meta, d ** -0.5)
        out = out.reshape(t, q_size)
        return self.tp.all_reduce(layer.o_proj(out if keep is None else out[keep]))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] -> logits [S, vocab] in the model's dtype (every rank's
        vocabulary rows, gathered)."""
        if self.lm_head is None:  # tied and not packed
            logits = F.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        if self.tp.plan is None:
            return logits
        return self.tp.all_gather(logits)[:, :self.tp.plan.config.vocab_size]

    def _layer_linears(self) -> list[nn.Linear | PackedLinear]:
        return [getattr(getattr(layer, owner), ours)
                for layer in self.layers for owner, ours, _ in LAYER_MATMULS]

    def matmul_layers(self, dense: bool = False
                      ) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
        """Every matmul a decode step runs (projections, MLP, LM head), as (function,
        input features), with the kernels the forward pass uses; ``dense``: on the bf16 (or
        float) weights even where the forward pass reads GGUF blocks."""
        layers: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]] = [
            (m.dense if dense and isinstance(m, PackedLinear) else m, m.in_features)
            for m in self._layer_linears()]
        head = self.lm_head
        layers.append((head.dense if dense and isinstance(head, PackedLinear)
                       else self.compute_logits, self.config.hidden_size))
        return layers

    def decode_weight_bytes(self) -> int:
        """Bytes of weights a decode step's matmuls read (GGUF blocks where they are used)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return sum(m.decode_weight_bytes() if isinstance(m, PackedLinear)
                   else m.weight.numel() * m.weight.element_size()
                   for m in [*self._layer_linears(), head])

    def pack_linears(self, amx_matmuls: bool = True) -> None:
        """Replace every matmul weight (the LM head included, tied or not) by a copy laid
        out for the CPU's matmul kernel (``PackedLinear``: oneDNN's, pair tiles or lane
        tiles; ``amx_matmuls`` off: pair tiles on AMX CPUs too); call once, after the
        weights are loaded."""
        for layer in self.layers:
            for owner, name, _ in LAYER_MATMULS:
                module = getattr(layer, owner)
                setattr(module, name, PackedLinear.from_linear(getattr(module, name),
                                                               amx_matmuls))
        head = self.lm_head
        assert not isinstance(head, PackedLinear), "already packed"
        self.lm_head = PackedLinear(self.embed_tokens.weight if head is None else head.weight,
                                    None, amx_matmuls)
        self._weights_changed()

    def use_block_weights(self, blocks: dict[str, tuple[int, torch.Tensor]],
                          int8_activations: bool = False) -> int:
        """Give each packed matmul its weight's GGUF blocks (``Checkpoint.block_weights``),
        which the kernels then read in place (``PackedLinear.use_blocks``: small batches with
        AMX, every batch with the dot kernels). Needs bf16 weights and the C++ kernels with
        AMX or AVX512-BF16, or float32 weights and AVX2 (the backend's
        ``quantized_matmuls``); a matmul whose parts are not all blocks of one supported type
        (or, with the dot kernels, of Q4_K and Q6_K) keeps its dense weight.
        ``int8_activations``: on the dot kernels with AVX512-VNNI, the bf16 block matmuls
        quantize their inputs to int8. Returns how many matmuls took their blocks."""
        if not self.backend.quantized_matmuls:
            return 0
        parts: list[tuple[Any, list[str]]] = [
            (getattr(getattr(layer, owner), ours),
             [f"model.layers.{i}.{owner}.{name}.weight" for name in theirs])
            for i, layer in enumerate(self.layers) for owner, ours, theirs in LAYER_MATMULS]
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        parts.append((self.lm_head, [head]))
        used = 0
        for linear, names in parts:
            found = [f for f in (blocks.get(name) for name in names) if f is not None]
            if not isinstance(linear, PackedLinear) or len(found) != len(names):
                continue
            rows = sum(raw.shape[0] for _, raw in found)
            if rows != linear.out_features or rows % 16 or any(
                    raw.shape[1] * weights_per_block(qtype) != linear.in_features
                    for qtype, raw in found):
                continue
            used += linear.use_block_parts(found, int8_activations)
        self._weights_changed()
        return used

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target, shard = _fused_target(name, self.config)
            if target is None or (self.lm_head is None and name == "lm_head.weight"):
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            dst = param.data if shard is None else param.data.narrow(0, *shard)
            if dst.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(f"{target}:{shard}")
        expected = _expected_keys(self.config, params)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _fused_target(name: str, cfg: ModelConfig) -> tuple[str | None, tuple[int, int] | None]:
    """Map an HF tensor name to (our parameter name, (row offset, rows) of a fused matrix)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if "rotary_emb" in name:
        return None, None
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    fused = {"q_proj": ("qkv_proj", (0, q)), "k_proj": ("qkv_proj", (q, kv)),
             "v_proj": ("qkv_proj", (q + kv, kv)),
             "gate_proj": ("gate_up_proj", (0, cfg.intermediate_size)),
             "up_proj": ("gate_up_proj", (cfg.intermediate_size, cfg.intermediate_size))}
    for hf, (ours, shard) in fused.items():
        if f".{hf}." in name:
            return name.replace(hf, ours), shard
    return name, None


def _expected_keys(cfg: ModelConfig, params: dict[str, nn.Parameter]) -> set[str]:
    keys = set()
    for name in params:
        if "qkv_proj" in name:
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            keys |= {f"{name}:{s}" for s in ((0, q), (q, kv), (q + kv, kv))}
        elif "gate_up_proj" in name:
            i = cfg.intermediate_size
            keys |= {f"{name}:{(0, i)}", f"{name}:{(i, i)}"}
        else:
            keys.add(f"{name}:None")
    return keys


# The load log's word on the other family, where AMX's runs (docs/benchmarks.md, 2026-12-05).
AMX_HINT = (" (--no-amx-matmuls: the dot kernels, ~2.3x one stream's decode speed, ~0.75x a "
            "full batch's)")


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                weights: Iterable[tuple[str, torch.Tensor]] | None, seed: int = 0,
                block_weights: Callable[[], dict[str, tuple[int, torch.Tensor]]] | None = None,
                tp: TensorParallel | None = None, int8_activations: bool = False,
                amx_matmuls: bool = True) -> CausalLM:
    """The model with loaded weights, or random ones (``weights=None``: dummy load format).

    block_weights: the checkpoint's GGUF blocks (``Checkpoint.block_weights``), for decode
    matmuls that read them in place where this machine can (``CausalLM.use_block_weights``).
    tp: this rank's shard plan and group; ``weights`` and ``block_weights`` are then this
    rank's parts (dummy weights are drawn per rank: they differ from one rank's).
    int8_activations: block matmuls quantize their inputs to int8 where the CPU runs that
    (``PackedLinear.use_blocks``).
    amx_matmuls: off, bf16 matmuls on an AMX CPU take the dot kernels, as without AMX.
    """
    if tp is not None and tp.plan is not None:
        cfg, seed = tp.plan.local_config, seed + tp.rank
    with torch.device("meta"):
        model = CausalLM(cfg, tp).to(dtype)
    model = model.to_empty(device=device)
    # The RoPE table stays float32 so positions stay precise whatever the weights' dtype.
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                   cfg.rope_scaling_dict).to(device)
    if weights is None:
        _init_dummy(model, seed)
    else:
        model.load_weights(weights)
    model = model.eval().requires_grad_(False)
    backend = select_backend(device, dtype)
    logger.info("ops backend: %s (%s on %s)", backend.name, dtype, device)
    model.use_backend(backend)
    if can_pack_linears(device, dtype):
        model.pack_linears(amx_matmuls)
        kernels = matmul_kernels(dtype, amx_matmuls)
        logger.info("matmuls: %s%s", kernels, AMX_HINT if kernels.startswith("AMX") else "")
        if block_weights is not None:
            used = model.use_block_weights(block_weights(), int8_activations)
            if used:
                int8 = sum(getattr(m, "int8_inputs", False)
                           for m in [*model._layer_linears(), model.lm_head])
                logger.info("%d of %d matmuls read their GGUF blocks in decode steps%s", used,
                            len(model.matmul_layers()),
                            f" ({int8} with int8 inputs)" if int8 else "")
    return model


def _init_dummy(model: CausalLM, seed: int) -> None:
    gen = torch.Generator(device=model.norm.weight.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith("bias"):
            param.data.zero_()
        else:
            param.data.normal_(0.0, DUMMY_INIT_STD, generator=gen)


def load_model(checkpoint: Checkpoint, args: EngineArgs, device: torch.device,
               dtype: torch.dtype, tp: TensorParallel | None = None) -> CausalLM:
    """The engine's model from a checkpoint: its weights (dummy: random ones) and, where
    ``quantized_matmuls`` allows, its GGUF blocks; with ``tp``, this rank's slices of both,
    cut as they are read (``ShardPlan.slice_of``)."""
    plan = tp.plan if tp is not None else None
    weights = None if args.load_format == "dummy" else checkpoint.tensors(plan)
    blocks = ((lambda: checkpoint.block_weights(plan))
              if args.quantized_matmuls and weights is not None else None)
    return build_model(checkpoint.config, dtype, device, weights, args.seed, blocks, tp,
                       int8_activations=args.int8_activations, amx_matmuls=args.amx_matmuls)

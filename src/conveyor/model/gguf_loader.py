"""GGUF files (llama.cpp): the config from metadata, dequantized tensors under HF names, and
the quantized blocks the decode matmuls read in place."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from conveyor.config import ModelConfig
from conveyor.model.hf_loader import unsupported_architecture
from conveyor.model.parallel import ShardPlan, Slice, pad_to, take
from conveyor.tokenizer.tokenizer import GGUF_END_TOKENS

# GGUF `general.architecture` values we load (mistral files say "llama").
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# Per-layer GGUF tensor names -> HF names (after "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp stores that have no HF parameter: Llama 3.1/3.2's RoPE frequency factors
# (llama3 scaling, which convert_hf_to_gguf.py writes as this tensor and no rope.scaling.*
# key) go into the config instead (_rope_scaling).
ROPE_FREQS = "rope_freqs.weight"
_SKIPPED = (ROPE_FREQS,)
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class _PlainViewReader(GGUFReader):
    """gguf's reader over a plain ndarray view of its memmap (the same mapped pages).

    The reader slices its data once per metadata item (a 49k-token vocabulary: ~250k
    slices); a memmap's slice costs a Python-level ``__array_finalize__``, a plain view's
    does not: SmolLM2's header parses in ~1.5 s instead of ~4 s.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


def open_gguf(path: str) -> GGUFReader:
    return _PlainViewReader(path, "r")


def gguf_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(reader: GGUFReader) -> str:
    architecture = gguf_value(reader, "general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise unsupported_architecture(architecture)
    return str(architecture)


def _rope_scaling(reader: GGUFReader, arch: str) -> tuple[tuple[str, Any], ...] | None:
    """The rope.scaling.* keys, and the frequency factors of a ``rope_freqs.weight`` tensor
    (each rotary frequency divided by its factor, as llama.cpp's ggml_rope_ext does)."""
    scaling: dict[str, Any] = {}
    rope_type = gguf_value(reader, f"{arch}.rope.scaling.type")
    factor = gguf_value(reader, f"{arch}.rope.scaling.factor")
    if rope_type not in (None, "none") and factor is not None:
        scaling = {"rope_type": str(rope_type), "factor": float(factor)}
        original = gguf_value(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        scaling["freq_factors"] = tuple(float(f) for f in np.asarray(freqs.data).reshape(-1))
    return tuple(sorted(scaling.items())) or None


def gguf_model_config(reader: GGUFReader) -> ModelConfig:
    """A ModelConfig from GGUF metadata (keys as llama.cpp's gguf-py writes them)."""
    arch = gguf_architecture(reader)

    def key(name: str, default: Any = None) -> Any:
        return gguf_value(reader, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab_size = len(tokens.data)
    else:
        vocab_size = int(key("vocab_size") or _tensor_shape(reader, "token_embd.weight")[0])
    tensor_names = {t.name for t in reader.tensors}
    eos_ids = [gguf_value(reader, f"tokenizer.ggml.{name}_token_id") for name in GGUF_END_TOKENS]
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv") or heads),
        head_dim=int(key("attention.key_length") or hidden // heads),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm=arch == "qwen3" or "blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
    )


def _tensor_shape(reader: GGUFReader, name: str) -> list[int]:
    for tensor in reader.tensors:
        if tensor.name == name:
            return [int(n) for n in reversed(tensor.shape)]
    raise KeyError(name)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor; None for tensors HF has no parameter for."""
    if gguf_name in _SKIPPED:
        return None
    match = _LAYER_RE.match(gguf_name)
    if match:
        layer, base, kind = match.groups()
        if base not in _LAYER_NAMES:
            raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[base]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base not in _GLOBAL_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's `permute` of llama q/k projections.

    HF rotates halves (dims i and i + head_dim/2 pair up); llama.cpp's "normal" rope rotates
    adjacent pairs (2i, 2i+1), so the converter interleaves each head's rows:
    reshape(n_head, 2, head_dim/2, in).swapaxes(1, 2). The inverse swaps the other way.
    Works for weights [out, in] and biases [out].
    """
    rest = weight.shape[1:]
    head_dim = weight.shape[0] // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *rest)
            .transpose(1, 2).reshape(weight.shape).contiguous())


def _permuted_rows(config: ModelConfig, name: str) -> int | None:
    """The head count whose rotary permutation the converter applied to this tensor's rows
    (llama q/k projections), else None."""
    if config.architecture not in ("llama", "mistral"):
        return None
    if ".self_attn.q_proj." in name:
        return config.num_attention_heads
    if ".self_attn.k_proj." in name:
        return config.num_key_value_heads
    return None


def iter_gguf_tensors(reader: GGUFReader, config: ModelConfig, plan: ShardPlan | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor in HF [out, in] layout), one tensor at a time; with a shard
    plan, only this rank's part of each, cut from the file before it is dequantized."""
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        part = plan.slice_of(name) if plan is not None else None
        data = _gguf_part(tensor, part)
        if data is None:  # a column slice inside quantized blocks: dequantize all, then cut
            data, part_after = tensor.data, part
        else:
            part_after = None
        values = dequantize(data, tensor.tensor_type)
        if values.dtype != np.float32 or not values.flags.writeable:  # F32/F16: a memmap view
            values = values.astype(np.float32)
        # GGUF lists dims innermost first (ne0 = in_features): the reader's arrays and
        # dequantize's are already [out, in], HF's layout.
        weight = torch.from_numpy(values)
        if part_after is not None:
            weight = take(weight, tuple(weight.shape), part_after)
        weight = pad_to(weight, part)
        heads = _permuted_rows(config, name)
        if heads is not None:  # whole heads: undo the permutation of the ones held
            weight = unpermute_rotary(weight, weight.shape[0] // config.head_dim)
        yield name, weight


def _gguf_part(tensor: Any, part: Slice | None) -> np.ndarray | None:
    """The file's data (a memmap) restricted to ``part`` without decoding it: rows, or
    columns at block boundaries. None when a column slice cuts quantized blocks."""
    data = tensor.data
    if part is None or part.dim == 0 or data.dtype != np.uint8:
        return take(data, data.shape, part)
    block_size, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    stop = part.start + part.length
    if part.start % block_size or stop % block_size:
        return None
    return data[:, part.start // block_size * type_size:stop // block_size * type_size]


# Block formats the quantized matmuls read in place: GGML type -> bytes per block of 32
# weights (Q4_K, Q6_K: of 256, read only by the dot kernels, which CPUs without AMX run:
# model.layers.weights_per_block, K_QUANTS).
BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20,
               GGMLQuantizationType.Q8_0: 34, GGMLQuantizationType.Q4_K: 144,
               GGMLQuantizationType.Q6_K: 210}


def gguf_block_weights(reader: GGUFReader, config: ModelConfig, plan: ShardPlan | None = None
                       ) -> dict[str, tuple[int, torch.Tensor]]:
    """The matrices stored as Q4_0, Q4_1, Q8_0, Q4_K or Q6_K blocks, undecoded: HF name -> (GGML
    type, uint8 [out, in / weights per block, bytes per block]), rows in HF order (rotary
    permutation undone).
    With a shard plan, this rank's part (a column slice that cuts blocks is left out: that
    matmul keeps its dequantized weight)."""
    blocks: dict[str, tuple[int, torch.Tensor]] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        block_bytes = BLOCK_BYTES.get(tensor.tensor_type)
        if name is None or block_bytes is None or len(tensor.shape) != 2:
            continue
        part = plan.slice_of(name) if plan is not None else None
        data = _gguf_part(tensor, part)
        if data is None:
            continue
        raw = torch.from_numpy(np.array(data).reshape(len(data), data.shape[1] // block_bytes,
                                                       block_bytes))
        raw = pad_to(raw, part)  # zero bytes: blocks of zero weights
        heads = _permuted_rows(config, name)
        blocks[name] = (int(tensor.tensor_type),
                        raw if heads is None
                        else unpermute_rotary(raw, raw.shape[0] // config.head_dim))
    return blocks

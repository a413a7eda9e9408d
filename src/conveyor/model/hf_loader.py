"""Hugging Face checkpoint folders: config.json and *.safetensors shards."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from conveyor.config import SUPPORTED_ARCHITECTURES, ModelConfig
from conveyor.model.parallel import ShardPlan, pad_to, take

logger = logging.getLogger(__name__)

# HF `architectures` class names -> our architecture names.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def unsupported_architecture(name: object) -> ValueError:
    """The error for a checkpoint whose architecture no model class implements."""
    return ValueError(
        f"unsupported model architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
        f"(HF classes {', '.join(HF_ARCHITECTURES)})"
    )


def read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def architecture_from_hf_config(config: dict[str, Any]) -> str:
    """`model_type` if we know it, else the first known `architectures` entry; else ValueError."""
    model_type = config.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES:
        return str(model_type)
    for name in config.get("architectures") or ():
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    raise unsupported_architecture(model_type or config.get("architectures"))


def _as_id_tuple(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)  # type: ignore[attr-defined]


def _rope_scaling(config: dict[str, Any]) -> tuple[tuple[str, Any], ...] | None:
    # transformers >= 5 writes `rope_parameters` (which also holds rope_theta); older ones
    # `rope_scaling`. Plain RoPE ("default") is None either way.
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    if not isinstance(scaling, dict):
        return None
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default") and len(scaling) <= 1:
        return None
    frozen = {k: tuple(v) if isinstance(v, list) else v for k, v in scaling.items()}
    return tuple(sorted(frozen.items()))


def _rope_theta(config: dict[str, Any]) -> float:
    if "rope_theta" in config:
        return float(config["rope_theta"])
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return 10000.0


def _context_length(config: dict[str, Any]) -> int:
    """max_position_embeddings, capped at a sliding attention window (Mistral 7B v0.1's 4096
    of 32768; Qwen's only with use_sliding_window): every layer here attends to the whole
    context, which past the window is not the model transformers and vLLM run."""
    length = int(config.get("max_position_embeddings", 2048))
    window = config.get("sliding_window")
    uses_window = config.get("use_sliding_window", True)  # (Qwen2/3 set it False)
    if isinstance(window, int) and 0 < window < length and uses_window:
        logger.warning("sliding_window=%d: the context is capped at %d tokens (of %d; "
                       "sliding-window attention is not implemented)", window, window, length)
        return window
    return length


def hf_model_config(config: dict[str, Any], generation_config: dict[str, Any] | None = None
                    ) -> ModelConfig:
    """A ModelConfig from a parsed config.json (and generation_config.json, for eos ids)."""
    architecture = architecture_from_hf_config(config)
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    eos_ids = list(_as_id_tuple(config.get("eos_token_id")))
    for token_id in _as_id_tuple((generation_config or {}).get("eos_token_id")):
        if token_id not in eos_ids:
            eos_ids.append(token_id)
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config),
        rope_scaling=_rope_scaling(config),
        max_position_embeddings=_context_length(config),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", architecture == "qwen2")),
        qk_norm=architecture == "qwen3",
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tuple(eos_ids),
    )


# generation_config.json's keys that are sampling defaults, by their SamplingParams names
# (vLLM's `--generation-config auto` takes the same ones; transformers' max_new_tokens is
# max_tokens).
SAMPLING_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                         "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                         "max_new_tokens": "max_tokens"}


def read_generation_config(folder: str) -> dict[str, Any] | None:
    """An HF folder's parsed generation_config.json (None: it has none)."""
    path = os.path.join(folder, "generation_config.json")
    return read_json(path) if os.path.isfile(path) else None


def sampling_defaults(generation: dict[str, Any] | None) -> dict[str, Any]:
    """The sampling defaults a parsed generation_config.json sets (none: {})."""
    return {name: generation[key] for key, name in SAMPLING_DEFAULT_KEYS.items()
            if generation is not None and generation.get(key) is not None}


def safetensors_files(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def iter_safetensors(folder: str, tie_word_embeddings: bool, plan: ShardPlan | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from every shard, one at a time, in the file's own dtype; with a shard
    plan, only this rank's part of each, read from the file alone."""
    files = safetensors_files(folder)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                # A tied checkpoint may still store lm_head.weight; the contract says it is absent.
                if tie_word_embeddings and name == "lm_head.weight":
                    continue
                part = plan.slice_of(name) if plan is not None else None
                if part is None:
                    yield name, f.get_tensor(name)
                    continue
                view = f.get_slice(name)
                yield name, pad_to(take(view, tuple(view.get_shape()), part), part)

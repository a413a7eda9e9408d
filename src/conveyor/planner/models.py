"""Resolve ``--model`` to a ``ModelConfig``: a preset name, an HF config.json, or a GGUF file.

Files go through the model loader with ``load_format="dummy"``, which reads the config (and
tokenizer) but no weights, so a 70B checkpoint plans as fast as a 135M one and the planner
parses configs exactly as the engine does.
"""

from __future__ import annotations

from pathlib import Path

from conveyor.config import ModelConfig
from conveyor.planner.presets import MODEL_PRESETS, model_preset


def resolve_model(model: str) -> tuple[str, ModelConfig]:
    """A display name and the ``ModelConfig`` for a preset name, config.json/folder or GGUF."""
    path = Path(model).expanduser()
    if path.exists():
        name = path.name if path.suffix == ".gguf" else (path if path.is_dir()
                                                          else path.parent).resolve().name
        return name, config_from_file(path)
    if model.lower() in (preset.lower() for preset in MODEL_PRESETS):
        return model.lower(), model_preset(model)
    raise ValueError(f"--model: {model!r} is neither a file, a folder with config.json nor a "
                     f"preset; known presets: {', '.join(MODEL_PRESETS)}")


def config_from_file(path: Path) -> ModelConfig:
    """The ``ModelConfig`` of a GGUF file, an HF folder or its config.json (no weights read)."""
    # Lazy: the loader imports torch, which preset-only plans do not need.
    from conveyor.model.loader import load_checkpoint

    try:
        return load_checkpoint(str(path), load_format="dummy").config
    except (ValueError, OSError, KeyError) as err:
        detail = f"lacks the field {err}" if isinstance(err, KeyError) else str(err)
        raise ValueError(f"--model: cannot read a model config from {path}: {detail}") from None

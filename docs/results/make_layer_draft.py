"""A draft model for speculative decoding cut from the default model: its first N layers.

There is no smaller model with SmolLM2's tokenizer in this environment (nothing can be
downloaded), so this makes one: the default GGUF's embedding, its first N decoder layers, its
final norm and (tied) LM head, saved as a Hugging Face folder (config.json, safetensors,
tokenizer.json) that ``speculative_config={"method": "draft_model", "model": FOLDER}``
loads. It is an early exit of the target (as in LayerSkip / Draft & Verify), untrained for
it: a cheap draft whose acceptance is whatever its first layers predict.

    PYTHONPATH=src python docs/results/make_layer_draft.py OUT_FOLDER [NUM_LAYERS]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from safetensors.torch import save_file

from conveyor.model.loader import default_model_path, load_checkpoint

LAYER = re.compile(r"model\.layers\.(\d+)\.")


def main(out: Path, num_layers: int) -> None:
    checkpoint = load_checkpoint(default_model_path())
    config = checkpoint.config
    if not 1 <= num_layers <= config.num_hidden_layers:
        raise SystemExit(f"NUM_LAYERS must be in [1, {config.num_hidden_layers}]")
    tensors = {name: tensor.contiguous() for name, tensor in checkpoint.tensors()
               if (m := LAYER.match(name)) is None or int(m.group(1)) < num_layers}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids),
        "torch_dtype": "float32"}, indent=1))
    assert checkpoint.tokenizer is not None
    (out / "tokenizer.json").write_text(checkpoint.tokenizer.backend_json())
    print(f"{out}: {num_layers} of {config.num_hidden_layers} layers, "
          f"{sum(t.numel() for t in tensors.values()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 8)

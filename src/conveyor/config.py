"""Frozen configuration objects, validated once at construction.

Layer 0: stdlib only. Every engine argument is a field of one of these dataclasses and,
with the same name, an ``LLM(...)`` keyword and a ``--flag`` of the command line.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

GiB = 1 << 30

# Scheduling policies (core/policy.py registers one class per name).
POLICIES = ("fcfs", "priority", "fair")

# Architectures the model package implements (HF `model_type` / GGUF `general.architecture`).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def _require(cond: bool, name: str, allowed: str, value: object) -> None:
    if not cond:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def parse_memory(value: int | float | str) -> int:
    """Bytes from an int (bytes), a float (GiB) or a string like "2GiB", "512MB", "1e9"."""
    if isinstance(value, bool):
        raise ValueError(f"kv_cache_memory must be bytes or a size like '2GiB', got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value * GiB)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", str(value), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"kv_cache_memory must be bytes or a size like '2GiB', got {value!r}")
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

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for one token across all layers (grouped-query aware)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + h


KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and the memory budget that sets the number of blocks."""

    block_size: int = 16
    kv_cache_memory: int = 1 * GiB  # bytes for K and V of all layers
    enable_prefix_caching: bool = True
    swap_space: int = 4 * GiB  # host memory for swapped-out blocks (preemption="swap")
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "int8" (a scale per row)

    def __post_init__(self) -> None:
        _require(self.swap_space >= 0, "swap_space", ">= 0 bytes", self.swap_space)
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"one of {', '.join(KV_CACHE_DTYPES)}", self.kv_cache_dtype)
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size",
                 "a power of two in [1, 256]", self.block_size)
        _require(self.kv_cache_memory > 0, "kv_cache_memory", "> 0 bytes", self.kv_cache_memory)


@dataclass(frozen=True)
class SchedulerConfig:
    """Bounds of one step: the token budget and the cap on running sequences."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority" | "fair"
    preemption: str = "recompute"  # "recompute" | "swap"
    scheduling: str = "continuous"  # "continuous" | "static" (baseline)
    kv_allocation: str = "paged"  # "paged" | "reserve" (baseline: max_model_len up front)
    # priority policy: a waiting request gains one priority level per this many steps
    priority_aging_steps: int = 64
    # fair policy: "tenant=weight,..." (others weigh 1)
    tenant_weights: str = ""

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
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1",
                 self.max_num_batched_tokens)
        _require(self.max_model_len >= 1, "max_model_len", ">= 1", self.max_model_len)
        if not self.enable_chunked_prefill:
            _require(self.max_num_batched_tokens >= self.max_model_len,
                     "max_num_batched_tokens", ">= max_model_len without chunked prefill",
                     self.max_num_batched_tokens)


@dataclass(frozen=True)
class ParallelConfig:
    """How many devices (processes) hold the model: ``tensor_parallel_size`` ranks, each
    with 1/N of every layer (conveyor.model.parallel says which part)."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        n = self.tensor_parallel_size
        _require(isinstance(n, int) and not isinstance(n, bool) and n >= 1,
                 "tensor_parallel_size", "an integer >= 1", n)


SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's names (``speculative_config={...}``).

    ``ngram`` (prompt lookup) proposes the continuation of the longest recent n-gram of the
    request's own tokens (``prompt_lookup_min`` to ``prompt_lookup_max`` tokens long) that
    occurred before; ``draft_model`` proposes with a smaller model (``model``, same
    vocabulary). Either way at most ``num_speculative_tokens`` per request per step.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # draft_model: GGUF file or HF folder

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


@dataclass(frozen=True)
class EngineArgs:
    """Every engine argument: an ``LLM(...)`` keyword and a ``--flag`` of the same name.

    ``None`` means "derive it": the default model, the model's context length, the fastest
    dtype on this machine.
    """

    model: str | None = None  # GGUF file or HF folder; None = the default SmolLM2 model
    tokenizer: str | None = None  # defaults to the model's own tokenizer
    dtype: str = "auto"  # "auto" | "bfloat16" | "float16" | "float32"
    load_format: str = "auto"  # "auto" | "gguf" | "safetensors" | "dummy"
    seed: int = 0  # seeds dummy weights and unseeded sampling
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: OFFLINE_/SERVER_MAX_NUM_BATCHED_TOKENS
    block_size: int = 16
    kv_cache_memory: int | float | str = "1GiB"
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "int8" (half the bytes)
    # decode matmuls read a GGUF's Q4_0/Q4_1/Q8_0 blocks in place (same results, fewer bytes)
    quantized_matmuls: bool = True
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    policy: str = "fcfs"  # fcfs | priority | fair: admission order and preemption victims
    preemption: str = "recompute"  # recompute | swap, when KV blocks run out
    swap_space: float = 4.0  # GiB of host memory for swapped-out blocks
    scheduling: str = "continuous"  # continuous | static (the head-of-line-blocking baseline)
    kv_allocation: str = "paged"  # paged | reserve (max_model_len per request, the baseline)
    priority_aging_steps: int = 64  # priority policy: one level more urgent per N steps waited
    tenant_weights: str = ""  # fair policy: "alice=2,bob=1"
    step_trace: bool = False  # record per-step scheduling decisions (engine.step_trace)
    # Structured outputs: a grammar that takes longer to compile is refused (ValueError/400)
    grammar_compile_timeout: float = 5.0  # seconds
    max_grammar_bytes: int = 65536  # characters of a schema, regex, grammar or choices
    served_model_name: str | None = None
    # speculative decoding: {"method": "ngram", "num_speculative_tokens": 4, ...} or its JSON
    speculative_config: dict[str, Any] | str | None = None
    # processes (devices) the model is split across (vLLM's name); rank 0 runs here
    tensor_parallel_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        _require(self.dtype in ("auto", "bfloat16", "float16", "float32"), "dtype",
                 "one of auto, bfloat16, float16, float32", self.dtype)
        _require(self.load_format in ("auto", "gguf", "safetensors", "dummy"), "load_format",
                 "one of auto, gguf, safetensors, dummy", self.load_format)
        _require(self.device in ("auto", "cpu", "cuda"), "device", "one of auto, cpu, cuda",
                 self.device)
        parse_memory(self.kv_cache_memory)  # validates
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"one of {', '.join(KV_CACHE_DTYPES)}", self.kv_cache_dtype)
        if self.max_model_len is not None:
            _require(self.max_model_len >= 1, "max_model_len", ">= 1", self.max_model_len)
        if self.max_num_batched_tokens is not None:
            _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1",
                     self.max_num_batched_tokens)
        _require(self.grammar_compile_timeout > 0, "grammar_compile_timeout", "> 0 seconds",
                 self.grammar_compile_timeout)
        _require(self.max_grammar_bytes >= 1, "max_grammar_bytes", ">= 1",
                 self.max_grammar_bytes)
        SpeculativeConfig.parse(self.speculative_config)  # validates
        self.parallel_config()  # validates

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size)

    def spec_config(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "extra"]

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size,
                           kv_cache_memory=parse_memory(self.kv_cache_memory),
                           enable_prefix_caching=self.enable_prefix_caching,
                           swap_space=int(self.swap_space * GiB),
                           kv_cache_dtype=self.kv_cache_dtype)

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        max_model_len = self.max_model_len or model_max_len
        budget = self.max_num_batched_tokens
        if budget is None:  # without chunking, a whole prompt must fit one step
            budget = (OFFLINE_MAX_NUM_BATCHED_TOKENS if self.enable_chunked_prefill
                      else max(OFFLINE_MAX_NUM_BATCHED_TOKENS, max_model_len))
        return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=budget,
                               max_model_len=max_model_len,
                               enable_chunked_prefill=self.enable_chunked_prefill,
                               policy=self.policy, preemption=self.preemption,
                               scheduling=self.scheduling, kv_allocation=self.kv_allocation,
                               priority_aging_steps=self.priority_aging_steps,
                               tenant_weights=self.tenant_weights)

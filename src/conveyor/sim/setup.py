"""From command-line settings to a simulation: the model, the KV geometry, the cost model and
the requests. Torch is imported only to read a model file (its config and tokenizer)."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from conveyor.bench.datasets import DatasetConfig, SampleRequest, sample_requests
from conveyor.config import (
    INT8_KV_SCALE_BYTES,
    EngineArgs,
    ModelConfig,
    parse_memory,
)
from conveyor.planner.plan import DeviceSpec, reserve_bytes
from conveyor.planner.presets import MODEL_PRESETS, default_link, device_preset, link_preset
from conveyor.sim.cost import CostModel, MeasuredCost, Profile, RooflineCost, model_fingerprint
from conveyor.sim.simulator import SimRequest, SimSetup, arrival_times

COST_MODELS = ("roofline", "measured")
# Bytes per element of the engine's --dtype on an accelerator (auto: bf16).
ENGINE_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class SimModel:
    """The simulated model: its name, shape and (for a model file) its tokenizer."""

    name: str
    config: ModelConfig
    tokenizer: Any = None  # conveyor.tokenizer.Tokenizer, or None for a preset

    @property
    def fingerprint(self) -> str:
        return model_fingerprint(self.config)


def resolve_model(model: str | None) -> SimModel:
    """A preset name (see `conveyor plan`), or a model file/folder (None: the default model),
    read as the engine reads it (config and tokenizer, no weights)."""
    if model is not None and model.lower() in (p.lower() for p in MODEL_PRESETS):
        from conveyor.planner.presets import model_preset

        return SimModel(model.lower(), model_preset(model))
    from conveyor.engine.llm_engine import served_name
    from conveyor.model.loader import load_checkpoint

    try:
        checkpoint = load_checkpoint(model, load_format="dummy")
    except (OSError, ValueError) as e:
        raise ValueError(f"--model: {model!r} is neither a preset ({', '.join(MODEL_PRESETS)}) "
                         f"nor a readable model: {e}") from None
    return SimModel(served_name(model, checkpoint.path), checkpoint.config, checkpoint.tokenizer)


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int, kv_cache_dtype: str) -> int:
    """KV bytes per token across all layers and KV heads, as the engine lays them out."""
    if kv_cache_dtype == "int8":
        return config.kv_bytes_per_token(1, INT8_KV_SCALE_BYTES)
    return config.kv_bytes_per_token(dtype_bytes)


@dataclass(frozen=True)
class CostSettings:
    """The command line's cost-model choice."""

    cost_model: str = "roofline"
    device: str | None = None  # a device preset (roofline)
    tp: int = 1
    link: str | None = None  # a link preset (default: the device's)
    step_overhead_ms: float = 1.0
    activation_reserve: float = 0.05  # fraction of device memory (< 1) or bytes
    profile: str | None = None  # measured: the profile file

    def __post_init__(self) -> None:
        if self.cost_model not in COST_MODELS:
            raise ValueError(f"--cost-model must be one of {', '.join(COST_MODELS)}, "
                             f"got {self.cost_model!r}")
        if self.cost_model == "measured" and not self.profile:
            raise ValueError("--cost-model measured needs --profile FILE "
                             "(written by `conveyor bench profile`)")
        if self.cost_model == "measured" and (self.device or self.tp != 1):
            raise ValueError("--device and --tp describe hardware for --cost-model roofline; "
                             "a measured profile is this machine as it was measured")
        if self.cost_model == "roofline" and not self.device:
            raise ValueError("--cost-model roofline needs --device (a preset)")


@dataclass(frozen=True)
class SimPlan:
    """Everything one simulation needs besides the requests."""

    setup: SimSetup
    cost: CostModel
    kv_bytes_per_token: float  # per device
    kv_budget_bytes: float  # per device


def _roofline(settings: CostSettings, model: SimModel, args: EngineArgs
              ) -> tuple[RooflineCost, DeviceSpec]:
    device = device_preset(settings.device or "")
    link = link_preset(settings.link) if settings.link else default_link(device.name)
    dtype_bytes = ENGINE_DTYPE_BYTES[args.dtype]
    cost = RooflineCost(
        model.config, device, dtype_bytes=dtype_bytes,
        kv_bytes_per_token=kv_bytes_per_token(model.config, dtype_bytes, args.kv_cache_dtype),
        tp=settings.tp, link_bytes_per_s=link, step_overhead_s=settings.step_overhead_ms / 1e3,
        block_size=args.block_size)
    return cost, device


def build_plan(settings: CostSettings, model: SimModel, args: EngineArgs,
               kv_cache_memory: str | None) -> SimPlan:
    """The replica setup and cost model. The KV budget per device: `kv_cache_memory` when
    given; else, on a device preset, memory - weights / tp - the activation reserve (as
    `conveyor plan`); else the engine's default."""
    cost: CostModel
    if settings.cost_model == "roofline":
        roofline, device = _roofline(settings, model, args)
        cost, per_token = roofline, roofline.kv_per_token_per_device
        weights = model.config.num_parameters() * roofline.dtype_bytes / settings.tp
        budget = (parse_memory(kv_cache_memory) if kv_cache_memory else
                  device.memory_bytes - weights
                  - reserve_bytes(device, settings.activation_reserve))
    else:
        profile = Profile.load(settings.profile or "")
        from conveyor import __version__

        profile.check_matches(model.name, model.fingerprint, __version__, args.kv_cache_dtype)
        cost = MeasuredCost(profile)
        per_token = kv_bytes_per_token(model.config, ENGINE_DTYPE_BYTES[profile.dtype],
                                       args.kv_cache_dtype)
        budget = parse_memory(kv_cache_memory or EngineArgs().kv_cache_memory)
    return SimPlan(_setup(model, args, int(budget // (per_token * args.block_size)),
                          per_token), cost, per_token, budget)


def _setup(model: SimModel, args: EngineArgs, num_blocks: int, per_token: float) -> SimSetup:
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory holds no KV block of {args.block_size} tokens at "
                         f"{per_token:.0f} bytes per token (do the weights fit the device?)")
    # The budget `conveyor serve` uses when none is given: the simulation is of a server.
    sched = args.for_server().scheduler_config(model.config.max_position_embeddings)
    swap = int(args.swap_space // (per_token * args.block_size)) \
        if args.preemption == "swap" else 0
    eos = model.config.eos_token_ids
    if model.tokenizer is not None:
        eos = tuple(model.tokenizer.eos_token_ids) or eos
    output_token = next(t for t in range(model.config.vocab_size // 2, model.config.vocab_size)
                        if t not in eos)
    return SimSetup(sched, num_blocks, args.block_size, args.enable_prefix_caching, swap,
                    tuple(eos), output_token)


def prompt_token_ids(sample: SampleRequest, model: SimModel) -> list[int]:
    """The prompt as the server would see it: token ids as given; text through the model's
    tokenizer; for a preset (no tokenizer) one id per word, derived from the word (equal
    words, equal ids: shared prefixes stay shared), padded or cut to the length hint."""
    if isinstance(sample.prompt, list):
        return list(sample.prompt)
    if model.tokenizer is not None:
        return list(model.tokenizer.encode(sample.prompt, field="prompt"))
    vocab = model.config.vocab_size
    words = sample.prompt.split() or ["."]
    ids = [1000 % vocab + zlib.crc32(w.encode()) % (vocab - 1000 % vocab) for w in words]
    n = max(1, sample.prompt_len_hint)
    return (ids * math.ceil(n / len(ids)))[:n]


@dataclass(frozen=True)
class ClientLoad:
    """`bench serve`'s client flags beyond the arrivals, as the simulation applies them."""

    ignore_eos: bool = False  # False: each sample ends at EOS, its length drawn (seeded)
    # from the dataset's output lengths, or at max_tokens if that comes first
    n: int = 1  # parallel samples per request (their prompt blocks shared)
    abort_fraction: float = 0.0  # share of streams the client cancels, as bench serve
    max_concurrency: int | None = None  # most requests in flight; None: unlimited

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"--n must be >= 1, got {self.n}")
        if not 0.0 <= self.abort_fraction <= 1.0:
            raise ValueError(f"--abort-fraction must be in [0, 1], got {self.abort_fraction}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


def build_requests(dataset: DatasetConfig, model: SimModel, rate: float, burstiness: float,
                   seed: int, load: ClientLoad = ClientLoad()) -> list[SimRequest]:
    """The workload `bench serve` would send, with its arrival times, EOS points (unless
    ignore_eos) and abort points (bench serve's own, from the same seed)."""
    from conveyor.bench.serve import abort_points

    samples = sample_requests(dataset)
    times = arrival_times(len(samples), rate, burstiness, seed)
    max_tokens = [s.output_len for s in samples]
    aborts = abort_points(len(samples), load.abort_fraction, max_tokens, seed)
    rng = np.random.default_rng([seed, 2])  # apart from the arrivals' and aborts' streams
    requests = []
    for i, (sample, t) in enumerate(zip(samples, times, strict=True)):
        eos_at = () if load.ignore_eos or not samples else \
            tuple(int(x) for x in rng.choice(max_tokens, size=load.n))
        requests.append(SimRequest(str(i), t, prompt_token_ids(sample, model), sample.output_len,
                                   eos_at=eos_at, n=load.n, abort_after=aborts[i]))
    return requests

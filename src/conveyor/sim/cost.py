"""Step cost models of `conveyor simulate`: seconds one engine step takes, from its shape.

Torch-free. A step is described by a ``StepShape`` (read off the scheduler's output); a cost
model turns it into seconds:

- ``RooflineCost``: the planner's device and model presets. Three rooflines summed, each the
  larger of its memory time and its compute time: the linear layers (every weight read once,
  2 FLOPs per parameter per token), decode attention (the decoding sequences' KV read once,
  4 FLOPs per head dimension per attended position) and prefill attention (the chunk's KV
  prefix read, the quadratic FLOPs); plus a fixed per-step overhead, swap copies over the
  host link, and with tensor parallelism two ring all-reduces per layer over the device link.
- ``MeasuredCost``: a profile written by ``conveyor bench profile`` on this machine, a linear
  model in six terms fitted by least squares (see ``TERMS``), plus the server's own work
  when the profile measured a short real serve run (see ``SERVER_TERMS``): per step and per
  streamed token inside the step, and a per-request front-end time before the engine; and
  what the first step after an idle spell costs more (``MeasuredCost.idle_time``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from conveyor.config import ModelConfig, check_tensor_parallel
from conveyor.core.outputs import SchedulerOutput
from conveyor.planner.plan import DeviceSpec, allreduce_time

# Host <-> device copies of swapped blocks (PCIe 4.0 x16, one direction, achieved).
HOST_LINK_BYTES_PER_S = 25e9
PROFILE_FORMAT = 2  # 2: TERMS gained prefill_step


@dataclass(frozen=True)
class StepShape:
    """What one step computes, as far as its cost goes."""

    num_seqs: int = 0  # requests in the step
    num_decode: int = 0  # requests computing one token past their prompt
    num_prefill_tokens: int = 0  # tokens of prompt (or recompute) chunks
    decode_context: int = 0  # positions the decodes attend to (KV read), summed
    prefill_context: int = 0  # KV positions the prefill chunks read (prefix + chunk), summed
    prefill_attention: int = 0  # (query, key) pairs of the prefill chunks (causal), summed
    num_swapped_blocks: int = 0  # blocks copied to or from host memory
    num_sampled: int = 0  # requests that sample a token (stream one) in the step

    @property
    def num_tokens(self) -> int:
        return self.num_decode + self.num_prefill_tokens

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        """The shape of a scheduled step (decode as the engine's trace counts it: one new
        token of a request that already has KV)."""
        num_decode = decode_context = prefill_tokens = prefill_context = pairs = sampled = 0
        for item in out.scheduled:
            sampled += item.samples
            n, c = item.num_new_tokens, item.num_computed_tokens
            if n == 1 and c:
                num_decode += 1
                decode_context += c + 1
            else:
                prefill_tokens += n
                prefill_context += c + n
                pairs += n * c + n * (n + 1) // 2
        return cls(num_seqs=len(out.scheduled), num_decode=num_decode,
                   num_prefill_tokens=prefill_tokens, decode_context=decode_context,
                   prefill_context=prefill_context, prefill_attention=pairs,
                   num_swapped_blocks=len(out.swap_out) + len(out.swap_in),
                   num_sampled=sampled)


class CostModel(Protocol):
    def step_time(self, shape: StepShape) -> float:
        """Seconds the step takes."""
        ...

    @property
    def request_time_s(self) -> float:
        """Seconds the server's front end spends on a request before the engine sees it
        (one request at a time)."""
        ...

    def idle_time(self, idle_s: float) -> float:
        """Seconds more that the first step after `idle_s` seconds without a step takes."""
        ...

    def describe(self) -> dict[str, Any]:
        """The model's parameters, for the report."""
        ...


@dataclass(frozen=True)
class RooflineCost:
    """Roofline step time of ``model`` on ``tp`` x ``device`` (see the module docstring)."""

    model: ModelConfig
    device: DeviceSpec
    dtype_bytes: int = 2
    kv_bytes_per_token: int = 0  # whole model (all KV heads); 0: the model's, at dtype_bytes
    tp: int = 1
    link_bytes_per_s: float = 300e9  # device-to-device link, one direction (NVLink 3)
    step_overhead_s: float = 1e-3  # scheduling, launches, sampling: fixed per step
    block_size: int = 16  # tokens per KV block (swap copies move whole blocks)

    def __post_init__(self) -> None:
        check_tensor_parallel(self.model, self.tp, "--tp")
        if self.step_overhead_s < 0:
            raise ValueError(f"--step-overhead-ms must be >= 0, got {self.step_overhead_s * 1e3}")
        if not self.link_bytes_per_s > 0:
            raise ValueError(f"the link's bandwidth (--link-gbs) must be > 0, got "
                             f"{self.link_bytes_per_s / 1e9}")

    @property
    def request_time_s(self) -> float:
        return 0.0  # a projection of the engine on other hardware: no server measured

    def idle_time(self, idle_s: float) -> float:
        return 0.0

    @property
    def kv_per_token_per_device(self) -> float:
        total = self.kv_bytes_per_token or self.model.kv_bytes_per_token(self.dtype_bytes)
        heads = self.model.num_key_value_heads
        return total / heads * math.ceil(heads / self.tp)

    def step_time(self, shape: StepShape) -> float:
        if shape.num_seqs == 0:
            return 0.0
        cfg, dev, tp = self.model, self.device, self.tp
        bw, peak = dev.bandwidth_bytes_per_s, dev.flops_per_s
        params = cfg.num_parameters()
        linear = max(params * self.dtype_bytes / tp / bw, 2 * params * shape.num_tokens / tp / peak)
        kv = self.kv_per_token_per_device
        # QK^T and PV: 2 FLOPs each per query head dimension per attended position.
        attn_flops = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim / tp
        decode = max(shape.decode_context * kv / bw, shape.decode_context * attn_flops / peak)
        prefill = max(shape.prefill_context * kv / bw, shape.prefill_attention * attn_flops / peak)
        swap = shape.num_swapped_blocks * self.block_size * kv / HOST_LINK_BYTES_PER_S
        return linear + decode + prefill + self.allreduce_time(shape.num_tokens) + swap \
            + self.step_overhead_s

    def allreduce_time(self, num_tokens: int) -> float:
        """Two ring all-reduces per layer (after attention and after the MLP) of the step's
        hidden states over the link (the planner's arithmetic: planner.plan.allreduce_time)."""
        return allreduce_time(self.model, self.tp, self.dtype_bytes, num_tokens,
                              self.link_bytes_per_s)

    def describe(self) -> dict[str, Any]:
        return {"cost_model": "roofline", "device": self.device.name, "tp": self.tp,
                "dtype_bytes": self.dtype_bytes,
                "kv_bytes_per_token_per_device": self.kv_per_token_per_device,
                "bandwidth_gb_s": self.device.bandwidth_bytes_per_s / 1e9,
                "peak_tflop_s": self.device.flops_per_s / 1e12,
                "link_gb_s": self.link_bytes_per_s / 1e9,
                "step_overhead_ms": self.step_overhead_s * 1e3}


# ---------------------------------------------------------------------------- measured
# The measured model: step time = sum of coefficient x term, coefficients >= 0, fitted by
# least squares on relative error over the profile's steps. Each term is one cost the
# engine pays: a fixed per-step cost (weights read, scheduling), a cost per token computed
# (matmul FLOPs), per sequence (sampling, bookkeeping), per KV position a decode reads
# (attention), per (query, key) pair of prefill attention (quadratic in the chunk), and per
# step that computes a prompt chunk: such a step runs the model layer by layer through the
# chunk path, where a decode-only step takes the runner's fused decode loop (on CPU), so it
# pays a fixed cost of its own (14-42 ms in the profiles of the default model on a 2-core
# CPU; the median error of the fit went from 7.8-8.8 % to 6.8-8.3 %).
TERMS = ("step", "token", "seq", "decode_context", "prefill_attention", "prefill_step")


# The server's own work, measured by a short real serve run (``conveyor.sim.profile``): a
# cost per engine-loop step (handing outputs to the event loop), per token streamed in a
# step (the SSE event: output object, JSON, write; the client's read on the same machine),
# and a front-end time per request (HTTP, validation, tokenizing, before the engine).
SERVER_TERMS = ("server_step", "server_token", "server_request")


def term_values(shape: StepShape) -> list[float]:
    return [1.0, float(shape.num_tokens), float(shape.num_seqs), float(shape.decode_context),
            float(shape.prefill_attention + shape.prefill_context),
            float(shape.num_prefill_tokens > 0)]


def fit_terms(shapes: Sequence[StepShape], times: Sequence[float]) -> list[float]:
    """Non-negative least squares on relative error: terms whose coefficient comes out
    negative are dropped (set to 0) and the rest refitted, until all are >= 0."""
    import numpy as np

    if len(shapes) < len(TERMS):
        raise ValueError(f"a fit needs at least {len(TERMS)} measured steps, got {len(shapes)}")
    rows = np.array([term_values(s) for s in shapes], dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    weights = 1.0 / y  # relative error: a 10 ms step matters as much as a 1 s one
    active = list(range(len(TERMS)))
    while True:
        a = rows[:, active] * weights[:, None]
        coef, *_ = np.linalg.lstsq(a, y * weights, rcond=None)
        if (coef >= 0).all():
            break
        active.pop(int(np.argmin(coef)))
    full = [0.0] * len(TERMS)
    for i, c in zip(active, coef, strict=True):
        full[i] = float(c)
    return full


# fit_robust drops steps whose relative residual exceeds this many times the median one
# (a step slowed down by another process on a shared machine) and fits again.
OUTLIER_FACTOR = 3.0


def fit_robust(shapes: Sequence[StepShape], times: Sequence[float]) -> list[float]:
    """fit_terms, then once more without the outlying steps."""
    coef = fit_terms(shapes, times)
    residuals = [abs(sum(c * v for c, v in zip(coef, term_values(s), strict=True)) - t) / t
                 for s, t in zip(shapes, times, strict=True)]
    limit = OUTLIER_FACTOR * sorted(residuals)[len(residuals) // 2]
    kept = [i for i, r in enumerate(residuals) if r <= limit]
    if len(kept) <= len(TERMS) or len(kept) == len(shapes):
        return coef
    return fit_terms([shapes[i] for i in kept], [times[i] for i in kept])


@dataclass(frozen=True)
class ServeRun:
    """One batch of the serve run: what the client measured, what the engine alone
    would take (simulated), medians in seconds; for the lone requests also the median over
    them of the client's TTFT less the server's own for that request (its /metrics: from the
    engine's arrival to its first token): the front end as measured rather than as modelled."""

    batch: int
    measured_ttft: float
    measured_tpot: float
    engine_ttft: float
    engine_tpot: float
    front_end: float | None = None


def fit_server_terms(runs: list[ServeRun]) -> dict[str, float]:
    """The server's terms from the gaps between real and engine-only runs: the TPOT gap at
    each batch B is one decode step's server work, server_step + server_token x B (least
    squares, both >= 0); the lone requests' TTFT gap, less that step work for their one
    token, is the per-request front-end time (>= 0). That gap is the client's TTFT less the
    server's own where the server reported it: less the simulated engine's, it also held the
    cost model's error on a lone prefill (0 and 72 ms in two profiles of one machine). A
    median over the lone requests: the mean of three once put it at 8.5 ms where 30 requests
    one by one gave a median of 2.3."""
    import numpy as np

    batches = np.array([r.batch for r in runs], dtype=np.float64)
    gaps = np.array([r.measured_tpot - r.engine_tpot for r in runs])
    if len(runs) > 1:
        slope, intercept = np.polyfit(batches, gaps, 1)
    else:
        slope, intercept = 0.0, float(gaps[0])
    if slope < 0:
        slope, intercept = 0.0, float(gaps.mean())
    elif intercept < 0:
        slope, intercept = float(batches @ gaps / (batches @ batches)), 0.0
    step, token = max(float(intercept), 0.0), max(float(slope), 0.0)
    lone = next(r for r in runs if r.batch == 1)
    gap = lone.front_end if lone.front_end is not None else lone.measured_ttft - lone.engine_ttft
    request = max(gap - step - token, 0.0)
    return {"server_step": step, "server_token": token, "server_request": request}


def model_fingerprint(config: ModelConfig) -> str:
    """A short hash of the model's shape: a profile only applies to the model it measured."""
    text = json.dumps(asdict(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Profile:
    """What `conveyor bench profile` writes: the fitted coefficients and what they apply to."""

    model: str  # the model's served name
    model_path: str | None  # the --model it was measured with (None: the default model)
    model_fingerprint: str  # model_fingerprint of its config
    engine_version: str  # conveyor.__version__ of the engine measured
    dtype: str  # the engine's resolved dtype
    kv_cache_dtype: str
    device: str  # "cpu" | "cuda"
    machine: str  # CPU or GPU model name
    coefficients: dict[str, float]  # TERMS -> seconds per unit
    samples: list[dict[str, Any]]  # {shape fields..., "time_s": measured}
    median_abs_error: float  # of the fit over the samples, relative
    date: str = ""
    format: int = PROFILE_FORMAT
    # SERVER_TERMS -> seconds per unit; empty: the profile measured the engine alone
    server_coefficients: dict[str, float] = field(default_factory=dict)
    server_samples: list[dict[str, Any]] = field(default_factory=list)  # the serve runs
    # A lone prefill's extra time after the engine sat idle for idle_gap_s (0: not measured)
    idle_step_s: float = 0.0
    idle_gap_s: float = 0.0

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--profile: cannot read {path}: {e}") from None
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"--profile: {path} is not a profile of format {PROFILE_FORMAT} "
                             "written by `conveyor bench profile`")
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"--profile: {path} is malformed: {e}") from None

    def check_matches(self, model: str, fingerprint: str, engine_version: str,
                      kv_cache_dtype: str) -> None:
        """Refuse (ValueError) a profile measured on another model or engine version."""
        if fingerprint != self.model_fingerprint:
            raise ValueError(f"--profile was measured on model {self.model!r}, not {model!r} "
                             f"(model shapes differ); run `conveyor bench profile --model ...` "
                             "for this model")
        if engine_version != self.engine_version:
            raise ValueError(f"--profile was measured with conveyor {self.engine_version}, "
                             f"this is {engine_version}; measure again with `conveyor bench "
                             "profile`")
        if kv_cache_dtype != self.kv_cache_dtype:
            raise ValueError(f"--profile was measured with kv_cache_dtype="
                             f"{self.kv_cache_dtype!r}, not {kv_cache_dtype!r}")


@dataclass(frozen=True)
class MeasuredCost:
    """Step time from a profile's fitted coefficients."""

    profile: Profile

    def engine_step_time(self, shape: StepShape) -> float:
        """The engine's step alone (LLMEngine.step, as `bench profile` timed it)."""
        if shape.num_seqs == 0:
            return 0.0
        coef = [self.profile.coefficients[t] for t in TERMS]
        return sum(c * v for c, v in zip(coef, term_values(shape), strict=True))

    def step_time(self, shape: StepShape) -> float:
        """The engine's step plus the server's work for it (its streamed tokens)."""
        if shape.num_seqs == 0:
            return 0.0
        server = self.profile.server_coefficients
        return self.engine_step_time(shape) + server.get("server_step", 0.0) \
            + server.get("server_token", 0.0) * shape.num_sampled

    @property
    def request_time_s(self) -> float:
        return self.profile.server_coefficients.get("server_request", 0.0)

    def idle_time(self, idle_s: float) -> float:
        """The profile's idle cost, in proportion up to the gap it was measured after: on
        the 2-core Xeon a lone 128-token prefill (43 ms right after another) took 2, 4, 5,
        16 and 12 ms more after 0.25, 0.5, 1, 2 and 3 s without a step (medians of 6;
        caches and cores gone cold; offline as through the server)."""
        p = self.profile
        if p.idle_gap_s <= 0 or idle_s <= 0:
            return 0.0
        return p.idle_step_s * min(idle_s / p.idle_gap_s, 1.0)

    def describe(self) -> dict[str, Any]:
        p = self.profile
        return {"cost_model": "measured", "model": p.model, "machine": p.machine,
                "dtype": p.dtype, "coefficients": p.coefficients,
                "server_coefficients": p.server_coefficients,
                "idle_step_ms": p.idle_step_s * 1e3, "idle_gap_s": p.idle_gap_s,
                "profile_median_abs_error": p.median_abs_error, "profile_date": p.date}

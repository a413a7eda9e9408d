"""``conveyor bench profile``: time engine steps over a grid of shapes and fit the step cost.

For each context length C, requests of C prompt tokens are added until B of them decode
together, for each B of the grid; at each B, a few pure decode steps are timed, then one step
per prefill size P in which a new P-token prompt is computed alongside the B decodes. Every
step the engine runs (the setup prefills too) is a sample: its shape is read off the
scheduler's output, its time is ``LLMEngine.step`` end to end (schedule, forward, sample,
update, detokenize). The samples are fitted with ``conveyor.sim.cost.fit_terms``.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from conveyor import __version__
from conveyor.config import EngineArgs
from conveyor.core.outputs import SchedulerOutput
from conveyor.engine.llm_engine import LLMEngine
from conveyor.sampling_params import SamplingParams
from conveyor.sim.cost import TERMS, MeasuredCost, Profile, StepShape, fit_robust, model_fingerprint

logger = logging.getLogger(__name__)
_FIRST_PLAIN_TOKEN = 1000  # synthetic prompt ids stay above special tokens (bench/offline.py)


@dataclass(frozen=True)
class ProfileGrid:
    """The shapes to time: decode batches x context lengths, and prefill chunk sizes."""

    batches: tuple[int, ...] = (1, 4, 16, 32, 64)
    context_lens: tuple[int, ...] = (128, 320)
    prefill_tokens: tuple[int, ...] = (32, 128, 512)
    steps: int = 3  # timed pure-decode steps per (batch, context)

    def __post_init__(self) -> None:
        for name in ("batches", "context_lens", "prefill_tokens"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be positive integers, got {list(values)}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    def engine_args(self, base: EngineArgs) -> EngineArgs:
        """`base` with room for the biggest step of the grid in one step."""
        need_tokens = max(self.prefill_tokens) + max(self.batches)
        return dataclasses.replace(
            base, max_num_seqs=max(base.max_num_seqs, max(self.batches) + 1),
            max_num_batched_tokens=max(base.max_num_batched_tokens or 0, need_tokens),
            enable_prefix_caching=False)  # every prompt computed: the shapes are what we time


class _Timer:
    """Times engine steps and reads each one's shape off the scheduler output."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.samples: list[tuple[StepShape, float]] = []
        execute: Callable[[SchedulerOutput], Any] = engine.runner.execute
        self._last: SchedulerOutput | None = None

        def traced(out: SchedulerOutput) -> Any:
            self._last = out
            return execute(out)

        engine.runner.execute = traced  # type: ignore[method-assign]

    def step(self) -> None:
        start = time.perf_counter()
        self.engine.step()
        elapsed = time.perf_counter() - start
        if self._last is not None and not self._last.is_empty:
            self.samples.append((StepShape.of(self._last), elapsed))
        self._last = None


def _prompt(rng: random.Random, vocab: int, n: int) -> dict[str, list[int]]:
    first = min(_FIRST_PLAIN_TOKEN, vocab // 2)
    return {"prompt_token_ids": [rng.randrange(first, vocab) for _ in range(n)]}


def _time_context(timer: _Timer, grid: ProfileGrid, context: int, rng: random.Random) -> None:
    """Grow the decode batch through grid.batches at this context; time decodes and
    decodes-plus-prefill steps at each batch."""
    engine = timer.engine
    vocab = engine.model_config.vocab_size
    max_tokens = engine.scheduler_config.max_model_len - context - 1
    decode = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    live: list[str] = []
    try:
        for batch in sorted(grid.batches):
            live += [engine.add_request(_prompt(rng, vocab, context), decode)
                     for _ in range(batch - len(live))]
            while engine.scheduler.num_waiting or any(
                    r.num_output_tokens < 1 for r in engine.scheduler.running):
                timer.step()
            for _ in range(grid.steps):
                timer.step()
            for prefill in grid.prefill_tokens:
                one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
                new = engine.add_request(_prompt(rng, vocab, prefill), one)
                while new in engine.groups:
                    timer.step()
            logger.info("profile: context %d, decode batch %d: %d steps timed so far",
                        context, batch, len(timer.samples))
    finally:
        engine.abort_request(live)


def _machine(engine: LLMEngine) -> str:
    if engine.device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(engine.device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_profile(base: EngineArgs, grid: ProfileGrid) -> Profile:
    """Build the engine, time the grid, fit the cost terms."""
    from conveyor.bench.workloads import build_llm, warm_up

    args = grid.engine_args(base)
    llm = build_llm(args)
    engine = llm.engine
    need = max(grid.batches) * (max(grid.context_lens) + max(grid.steps, 1) + 2)
    if need > engine.kv_layout.num_tokens:
        raise ValueError(f"the grid needs {need} KV tokens (batches x context lens), the cache "
                         f"holds {engine.kv_layout.num_tokens}: raise --kv-cache-memory or "
                         "shrink --batches / --context-lens")
    if max(grid.context_lens) + grid.steps + 2 > engine.scheduler_config.max_model_len:
        raise ValueError("--context-lens must leave room below max_model_len")
    warm_up(llm)
    timer = _Timer(engine)
    rng = random.Random(0)
    for context in sorted(grid.context_lens):
        _time_context(timer, grid, context, rng)
    engine.check_integrity()
    shapes = [s for s, _ in timer.samples]
    times = [t for _, t in timer.samples]
    coefficients = dict(zip(TERMS, fit_robust(shapes, times), strict=True))
    profile = Profile(
        model=engine.model_name, model_path=base.model,
        model_fingerprint=model_fingerprint(engine.model_config), engine_version=__version__,
        dtype=str(engine.dtype).removeprefix("torch."), kv_cache_dtype=args.kv_cache_dtype,
        device=engine.device.type, machine=_machine(engine), coefficients=coefficients,
        samples=[{**dataclasses.asdict(s), "time_s": t} for s, t in timer.samples],
        median_abs_error=0.0, date=datetime.now().isoformat(timespec="seconds"))
    return dataclasses.replace(profile, median_abs_error=fit_error(profile))


def fit_error(profile: Profile) -> float:
    """Median |predicted - measured| / measured over the profile's own samples."""
    cost = MeasuredCost(profile)
    errors = []
    for sample in profile.samples:
        shape = StepShape(**{k: v for k, v in sample.items() if k != "time_s"})
        errors.append(abs(cost.step_time(shape) - sample["time_s"]) / sample["time_s"])
    return statistics.median(errors)


# What each coefficient means, for the printed summary.
TERM_UNITS = {"step": "ms per step (fixed: weights read, scheduling)",
              "token": "ms per token computed (matmuls)",
              "seq": "ms per sequence in the step (sampling, bookkeeping)",
              "decode_context": "ms per KV position a decode attends to",
              "prefill_attention": "ms per prefill (query, key) pair and KV position read"}


def format_profile(profile: Profile, path: str) -> str:
    lines = [" Step cost profile ".center(72, "="),
             f"model {profile.model} ({profile.dtype}, kv {profile.kv_cache_dtype}) on "
             f"{profile.machine}, conveyor {profile.engine_version}",
             f"{len(profile.samples)} steps timed; fit: step time = sum of coefficient x term "
             "(least squares on relative error, coefficients >= 0)"]
    for term in TERMS:
        lines.append(f"{profile.coefficients[term] * 1e3:>14.6f}  {TERM_UNITS[term]}")
    lines += [f"median |error| of the fit over the timed steps: "
              f"{profile.median_abs_error:.1%}", f"written to {path}", "=" * 72]
    return "\n".join(lines)

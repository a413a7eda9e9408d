"""``conveyor bench profile``: time engine steps over a grid of shapes and fit the step cost.

For each context length C, requests of C prompt tokens are added until B of them decode
together, for each B of the grid; at each B, a few pure decode steps are timed, then one step
per prefill size P in which a new P-token prompt is computed alongside the B decodes. Every
step the engine runs (the setup prefills too) is a sample: its shape is read off the
scheduler's output, its time is ``LLMEngine.step`` end to end (schedule, forward, sample,
update, detokenize). The samples are fitted with ``conveyor.sim.cost.fit_robust`` (a fit,
outliers past 3x the median residual dropped, a second fit). Then lone
prefills after an idle spell and right after another one price the idle cost
(``MeasuredCost.idle_time``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from conveyor import __version__
from conveyor.config import EngineArgs
from conveyor.core.outputs import SchedulerOutput
from conveyor.sampling_params import SamplingParams
from conveyor.sim.cost import (
    TERMS,
    MeasuredCost,
    Profile,
    ServeRun,
    StepShape,
    fit_robust,
    fit_server_terms,
    model_fingerprint,
)
from conveyor.sim.simulator import SimRequest, SimSetup, simulate

if TYPE_CHECKING:  # LLMEngine imports torch: not when `conveyor` builds its parser
    from conveyor.bench.datasets import SampleRequest
    from conveyor.bench.metrics import RequestRecord
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.runner.model_runner import KVCacheLayout

logger = logging.getLogger(__name__)
_FIRST_PLAIN_TOKEN = 1000  # synthetic prompt ids stay above special tokens (bench/offline.py)


@dataclass(frozen=True)
class ProfileGrid:
    """The shapes to time: decode batches x context lengths, and prefill chunk sizes."""

    batches: tuple[int, ...] = (1, 4, 16, 32, 64)
    context_lens: tuple[int, ...] = (128, 256)  # the default cache (1 GiB) holds batch 64
    prefill_tokens: tuple[int, ...] = (32, 128, 512)
    steps: int = 3  # timed pure-decode steps per (batch, context)
    # Lone prefills of idle_prompt tokens, each after idle_gap_s without a step and right
    # after the previous one, idle_pairs times (0: the idle cost is not measured)
    idle_gap_s: float = 2.0
    idle_pairs: int = 5
    idle_prompt: int = 128

    def __post_init__(self) -> None:
        for name in ("batches", "context_lens", "prefill_tokens"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be positive integers, got {list(values)}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.idle_pairs < 0 or self.idle_prompt < 1 or not self.idle_gap_s >= 0:
            raise ValueError(f"idle_gap_s must be >= 0, idle_pairs >= 0 and idle_prompt >= 1, "
                             f"got {self.idle_gap_s}, {self.idle_pairs}, {self.idle_prompt}")

    def engine_args(self, base: EngineArgs) -> EngineArgs:
        """`base` with room for the biggest step of the grid in one step."""
        need_tokens = max(self.prefill_tokens) + max(self.batches)
        return dataclasses.replace(
            base, max_num_seqs=max(base.max_num_seqs, max(self.batches) + 1),
            max_num_batched_tokens=max(base.max_num_batched_tokens or 0, need_tokens),
            enable_prefix_caching=False,  # every prompt computed: the shapes are what we time
            async_scheduling=False)  # a step timed is a step run, not the one launched next


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
        if self.engine.scheduler.stats.num_preemptions:
            raise RuntimeError("the KV cache ran out during the profile (a request was "
                               "preempted): raise --kv-cache-memory or shrink the grid")
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


def _time_idle(engine: LLMEngine, grid: ProfileGrid, rng: random.Random) -> float:
    """Seconds more a lone prefill step takes after the engine sat idle for grid.idle_gap_s
    than right after another one: the median of each, alternating (>= 0; 0 if not asked)."""
    if not grid.idle_pairs or grid.idle_gap_s <= 0:
        return 0.0
    vocab = engine.model_config.vocab_size
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prefill() -> float:
        engine.add_request(_prompt(rng, vocab, grid.idle_prompt), one)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed

    prefill()  # the row count's first call
    busy, idle = [], []
    for _ in range(grid.idle_pairs):
        busy.append(prefill())
        time.sleep(grid.idle_gap_s)
        idle.append(prefill())
    return max(statistics.median(idle) - statistics.median(busy), 0.0)


def _check_capacity(grid: ProfileGrid, layout: KVCacheLayout) -> None:
    """Refuse a grid whose largest point does not fit the KV cache: a preemption would
    recompute prompts in the middle of the timing (and a prefill that is preempted again and
    again never finishes). The decodes grow by a token each step through every batch of a
    context: about steps + 2 per batch, plus two steps per timed prefill."""
    block = layout.block_size
    growth = len(grid.batches) * (grid.steps + 2 + 2 * len(grid.prefill_tokens))
    per_request = -(-(max(grid.context_lens) + growth) // block) * block
    need = max(grid.batches) * per_request + -(-max(grid.prefill_tokens) // block) * block
    if need > layout.num_tokens:
        mib = -(-need * layout.bytes_per_token // 2**20)  # rounded up
        raise ValueError(f"the grid needs {need} KV tokens (its largest batch x its longest "
                         f"context as it grows, plus its largest prefill), the cache holds "
                         f"{layout.num_tokens}: --kv-cache-memory {mib}MiB or more, or "
                         "shrink --batches / --context-lens")


def run_profile(base: EngineArgs, grid: ProfileGrid,
                serve: ServeGrid | None = None) -> Profile:
    """Build the engine, time the grid, fit the cost terms; with `serve`, then price the
    server's own work with a short real serve run (see measure_server)."""
    from conveyor.bench.workloads import build_llm, warm_up
    from conveyor.model.device import machine_name

    args = grid.engine_args(base)
    llm = build_llm(args)
    engine = llm.engine
    _check_capacity(grid, engine.kv_layout)
    if max(grid.context_lens) + grid.steps + 2 > engine.scheduler_config.max_model_len:
        raise ValueError("--context-lens must leave room below max_model_len")
    warm_up(llm)
    timer = _Timer(engine)
    rng = random.Random(0)
    for context in sorted(grid.context_lens):
        _time_context(timer, grid, context, rng)
    idle_step = _time_idle(engine, grid, rng)
    engine.check_integrity()
    shapes = [s for s, _ in timer.samples]
    times = [t for _, t in timer.samples]
    coefficients = dict(zip(TERMS, fit_robust(shapes, times), strict=True))
    profile = Profile(
        model=engine.model_name, model_path=base.model,
        model_fingerprint=model_fingerprint(engine.model_config), engine_version=__version__,
        dtype=str(engine.dtype).removeprefix("torch."), kv_cache_dtype=args.kv_cache_dtype,
        device=engine.device.type, machine=machine_name(engine.device), coefficients=coefficients,
        samples=[{**dataclasses.asdict(s), "time_s": t} for s, t in timer.samples],
        median_abs_error=0.0, date=datetime.now().isoformat(timespec="seconds"),
        idle_step_s=idle_step, idle_gap_s=grid.idle_gap_s if grid.idle_pairs else 0.0)
    profile = dataclasses.replace(profile, median_abs_error=fit_error(profile))
    if serve is None:
        return profile
    setup, vocab = _sim_setup(engine), engine.model_config.vocab_size
    del llm, engine, timer
    gc.collect()  # the server loads its own copy of the model
    return measure_server(args, serve, profile, setup, vocab)


def fit_error(profile: Profile) -> float:
    """Median |predicted - measured| / measured over the profile's own samples."""
    cost = MeasuredCost(profile)
    errors = []
    for sample in profile.samples:
        shape = StepShape(**{k: v for k, v in sample.items() if k != "time_s"})
        errors.append(abs(cost.engine_step_time(shape) - sample["time_s"]) / sample["time_s"])
    return statistics.median(errors)


# What each coefficient means, for the printed summary.
TERM_UNITS = {"step": "ms per step (fixed: weights read, scheduling)",
              "token": "ms per token computed (matmuls)",
              "seq": "ms per sequence in the step (sampling, bookkeeping)",
              "decode_context": "ms per KV position a decode attends to",
              "prefill_attention": "ms per prefill (query, key) pair and KV position read",
              "prefill_step": "ms per step with a prompt chunk (the chunk path's own cost)",
              "server_step": "ms per engine-loop step (handing outputs to the server)",
              "server_token": "ms per token streamed (SSE event, client read)",
              "server_request": "ms per request before the engine (HTTP, tokenizing)"}


def format_profile(profile: Profile, path: str) -> str:
    lines = [" Step cost profile ".center(72, "="),
             f"model {profile.model} ({profile.dtype}, kv {profile.kv_cache_dtype}) on "
             f"{profile.machine}, conveyor {profile.engine_version}",
             f"{len(profile.samples)} steps timed; fit: step time = sum of coefficient x term "
             "(least squares on relative error, coefficients >= 0)"]
    for term in TERMS:
        lines.append(f"{profile.coefficients[term] * 1e3:>14.6f}  {TERM_UNITS[term]}")
    if profile.server_coefficients:
        lines.append("the server's own work (a short real serve run, fitted on its gap to "
                     "the simulated engine):")
    for term, value in profile.server_coefficients.items():
        lines.append(f"{value * 1e3:>14.6f}  {TERM_UNITS[term]}")
    if profile.idle_gap_s:
        lines.append(f"{profile.idle_step_s * 1e3:>14.6f}  ms more for the first step after "
                     f"{profile.idle_gap_s:g} s without one (caches and cores gone cold)")
    lines += [f"median |error| of the fit over the timed steps: "
              f"{profile.median_abs_error:.1%}", f"written to {path}", "=" * 72]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the server
@dataclass(frozen=True)
class ServeGrid:
    """The short real serve run that prices the server's own work: for each batch B, B
    streamed requests of `prompt_len` token ids sent at once, `output_len` tokens each
    (ignore_eos); at B = 1, `lone_requests` requests one after another (the front end is
    their median)."""

    batches: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 64
    output_len: int = 32
    lone_requests: int = 8

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1 or 1 not in self.batches:
            raise ValueError(f"serve batches must be positive integers including 1, got "
                             f"{list(self.batches)}")
        for name in ("prompt_len", "output_len", "lone_requests"):
            if getattr(self, name) < (3 if name == "output_len" else 1):
                raise ValueError(f"serve {name} too small: {getattr(self, name)}")


def _sim_setup(engine: LLMEngine) -> SimSetup:
    """The engine's scheduler and KV geometry, to simulate what its server runs."""
    kv = engine.scheduler.kv_cache
    eos = tuple(engine.tokenizer.eos_token_ids) if engine.tokenizer is not None else ()
    eos = eos or engine.model_config.eos_token_ids
    vocab = engine.model_config.vocab_size
    plain = next(t for t in range(min(_FIRST_PLAIN_TOKEN, vocab // 2), vocab) if t not in eos)
    return SimSetup(engine.scheduler_config, kv.num_blocks, kv.block_size, kv.enable_caching,
                    eos_token_ids=tuple(eos), output_token=plain)


def _serve_batch(url: str, grid: ServeGrid, batch: int, setup: SimSetup,
                 cost: MeasuredCost, rng: random.Random, vocab: int) -> ServeRun:
    from conveyor.bench.datasets import SampleRequest

    prompts = [_prompt(rng, vocab, grid.prompt_len)["prompt_token_ids"]
               for _ in range(grid.lone_requests if batch == 1 else batch)]
    samples = [SampleRequest(p, grid.prompt_len, grid.output_len) for p in prompts]
    front_ends: list[float] = []
    if batch == 1:
        records = _lone_requests(url, samples, front_ends)
    else:
        records = _send(url, samples, None)
    concurrency = 1 if batch == 1 else None
    sims = [SimRequest(str(i), 0.0, p, grid.output_len) for i, p in enumerate(prompts)]
    run = simulate(setup, cost, sims, max_concurrency=concurrency)
    return ServeRun(batch, statistics.median(r.ttft for r in records),
                    statistics.median(r.tpot or 0.0 for r in records),
                    statistics.median(r.record.ttft for r in run.requests),
                    statistics.median(r.record.tpot or 0.0 for r in run.requests),
                    front_end=statistics.median(front_ends) if front_ends else None)


def _send(url: str, samples: list[SampleRequest], concurrency: int | None
          ) -> list[RequestRecord]:
    """`bench serve`'s client on these requests (streamed, ignore_eos): their records."""
    from conveyor.bench.serve import BenchmarkConfig, run_benchmark

    real = asyncio.run(run_benchmark(BenchmarkConfig(
        base_url=url, ignore_eos=True, show_progress=False, max_concurrency=concurrency),
        samples))
    if real.metrics.completed != len(samples):
        raise RuntimeError(f"the profile's serve run failed: {real.first_error}")
    return real.records


def _lone_requests(url: str, samples: list[SampleRequest], front_ends: list[float]
                   ) -> list[RequestRecord]:
    """Each request alone, one after another: their records; appends to `front_ends` each
    one's client TTFT less the server's own (the server's histogram read before and after
    it), where /metrics could be read."""
    records = []
    for sample in samples:
        before = _server_ttft(url)
        (record,) = _send(url, [sample], 1)
        total, count = (a - b for a, b in zip(_server_ttft(url), before, strict=True))
        if count == 1:
            front_ends.append(record.ttft - total)
        records.append(record)
    return records


def _server_ttft(url: str) -> tuple[float, float]:
    """The sum and count of the server's own time-to-first-token histogram (from the
    engine's arrival to its first token); zeros if /metrics cannot be read."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            text = response.read().decode()
    except OSError:
        return 0.0, 0.0
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "conveyor:time_to_first_token_seconds":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
    return total, count


def measure_server(args: EngineArgs, grid: ServeGrid, profile: Profile, setup: SimSetup,
                   vocab: int) -> Profile:
    """Run `conveyor serve` with `args`, time `grid`'s batches through `bench serve`'s
    client, simulate each with the engine-only profile, and fit the server's terms on
    the gaps (fit_server_terms). The profile with them."""
    from conveyor.bench.http_overhead import serve_subprocess

    rng = random.Random(1)
    engine_only = MeasuredCost(profile)
    with serve_subprocess(args, log_level=None) as url:
        _serve_batch(url, grid, 1, setup, engine_only, rng, vocab)  # warm-up
        runs = [_serve_batch(url, grid, b, setup, engine_only, rng, vocab)
                for b in sorted(grid.batches)]
    for r in runs:
        logger.info("profile: serve batch %d: TPOT %.2f ms (engine alone %.2f), TTFT %.2f ms "
                    "(engine alone %.2f)", r.batch, 1e3 * r.measured_tpot, 1e3 * r.engine_tpot,
                    1e3 * r.measured_ttft, 1e3 * r.engine_ttft)
    return dataclasses.replace(profile, server_coefficients=fit_server_terms(runs),
                               server_samples=[dataclasses.asdict(r) for r in runs])

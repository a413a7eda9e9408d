"""Seeded workloads of `bench compare` and `bench sweep`, and one timed run of a workload.

Issue 4's performance cases, each a list of (prompt token ids, SamplingParams), all arriving
at once: the head-of-line mix (most outputs short, one in eight long), and a shared system
prompt followed by short distinct suffixes (prefix caching). The fragmentation case reuses
the reference workload of `bench offline` (`conveyor.bench.offline.Workload`).
"""

from __future__ import annotations

import dataclasses
import gc
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from conveyor.config import EngineArgs
from conveyor.engine.llm import LLM
from conveyor.engine.stats import EngineStats, StepTrace
from conveyor.outputs import RequestOutput
from conveyor.sampling_params import SamplingParams

# Token ids for synthetic prompts are drawn above the special tokens of common vocabularies
# (the same rule as bench/offline.py), and below the vocabulary size.
_FIRST_PLAIN_TOKEN = 1000

Requests = list[tuple[list[int], SamplingParams]]


def _plain_token(rng: random.Random, vocab_size: int) -> int:
    return rng.randrange(min(_FIRST_PLAIN_TOKEN, vocab_size // 2), vocab_size)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@dataclass(frozen=True)
class HeadOfLineWorkload:
    """Prompts of `prompt_len` tokens; in every group of `group` requests one (at a seeded
    place) generates `long_output` tokens and the others `short_output` (ignore_eos)."""

    num_requests: int = 64
    prompt_len: tuple[int, int] = (16, 64)
    short_output: int = 20
    long_output: int = 500
    group: int = 8  # one long request per group: each static batch of `group` waits for one
    seed: int = 0

    def requests(self, vocab_size: int) -> Requests:
        rng = random.Random(self.seed)
        out = []
        for start in range(0, self.num_requests, self.group):
            size = min(self.group, self.num_requests - start)
            long_at = rng.randrange(size)
            for i in range(size):
                prompt = [_plain_token(rng, vocab_size) for _ in range(rng.randint(*self.prompt_len))]
                out.append((prompt, _greedy(self.long_output if i == long_at
                                            else self.short_output)))
        return out


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """A shared `prefix_len`-token system prompt, then a distinct `suffix_len`-token suffix
    per request; `output_len` tokens each (ignore_eos)."""

    num_requests: int = 64
    prefix_len: int = 500
    suffix_len: tuple[int, int] = (8, 32)
    output_len: int = 16
    seed: int = 0

    def requests(self, vocab_size: int) -> Requests:
        rng = random.Random(self.seed)
        prefix = [_plain_token(rng, vocab_size) for _ in range(self.prefix_len)]
        return [(prefix + [_plain_token(rng, vocab_size)
                           for _ in range(rng.randint(*self.suffix_len))],
                 _greedy(self.output_len)) for _ in range(self.num_requests)]


@dataclass
class RunResult:
    """One timed run of a workload through an LLM (all requests at once)."""

    duration_s: float
    outputs: list[RequestOutput]
    stats: EngineStats  # engine stats after the run (peaks cover the run only if fresh)
    num_steps: int
    num_preemptions: int
    prefix_cache_hits: int  # prompt tokens found in the prefix cache during this run
    prefix_cache_queries: int  # prompt tokens looked up during this run
    trace: list[StepTrace] | None  # the engine's step trace of this run, if recorded

    @property
    def output_tokens(self) -> int:
        return sum(len(c.token_ids) for o in self.outputs for c in o.outputs)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s

    def e2e_latencies(self) -> list[float]:
        return [o.metrics.e2e_latency for o in self.outputs if o.metrics.e2e_latency is not None]

    def ttfts(self) -> list[float]:
        return [t for o in self.outputs if (t := o.metrics.time_to_first_token) is not None]

    def tpots(self) -> list[float]:
        """Mean seconds per output token after the first, per request with 2+ tokens."""
        out = []
        for o in self.outputs:
            m, n = o.metrics, len(o.outputs[0].token_ids)
            if n > 1 and m.first_token_time is not None and m.finished_time is not None:
                out.append((m.finished_time - m.first_token_time) / (n - 1))
        return out

    def summary(self) -> dict[str, Any]:
        """Throughput and latency figures (seconds → ms), JSON-ready."""
        e2e, ttft, tpot = self.e2e_latencies(), self.ttfts(), self.tpots()
        return {
            "num_requests": len(self.outputs), "duration_s": self.duration_s,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.output_tokens_per_s,
            "num_steps": self.num_steps, "num_preemptions": self.num_preemptions,
            "mean_ttft_ms": _mean_ms(ttft), "median_e2el_ms": _median_ms(e2e),
            "mean_e2el_ms": _mean_ms(e2e), "mean_tpot_ms": _mean_ms(tpot),
            "peak_num_requests_running": self.stats.peak_num_requests_running,
            "peak_kv_utilization": self.stats.peak_kv_utilization,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_queries": self.prefix_cache_queries,
        }


def _mean_ms(values: list[float]) -> float | None:
    return statistics.fmean(values) * 1e3 if values else None


def _median_ms(values: list[float]) -> float | None:
    return statistics.median(values) * 1e3 if values else None


def build_llm(base: EngineArgs, **overrides: Any) -> LLM:
    """A fresh LLM on `base` with some engine arguments replaced (the previous one is freed
    by the caller dropping it; collect first so two caches are never alive at once)."""
    gc.collect()
    args = dataclasses.replace(base, **overrides)
    return LLM.from_engine_args(args)


def warm_up(llm: LLM, seed: int = 12345) -> None:
    """A few short requests so that the timed run pays no first-call costs (thread pools,
    allocator growth); the step trace they leave is cleared."""
    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [_plain_token(rng, vocab) for _ in range(24)]}
               for _ in range(4)]
    llm.generate(prompts, _greedy(4))
    if llm.engine.step_trace is not None:
        llm.engine.step_trace.clear()


def run_requests(llm: LLM, requests: Requests) -> RunResult:
    """Submit every request at once, drive them to completion, time it, check for leaks."""
    engine = llm.engine
    trace_start = len(engine.step_trace) if engine.step_trace is not None else 0
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests],
                           [s for _, s in requests])
    duration = time.perf_counter() - start
    after = llm.stats()
    engine.check_integrity()
    trace = None if engine.step_trace is None else list(engine.step_trace[trace_start:])
    return RunResult(duration_s=duration, outputs=outputs, stats=after,
                     num_steps=after.num_steps - before.num_steps,
                     num_preemptions=after.num_preemptions - before.num_preemptions,
                     prefix_cache_hits=after.prefix_cache_hits - before.prefix_cache_hits,
                     prefix_cache_queries=after.prefix_cache_queries - before.prefix_cache_queries,
                     trace=trace)

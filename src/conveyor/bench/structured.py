"""`conveyor bench serve --dataset json-schema`: the same chat requests with and without
their JSON Schema, one after the other against one server, and the ratios that say what
constrained decoding costs under concurrency (issue 12's bar: output throughput >= 0.85x,
median TPOT <= 1.15x), with the server's grammar-compile time and cache hit rate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import httpx

from conveyor.bench.datasets import sample_requests
from conveyor.bench.serve import BenchmarkConfig, BenchmarkResult, run_benchmark


@dataclass(frozen=True)
class GrammarCounters:
    """The server's grammar counters over one run (GET /stats deltas)."""

    compiles: int
    cache_hits: int
    compile_seconds: float

    @property
    def mean_compile_ms(self) -> float:
        return 1e3 * self.compile_seconds / self.compiles if self.compiles else 0.0

    @property
    def cache_hit_rate(self) -> float:
        lookups = self.compiles + self.cache_hits
        return self.cache_hits / lookups if lookups else 0.0


@dataclass(frozen=True)
class StructuredComparison:
    free: BenchmarkResult  # the requests without response_format
    constrained: BenchmarkResult  # the same requests with it
    grammar: GrammarCounters | None  # None: the server has no conveyor /stats

    @property
    def output_throughput_ratio(self) -> float:
        free = self.free.metrics.output_throughput
        return self.constrained.metrics.output_throughput / free if free else 0.0

    @property
    def median_tpot_ratio(self) -> float:
        free = self.free.metrics.tpot.median_ms
        return self.constrained.metrics.tpot.median_ms / free if free else 0.0


async def _stats(config: BenchmarkConfig) -> dict[str, Any] | None:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.get(f"{config.base_url}/stats", headers=headers)
        return dict(response.json()) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _counters(before: dict[str, Any] | None, after: dict[str, Any] | None
              ) -> GrammarCounters | None:
    if before is None or after is None or "grammar_compiles" not in after:
        return None
    return GrammarCounters(
        compiles=after["grammar_compiles"] - before["grammar_compiles"],
        cache_hits=after["grammar_cache_hits"] - before["grammar_cache_hits"],
        compile_seconds=after["grammar_compile_seconds"] - before["grammar_compile_seconds"])


async def run_structured_comparison(config: BenchmarkConfig) -> StructuredComparison:
    """Unconstrained first, then constrained, on the very same requests."""
    requests = sample_requests(config.dataset)
    free = await run_benchmark(dataclasses.replace(config, constrained=False), requests)
    before = await _stats(config)
    constrained = await run_benchmark(config, requests)
    return StructuredComparison(free, constrained, _counters(before, await _stats(config)))


def format_comparison(c: StructuredComparison) -> str:
    f, s = c.free.metrics, c.constrained.metrics
    lines = [
        " Structured outputs: same requests, with / without schema ".center(60, "="),
        f"{'':32}{'free':>12}{'json_schema':>14}",
        f"{'Successful requests:':32}{f.completed:>12}{s.completed:>14}",
        f"{'Output tokens:':32}{f.total_output_tokens:>12}{s.total_output_tokens:>14}",
        f"{'Output throughput (tok/s):':32}{f.output_throughput:>12.2f}"
        f"{s.output_throughput:>14.2f}",
        f"{'Median TPOT (ms):':32}{f.tpot.median_ms:>12.2f}{s.tpot.median_ms:>14.2f}",
        f"{'Median TTFT (ms):':32}{f.ttft.median_ms:>12.2f}{s.ttft.median_ms:>14.2f}",
        f"{'Output throughput ratio:':32}{c.output_throughput_ratio:>26.3f}",
        f"{'Median TPOT ratio:':32}{c.median_tpot_ratio:>26.3f}",
    ]
    if c.grammar is not None:
        g = c.grammar
        lines += [f"{'Grammar compiles:':32}{g.compiles:>26}",
                  f"{'Mean grammar compile (ms):':32}{g.mean_compile_ms:>26.2f}",
                  f"{'Grammar cache hit rate:':32}{g.cache_hit_rate:>26.3f}"]
    return "\n".join([*lines, "=" * 60])

"""`conveyor bench serve --dataset json-schema`: the same chat requests with and without
their JSON Schema, one after the other against one server, and the ratios that say what
constrained decoding costs under concurrency (issue 12's bar: output throughput >= 0.85x,
median TPOT <= 1.15x), with the server's grammar-compile time and cache hit rate.

Three runs ("halves") on the very same requests, one after the other, in this order:

1. free: no response_format, each request up to the dataset's max_tokens;
2. constrained: with response_format. A JSON object closes and the grammar ends it, so these
   requests write fewer tokens than the free ones (which run on to max_tokens): that half
   spends more of its time with a draining batch and spreads the same prefills over fewer
   tokens, so its tok/s is lower without any step costing more;
3. free, length-matched: no response_format, each request with `max_tokens` = the tokens
   its constrained twin wrote and `ignore_eos`, so it writes exactly as many. The ratios
   constrained / length-matched isolate what the grammar costs from that length difference.

The length-matched half must come after the constrained one (it needs its token counts);
free runs first, as before this half existed, so the issue's ratios (constrained / free)
keep the order their published figures were measured in (and free warms up a fresh server).
A request that failed or was aborted in the constrained half keeps its own max_tokens in the
length-matched one (there is no count to match); that half's token total then differs from
the constrained one's, which the table shows. The counts are the server's usage
(completion_tokens), as in every half. Measure against a server without prefix caching
(`--no-enable-prefix-caching`): with it, every half after the first finds its prompts cached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from conveyor.bench.datasets import SampleRequest, sample_requests
from conveyor.bench.metrics import BenchmarkMetrics, metrics_to_dict
from conveyor.bench.serve import BenchmarkConfig, BenchmarkResult, run_benchmark


@dataclass(frozen=True)
class GrammarCounters:
    """The server's grammar counters over one run (GET /stats deltas)."""

    compiles: int
    cache_hits: int
    compile_seconds: float
    forced_tokens: int = 0  # tokens the grammars forced, verified as drafts
    forced_accepted: int = 0  # of those, kept

    @property
    def mean_compile_ms(self) -> float:
        return 1e3 * self.compile_seconds / self.compiles if self.compiles else 0.0

    @property
    def cache_hit_rate(self) -> float:
        lookups = self.compiles + self.cache_hits
        return self.cache_hits / lookups if lookups else 0.0


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


@dataclass(frozen=True)
class StructuredComparison:
    free: BenchmarkResult  # the requests without response_format
    constrained: BenchmarkResult  # the same requests with it
    matched: BenchmarkResult  # without it, each writing its constrained twin's token count
    grammar: GrammarCounters | None  # None: the server has no conveyor /stats

    @property
    def output_throughput_ratio(self) -> float:
        """Constrained / free output tok/s (issue 12's ratio)."""
        return _ratio(self.constrained.metrics.output_throughput,
                      self.free.metrics.output_throughput)

    @property
    def median_tpot_ratio(self) -> float:
        """Constrained / free median TPOT (issue 12's ratio)."""
        return _ratio(self.constrained.metrics.tpot.median_ms, self.free.metrics.tpot.median_ms)

    @property
    def matched_output_throughput_ratio(self) -> float:
        """Constrained / length-matched output tok/s: the grammar's cost alone."""
        return _ratio(self.constrained.metrics.output_throughput,
                      self.matched.metrics.output_throughput)

    @property
    def matched_median_tpot_ratio(self) -> float:
        """Constrained / length-matched median TPOT."""
        return _ratio(self.constrained.metrics.tpot.median_ms,
                      self.matched.metrics.tpot.median_ms)

    def to_dict(self) -> dict[str, Any]:
        """The JSON of `--json` / `--result-file`: each half's metrics (vLLM's keys) with its
        per-request output tokens (0 for a failed or aborted request), the ratios, the
        grammar counters."""
        return {
            "free": _half_dict(self.free),
            "constrained": _half_dict(self.constrained),
            "free_matched": _half_dict(self.matched),
            "output_throughput_ratio": self.output_throughput_ratio,
            "median_tpot_ratio": self.median_tpot_ratio,
            "matched_output_throughput_ratio": self.matched_output_throughput_ratio,
            "matched_median_tpot_ratio": self.matched_median_tpot_ratio,
            "grammar": None if self.grammar is None else dataclasses.asdict(self.grammar),
        }


def _half_dict(result: BenchmarkResult) -> dict[str, Any]:
    return {**metrics_to_dict(result.metrics),
            "output_tokens_per_request": output_tokens_per_request(result)}


def output_tokens_per_request(result: BenchmarkResult) -> list[int]:
    """Each request's output tokens, in the order sent; 0 where it failed or was aborted."""
    return [r.output_tokens if r.success and not r.aborted else 0 for r in result.records]


def length_matched(requests: Sequence[SampleRequest],
                   constrained: BenchmarkResult) -> list[SampleRequest]:
    """`requests` with max_tokens = what each one's constrained twin wrote; a twin that
    failed or was aborted (no count) leaves the request's own max_tokens."""
    tokens = output_tokens_per_request(constrained)  # run_benchmark keeps the order sent
    return [dataclasses.replace(request, output_len=n) if n > 0 else request
            for request, n in zip(requests, tokens, strict=True)]


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
        compile_seconds=after["grammar_compile_seconds"] - before["grammar_compile_seconds"],
        forced_tokens=_delta(before, after, "grammar_forced_draft_tokens"),
        forced_accepted=_delta(before, after, "grammar_forced_accepted_tokens"))


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> int:
    """A counter's growth over the run (0 from a server too old to have it)."""
    return int(after.get(key, 0) - before.get(key, 0))


async def run_structured_comparison(config: BenchmarkConfig) -> StructuredComparison:
    """Free, then constrained, then free length-matched, on the very same requests."""
    requests = sample_requests(config.dataset)
    free_config = dataclasses.replace(config, constrained=False)
    free = await run_benchmark(free_config, requests)
    before = await _stats(config)
    constrained = await run_benchmark(config, requests)
    grammar = _counters(before, await _stats(config))
    matched = await run_benchmark(dataclasses.replace(free_config, ignore_eos=True),
                                  length_matched(requests, constrained))
    return StructuredComparison(free, constrained, matched, grammar)


LABEL_WIDTH = 36
COLUMN_WIDTH = 14
HEADINGS = ("free", "json_schema", "free, matched")
TABLE_WIDTH = LABEL_WIDTH + COLUMN_WIDTH * len(HEADINGS)


def _columns(label: str, values: Sequence[float], spec: str) -> str:
    return f"{label:{LABEL_WIDTH}}" + "".join(f"{v:>{COLUMN_WIDTH}{spec}}" for v in values)


def _under_json_schema(label: str, value: float | int, spec: str) -> str:
    """A value right-aligned in the json_schema column (ratios and grammar figures)."""
    return f"{label:{LABEL_WIDTH}}{value:>{2 * COLUMN_WIDTH}{spec}}"


def format_comparison(c: StructuredComparison) -> str:
    halves: list[BenchmarkMetrics] = [c.free.metrics, c.constrained.metrics, c.matched.metrics]
    lines = [
        " Structured outputs: same requests, with / without schema ".center(TABLE_WIDTH, "="),
        f"{'':{LABEL_WIDTH}}" + "".join(f"{h:>{COLUMN_WIDTH}}" for h in HEADINGS),
        _columns("Successful requests:", [m.completed for m in halves], "d"),
        _columns("Output tokens:", [m.total_output_tokens for m in halves], "d"),
        _columns("Output throughput (tok/s):", [m.output_throughput for m in halves], ".2f"),
        _columns("Median TPOT (ms):", [m.tpot.median_ms for m in halves], ".2f"),
        _columns("Median TTFT (ms):", [m.ttft.median_ms for m in halves], ".2f"),
        _under_json_schema("Output throughput ratio:", c.output_throughput_ratio, ".3f"),
        _under_json_schema("Median TPOT ratio:", c.median_tpot_ratio, ".3f"),
        _under_json_schema("Output throughput ratio, matched:",
                           c.matched_output_throughput_ratio, ".3f"),
        _under_json_schema("Median TPOT ratio, matched:", c.matched_median_tpot_ratio, ".3f"),
    ]
    if c.grammar is not None:
        g = c.grammar
        lines += [_under_json_schema("Grammar compiles:", g.compiles, "d"),
                  _under_json_schema("Mean grammar compile (ms):", g.mean_compile_ms, ".2f"),
                  _under_json_schema("Grammar cache hit rate:", g.cache_hit_rate, ".3f"),
                  _under_json_schema("Forced tokens drafted:", g.forced_tokens, "d"),
                  _under_json_schema("Forced tokens accepted:", g.forced_accepted, "d")]
    lines.append("free, matched: max_tokens = the json_schema twin's output, ignore_eos")
    return "\n".join([*lines, "=" * TABLE_WIDTH])

"""Serving-benchmark arithmetic: per-request records → aggregate metrics, as ``vllm bench serve``.

Pure functions over hand-buildable dataclasses, so every figure the benchmark prints can be
checked in a test without a server. Times are seconds in records and milliseconds in the
latency summaries (the units of vLLM's table and result JSON).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

MS_PER_S = 1000.0
# Service-level objectives `--goodput` accepts, in milliseconds.
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
# The four latency families of the table, in the order they are printed: key → heading.
LATENCY_FAMILIES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
TABLE_WIDTH = 50
LABEL_WIDTH = 40


@dataclass
class RequestRecord:
    """What one request of the benchmark did, as the client saw it."""

    success: bool
    prompt_len: int = 0  # prompt tokens: the server's usage, else the dataset's hint
    output_tokens: int = 0  # completion tokens: the server's usage, else content chunks
    ttft: float = 0.0  # s from sending to the first chunk carrying text
    itl: list[float] = field(default_factory=list)  # s between consecutive content chunks
    latency: float = 0.0  # s from sending to the end of the stream (E2E)
    start_time: float = 0.0  # s, perf_counter when the request was sent
    end_time: float = 0.0  # s, perf_counter when its stream ended (or it failed)
    error: str | None = None  # first error message of a failed request
    aborted: bool = False  # the client cancelled it on purpose (--abort-fraction): no latency

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, in s; None for a single-token output."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class LatencyStats:
    """Summary of one latency family, in milliseconds; zeros when there is no sample."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[float, float]  # percentile (e.g. 99.0) → value


@dataclass
class BenchmarkMetrics:
    """Aggregates of one benchmark run."""

    completed: int  # successful requests
    failed: int  # requests that failed (aborted ones are not failures)
    aborted: int  # requests the client cancelled mid-stream on purpose (--abort-fraction)
    duration_s: float  # wall time from the first send to the last stream's end
    total_input_tokens: int  # over successful requests
    total_output_tokens: int
    request_throughput: float  # successful req/s
    output_throughput: float  # generated tok/s
    total_token_throughput: float  # (input + generated) tok/s
    peak_concurrency: int  # most requests in flight at one instant (failed ones included)
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    request_goodput: float | None = None  # req/s meeting every SLO; None without --goodput
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)


def latency_stats(values_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
    """Mean, median, std and the given percentiles of `values_s` (seconds), in ms."""
    if len(values_s) == 0:
        return LatencyStats(0.0, 0.0, 0.0, {float(p): 0.0 for p in percentiles})
    ms = np.asarray(values_s, dtype=np.float64) * MS_PER_S
    return LatencyStats(
        mean_ms=float(np.mean(ms)),
        median_ms=float(np.median(ms)),
        std_ms=float(np.std(ms)),
        percentiles_ms={float(p): float(np.percentile(ms, p)) for p in percentiles},
    )


def peak_concurrency(intervals: Sequence[tuple[float, float]]) -> int:
    """Most (start, end) intervals open at one instant; an end at t closes before a start at t."""
    # Sort key (time, delta): at equal times the -1 of an end sorts before the +1 of a start.
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """SLOs from `--goodput` items like "ttft:500" "tpot:50" "e2el:2000" (ms)."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(
                f"--goodput item {spec!r} must be NAME:MS with NAME one of {GOODPUT_METRICS}"
            )
        try:
            slo = float(value)
        except ValueError:
            raise ValueError(f"--goodput item {spec!r}: {value!r} is not a number of ms") from None
        if slo <= 0:
            raise ValueError(f"--goodput item {spec!r}: the SLO must be > 0 ms")
        slos[name] = slo
    return slos


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request meets every given SLO (a 1-token output has no TPOT)."""
    if not record.success:
        return False
    observed_s = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.latency}
    for name, slo in slos_ms.items():
        value = observed_s[name]
        if value is not None and value * MS_PER_S > slo:
            return False
    return True


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = (99.0,),
    goodput_slos_ms: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    """Aggregate per-request records of a run that took `duration_s` seconds.

    Aborted requests count only as aborted: no tokens, no latencies, not failed."""
    ok = [r for r in records if r.success and not r.aborted]
    aborted = sum(r.aborted for r in records)
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    rate = 1.0 / duration_s if duration_s > 0 else 0.0
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    goodput = None
    if goodput_slos_ms:
        goodput = sum(meets_slos(r, goodput_slos_ms) for r in ok) * rate
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok) - aborted,
        aborted=aborted,
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) * rate,
        output_throughput=total_out * rate,
        total_token_throughput=(total_in + total_out) * rate,
        peak_concurrency=peak_concurrency([(r.start_time, r.end_time) for r in records]),
        ttft=latency_stats([r.ttft for r in ok], percentiles),
        tpot=latency_stats(tpots, percentiles),
        itl=latency_stats([t for r in ok for t in r.itl], percentiles),
        e2el=latency_stats([r.latency for r in ok], percentiles),
        request_goodput=goodput,
        goodput_slos_ms=dict(goodput_slos_ms or {}),
    )


def _percentile_name(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def metrics_to_dict(metrics: BenchmarkMetrics) -> dict[str, Any]:
    """Flat dict with vLLM's result-JSON keys (mean_ttft_ms, p99_itl_ms, ...)."""
    out: dict[str, Any] = {
        "completed": metrics.completed,
        "failed": metrics.failed,
        "aborted": metrics.aborted,
        "duration": metrics.duration_s,
        "total_input_tokens": metrics.total_input_tokens,
        "total_output_tokens": metrics.total_output_tokens,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "goodput_slos_ms": metrics.goodput_slos_ms or None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_concurrent_requests": metrics.peak_concurrency,
    }
    for key in LATENCY_FAMILIES:
        stats: LatencyStats = getattr(metrics, key)
        out[f"mean_{key}_ms"] = stats.mean_ms
        out[f"median_{key}_ms"] = stats.median_ms
        out[f"std_{key}_ms"] = stats.std_ms
        for p, value in stats.percentiles_ms.items():
            out[f"{_percentile_name(p)}_{key}_ms"] = value
    return out


def record_to_dict(record: RequestRecord) -> dict[str, Any]:
    """One request's record as JSON-ready data (tpot included)."""
    return {**asdict(record), "tpot": record.tpot}


def _row(label: str, value: object) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<{LABEL_WIDTH}}{text:<10}"


def format_table(metrics: BenchmarkMetrics) -> str:
    """The result table in the layout of ``vllm bench serve``."""
    lines = [
        " Serving Benchmark Result ".center(TABLE_WIDTH, "="),
        _row("Successful requests:", metrics.completed),
        _row("Failed requests:", metrics.failed),
        *([_row("Aborted requests:", metrics.aborted)] if metrics.aborted else []),
        _row("Benchmark duration (s):", metrics.duration_s),
        _row("Total input tokens:", metrics.total_input_tokens),
        _row("Total generated tokens:", metrics.total_output_tokens),
        _row("Request throughput (req/s):", metrics.request_throughput),
        _row("Output token throughput (tok/s):", metrics.output_throughput),
        _row("Total Token throughput (tok/s):", metrics.total_token_throughput),
        _row("Peak concurrent requests:", metrics.peak_concurrency),
    ]
    for key, (heading, short) in LATENCY_FAMILIES.items():
        stats: LatencyStats = getattr(metrics, key)
        lines.append(f" {heading} ".center(TABLE_WIDTH, "-"))
        lines.append(_row(f"Mean {short} (ms):", stats.mean_ms))
        lines.append(_row(f"Median {short} (ms):", stats.median_ms))
        for p, value in stats.percentiles_ms.items():
            lines.append(_row(f"{_percentile_name(p).upper()} {short} (ms):", value))
    if metrics.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", metrics.request_goodput))
    lines.append("=" * TABLE_WIDTH)
    return "\n".join(lines)

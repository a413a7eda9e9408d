"""`conveyor bench compare`: one seeded workload through several engine configurations.

Three scenarios (issue 4's performance cases), each building a fresh engine per
configuration on the same weights file and workload:

- ``hol``: head-of-line blocking, continuous vs ``scheduling=static``: output tok/s and p50
  end-to-end latency;
- ``fragmentation``: ``kv_allocation=paged`` vs ``reserve`` in the same KV budget: peak
  concurrent sequences and the share of allocated KV slots holding real tokens at that peak;
- ``prefix``: a shared system prompt with prefix caching on vs off: mean time to first token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.bench.offline import Workload
from conveyor.bench.workloads import (
    HeadOfLineWorkload,
    RunResult,
    SharedPrefixWorkload,
    build_llm,
    run_requests,
    warm_up,
)
from conveyor.config import EngineArgs

SCENARIOS = ("hol", "fragmentation", "prefix")


@dataclass(frozen=True)
class CompareConfig:
    """What `bench compare` runs: the workloads and the per-scenario engine settings."""

    hol: HeadOfLineWorkload = field(default_factory=HeadOfLineWorkload)
    hol_max_num_seqs: int = 8
    fragmentation: Workload = field(default_factory=Workload)
    fragmentation_max_model_len: int = 2048
    # The shared KV budget, in max_model_len sequences: reserve holds exactly this many.
    fragmentation_budget_seqs: int = 8
    prefix: SharedPrefixWorkload = field(default_factory=SharedPrefixWorkload)
    plot_dir: str | None = None  # write the timeline / KV plots here

    def __post_init__(self) -> None:
        for name in ("hol_max_num_seqs", "fragmentation_max_model_len",
                     "fragmentation_budget_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _run(base: EngineArgs, requests_of: Any, warm: bool = True, **overrides: Any) -> RunResult:
    """Build an engine with `overrides` (step trace on), run the workload once."""
    llm = build_llm(base, step_trace=True, **overrides)
    if warm:
        warm_up(llm)
    result = run_requests(llm, requests_of.requests(llm.engine.model_config.vocab_size))
    del llm
    return result


def compare_hol(base: EngineArgs, config: CompareConfig) -> dict[str, Any]:
    """Continuous vs static batching on the head-of-line workload."""
    runs = {mode: _run(base, config.hol, max_num_seqs=config.hol_max_num_seqs, scheduling=mode)
            for mode in ("continuous", "static")}
    report: dict[str, Any] = {
        "workload": dataclasses.asdict(config.hol), "max_num_seqs": config.hol_max_num_seqs,
        "runs": {mode: r.summary() for mode, r in runs.items()}}
    c, s = report["runs"]["continuous"], report["runs"]["static"]
    report["ratios"] = {
        "output_throughput_continuous_over_static":
            _ratio(c["output_tokens_per_s"], s["output_tokens_per_s"]),
        "median_e2el_static_over_continuous": _ratio(s["median_e2el_ms"], c["median_e2el_ms"]),
        "steps_static_over_continuous": _ratio(s["num_steps"], c["num_steps"]),
    }
    if config.plot_dir:
        from conveyor.bench import plots

        traces = {mode: r.trace or [] for mode, r in runs.items()}
        report["plots"] = [
            str(plots.plot_timelines(traces, Path(config.plot_dir) / "hol_timeline.png",
                                     "Head-of-line workload: continuous vs static batching")),
            str(plots.plot_kv_usage(traces, Path(config.plot_dir) / "hol_kv_blocks.png",
                                    "KV blocks in use: continuous vs static batching"))]
    return report


def fragmentation_budget_bytes(base: EngineArgs, config: CompareConfig) -> tuple[int, int]:
    """(KV budget in bytes, bytes per token): room for `fragmentation_budget_seqs` sequences
    of `fragmentation_max_model_len` tokens, measured on the model and dtype in `base`."""
    probe = build_llm(base, max_model_len=config.fragmentation_max_model_len)
    per_token = probe.engine.kv_layout.bytes_per_token
    del probe
    tokens = config.fragmentation_budget_seqs * config.fragmentation_max_model_len
    return tokens * per_token, per_token


def compare_fragmentation(base: EngineArgs, config: CompareConfig) -> dict[str, Any]:
    """Paged vs reserve KV allocation in the same budget on the reference workload."""
    budget, per_token = fragmentation_budget_bytes(base, config)
    runs = {mode: _run(base, config.fragmentation, warm=False, kv_allocation=mode,
                       kv_cache_memory=budget, max_model_len=config.fragmentation_max_model_len)
            for mode in ("paged", "reserve")}
    report: dict[str, Any] = {
        "workload": dataclasses.asdict(config.fragmentation),
        "max_model_len": config.fragmentation_max_model_len,
        "kv_budget_bytes": budget, "kv_budget_tokens": budget // per_token,
        "runs": {mode: r.summary() for mode, r in runs.items()}}
    p, r = report["runs"]["paged"], report["runs"]["reserve"]
    report["ratios"] = {
        "peak_running_paged_over_reserve":
            _ratio(p["peak_num_requests_running"], r["peak_num_requests_running"]),
        "kv_utilization_paged_over_reserve":
            _ratio(p["peak_kv_utilization"], r["peak_kv_utilization"]),
    }
    if config.plot_dir:
        from conveyor.bench import plots

        traces = {mode: r.trace or [] for mode, r in runs.items()}
        report["plots"] = [
            str(plots.plot_kv_usage(traces, Path(config.plot_dir) / "fragmentation_kv_blocks.png",
                                    "KV blocks in use: paged vs reserve (same budget)")),
            str(plots.plot_timelines(traces, Path(config.plot_dir) /
                                     "fragmentation_timeline.png",
                                     "Reference workload: paged vs reserve KV allocation"))]
    return report


def compare_prefix(base: EngineArgs, config: CompareConfig) -> dict[str, Any]:
    """Prefix caching on vs off for a shared system prompt."""
    runs = {("on" if on else "off"): _run(base, config.prefix, enable_prefix_caching=on)
            for on in (True, False)}
    report: dict[str, Any] = {"workload": dataclasses.asdict(config.prefix),
                              "runs": {k: r.summary() for k, r in runs.items()}}
    on, off = report["runs"]["on"], report["runs"]["off"]
    report["ratios"] = {"mean_ttft_off_over_on": _ratio(off["mean_ttft_ms"], on["mean_ttft_ms"])}
    return report


_RUNNERS = {"hol": compare_hol, "fragmentation": compare_fragmentation,
            "prefix": compare_prefix}


def run_compare(base: EngineArgs, config: CompareConfig,
                scenarios: Sequence[str] = SCENARIOS) -> dict[str, Any]:
    """Every requested scenario; a JSON-ready report keyed by scenario name."""
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; known: {list(SCENARIOS)}")
    report: dict[str, Any] = {"engine": dataclasses.asdict(base)}
    for name in scenarios:
        report[name] = _RUNNERS[name](base, config)
    return report


# ---------------------------------------------------------------------- the table
def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, float) else str(value)


def _table(heading: str, columns: Sequence[str], rows: Sequence[tuple[str, str, str]],
           ratios: dict[str, Any]) -> list[str]:
    lines = [f" {heading} ".center(64, "="),
             f"{'':<34}{columns[0]:>15}{columns[1]:>15}"]
    lines += [f"{label:<34}{a:>15}{b:>15}" for label, a, b in rows]
    lines += [f"{'ratio ' + name + ':':<49}{_fmt(v):>15}" for name, v in ratios.items()]
    return lines


def format_compare(report: dict[str, Any]) -> str:
    """The comparison tables, one per scenario, with their ratios."""
    lines: list[str] = []
    if "hol" in report:
        h = report["hol"]
        c, s = h["runs"]["continuous"], h["runs"]["static"]
        lines += _table(f"Head-of-line (max_num_seqs={h['max_num_seqs']})",
                        ("continuous", "static"), [
                            ("Duration (s)", _fmt(c["duration_s"]), _fmt(s["duration_s"])),
                            ("Engine steps", _fmt(c["num_steps"]), _fmt(s["num_steps"])),
                            ("Output tokens", _fmt(c["output_tokens"]), _fmt(s["output_tokens"])),
                            ("Output throughput (tok/s)", _fmt(c["output_tokens_per_s"], ".1f"),
                             _fmt(s["output_tokens_per_s"], ".1f")),
                            ("Median E2E latency (ms)", _fmt(c["median_e2el_ms"], ".0f"),
                             _fmt(s["median_e2el_ms"], ".0f"))], h["ratios"])
    if "fragmentation" in report:
        f = report["fragmentation"]
        p, r = f["runs"]["paged"], f["runs"]["reserve"]
        lines += _table(f"Fragmentation (max_model_len={f['max_model_len']}, "
                        f"KV budget {f['kv_budget_tokens']} tokens)", ("paged", "reserve"), [
                            ("Peak concurrent sequences", _fmt(p["peak_num_requests_running"]),
                             _fmt(r["peak_num_requests_running"])),
                            ("KV slots holding tokens at peak",
                             _fmt(100 * p["peak_kv_utilization"], ".1f") + " %",
                             _fmt(100 * r["peak_kv_utilization"], ".1f") + " %"),
                            ("Preemptions", _fmt(p["num_preemptions"]),
                             _fmt(r["num_preemptions"])),
                            ("Engine steps", _fmt(p["num_steps"]), _fmt(r["num_steps"])),
                            ("Duration (s)", _fmt(p["duration_s"]), _fmt(r["duration_s"]))],
                        f["ratios"])
    if "prefix" in report:
        x = report["prefix"]
        on, off = x["runs"]["on"], x["runs"]["off"]
        lines += _table(f"Prefix caching ({x['workload']['prefix_len']}-token shared prompt)",
                        ("caching on", "caching off"), [
                            ("Mean TTFT (ms)", _fmt(on["mean_ttft_ms"], ".0f"),
                             _fmt(off["mean_ttft_ms"], ".0f")),
                            ("Prefix cache hits (tokens)", _fmt(on["prefix_cache_hits"]),
                             _fmt(off["prefix_cache_hits"])),
                            ("Engine steps", _fmt(on["num_steps"]), _fmt(off["num_steps"])),
                            ("Duration (s)", _fmt(on["duration_s"]), _fmt(off["duration_s"]))],
                        x["ratios"])
    plots = [p for name in SCENARIOS for p in report.get(name, {}).get("plots", [])]
    lines += ["=" * 64] + [f"plot: {p}" for p in plots]
    return "\n".join(lines)

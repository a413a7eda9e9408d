"""PNG plots of the benchmarks (matplotlib, Agg backend: no display needed).

- batch timeline from an engine step trace: requests as rows, steps as columns, each cell
  coloured by what the request did in that step (waiting, prefill, decode, preempted), for
  several runs side by side (static vs continuous: head-of-line blocking made visible);
- KV blocks in use over time, one line per run;
- throughput vs latency over batch sizes, with the knee marked;
- decode step time vs batch size against the memory-bound and compute-bound limits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from conveyor.bench.palette import (  # noqa: E402  (re-exported: the plots' names)
    CATEGORIES,
    DECODE,
    IDLE,
    PREEMPTED,
    PREFILL,
    STALLED,
    WAITING,
)
from conveyor.engine.stats import StepTrace  # noqa: E402

Trace = Sequence[StepTrace]

DPI = 110


def _request_order(traces: Sequence[Trace]) -> list[str]:
    """Every request id seen in the traces, numeric ids in numeric order."""
    seen: dict[str, None] = {}
    for trace in traces:
        for step in trace:
            for rid, _, _ in step.scheduled:
                seen.setdefault(rid, None)
            for rid in step.waiting:
                seen.setdefault(rid, None)
    return sorted(seen, key=lambda r: (0, int(r), r) if r.isdigit() else (1, 0, r))


def timeline_matrix(trace: Trace, requests: Sequence[str]) -> np.ndarray:
    """[len(requests), len(trace)] of categories: what each request did at each step."""
    row = {rid: i for i, rid in enumerate(requests)}
    matrix = np.full((len(requests), len(trace)), IDLE, dtype=np.int8)
    first: dict[str, int] = {}
    last_finish: dict[str, int] = {}
    for col, step in enumerate(trace):
        for rid in step.waiting:
            matrix[row[rid], col] = WAITING
        for rid, _, kind in step.scheduled:
            matrix[row[rid], col] = PREFILL if kind == "prefill" else DECODE
            first.setdefault(rid, col)
        for rid in step.preempted:
            matrix[row[rid], col] = PREEMPTED
        for rid in step.finished:
            last_finish[rid] = col
    # Between its first step and its finish, a request absent from a step was running but
    # got no tokens (the step's token budget ran out before it).
    for rid, start in first.items():
        end = last_finish.get(rid, len(trace) - 1)
        cells = matrix[row[rid], start:end + 1]
        cells[cells == IDLE] = STALLED
    return matrix


def plot_timelines(traces: Mapping[str, Trace], path: str | Path,
                   title: str = "Batch timeline") -> Path:
    """Side-by-side batch timelines of several runs of the same workload; returns the path."""
    requests = _request_order(list(traces.values()))
    colours = ListedColormap([c for _, _, c in CATEGORIES])
    widths = [max(len(t), 1) for t in traces.values()]
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 5.5), sharey=True,
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    for ax, (label, trace) in zip(axes[0], traces.items(), strict=True):
        matrix = timeline_matrix(trace, requests)
        ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap=colours,
                  vmin=0, vmax=len(CATEGORIES) - 1)
        ax.set_title(f"{label}: {len(trace)} steps")
        ax.set_xlabel("engine step")
    axes[0][0].set_ylabel("request")
    handles = [Patch(facecolor=c, edgecolor="#888888", label=name) for _, name, c in CATEGORIES]
    fig.legend(handles=handles, loc="lower center", ncol=len(CATEGORIES), fontsize="small")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return _save(fig, path)


def plot_kv_usage(traces: Mapping[str, Trace], path: str | Path,
                  title: str = "KV cache blocks in use") -> Path:
    """KV blocks used against wall time since the run's first step, one line per run."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    total = 0
    for label, trace in traces.items():
        if not trace:
            continue
        t0 = trace[0].time
        times = [s.time + s.duration - t0 for s in trace]
        ax.step(times, [s.kv_blocks_used for s in trace], where="post", label=label)
        total = max(total, trace[0].kv_blocks_total)
    if total:
        ax.axhline(total, color="#888888", linestyle="--", linewidth=1,
                   label=f"KV cache size ({total} blocks)")
    ax.set_xlabel("time since first step (s)")
    ax.set_ylabel("KV blocks in use")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_throughput_latency(points: Sequence[Mapping[str, Any]], path: str | Path,
                            knee_batch: Any, latency_key: str = "mean_tpot_ms",
                            title: str = "Throughput vs latency over max_num_seqs",
                            key: str = "max_num_seqs", label: str = "B") -> Path:
    """Output tok/s against per-token latency, one point per value of the swept setting
    `key` (max_num_seqs by default, labelled `label`=value), knee marked."""
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [p[latency_key] for p in points]
    ys = [p["output_tokens_per_s"] for p in points]
    ax.plot(xs, ys, marker="o")
    for p, x, y in zip(points, xs, ys, strict=True):
        ax.annotate(f"{label}={p[key]}", (x, y), textcoords="offset points",
                    xytext=(5, -12), fontsize="small")
    if knee_batch is not None:
        knee = next(p for p in points if p[key] == knee_batch)
        ax.scatter([knee[latency_key]], [knee["output_tokens_per_s"]], s=200,
                   facecolors="none", edgecolors="#d62728", linewidths=2,
                   label=f"knee: {label}={knee_batch}", zorder=3)
        ax.legend()
    ax.set_xlabel("mean time per output token (ms)" if latency_key == "mean_tpot_ms"
                  else latency_key)
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_roofline(rows: Sequence[Mapping[str, Any]], path: str | Path,
                  title: str = "Decode step time vs batch size") -> Path:
    """Measured decode step and bare-matmul times against the memory- and compute-bound
    limits (log-log); the bound of a step is the larger of the two limits."""
    batches = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(batches, [r["decode_step_ms"] for r in rows], marker="o", label="decode step")
    ax.plot(batches, [r["bare_matmul_ms"] for r in rows], marker="s", label="bare matmuls")
    ax.plot(batches, [r["memory_bound_ms"] for r in rows], linestyle="--",
            label="memory-bound limit (weights + KV / bandwidth)")
    ax.plot(batches, [r["compute_bound_ms"] for r in rows], linestyle=":",
            label="compute-bound limit (2·params·B / FLOP/s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (sequences decoding)")
    ax.set_ylabel("time (ms)")
    ax.set_title(title)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return _save(fig, path)


def plot_series(series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
                path: str | Path, ylabel: str, title: str) -> Path:
    """Step plots of (times, values) series against time, one line per label."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, (times, values) in series.items():
        ax.step(times, values, where="post", label=label)
    ax.set_xlabel("time since first arrival (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path

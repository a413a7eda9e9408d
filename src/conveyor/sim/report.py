"""What `conveyor simulate` prints: `bench serve`'s table and JSON keys, plus the simulation's
own figures (preemptions, KV usage and queue length over time) and the same plots."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from conveyor.bench.datasets import DatasetConfig
from conveyor.bench.metrics import BenchmarkMetrics, metrics_to_dict
from conveyor.engine.stats import StepTrace
from conveyor.sim.setup import ClientLoad
from conveyor.sim.simulator import Replica, SimRun

NUM_TIME_BUCKETS = 10  # points of the over-time figures in the report


@dataclass(frozen=True)
class SimSummary:
    """The simulation's own figures, over all replicas."""

    cost_model: dict[str, Any]  # the cost model's parameters
    num_replicas: int
    routing: str
    kv_blocks_per_replica: int
    kv_budget_gb_per_device: float
    num_steps: int
    num_preemptions: int
    num_preempted_tokens: int  # computed tokens thrown away by recompute
    num_swapped_blocks: int
    peak_num_requests_running: int  # on one replica
    num_rejected: int  # requests that can never fit (refused as the engine refuses them)
    samples_per_request: int  # n: parallel samples sharing each prompt
    mean_kv_usage: float  # share of blocks in use, averaged over steps and replicas
    peak_kv_usage: float
    mean_queue_length: float  # waiting requests per replica, averaged over steps
    peak_queue_length: int
    kv_usage_over_time: list[float]  # mean share in each of NUM_TIME_BUCKETS time slices
    queue_length_over_time: list[float]  # mean waiting requests per replica, per slice
    requests_per_replica: list[int]
    busy_share_per_replica: list[float]  # share of the run each replica spent in steps
    simulated_s: float
    wall_s: float


def _buckets(replicas: list[Replica], duration: float, attr: str, scale: float) -> list[float]:
    times = np.array([s.time for r in replicas for s in r.samples])
    values = np.array([getattr(s, attr) for r in replicas for s in r.samples], dtype=float)
    if not len(times) or duration <= 0:
        return [0.0] * NUM_TIME_BUCKETS
    index = np.minimum((times / duration * NUM_TIME_BUCKETS).astype(int), NUM_TIME_BUCKETS - 1)
    out = []
    for b in range(NUM_TIME_BUCKETS):
        chosen = values[index == b]
        out.append(float(chosen.mean()) / scale if len(chosen) else 0.0)
    return out


def summarize(run: SimRun, cost_model: dict[str, Any], routing: str,
              kv_budget_bytes: float) -> SimSummary:
    reps = run.replicas
    blocks = reps[0].scheduler.kv_cache.num_blocks
    samples = [s for r in reps for s in r.samples]
    used = [s.kv_blocks_used / blocks for s in samples] or [0.0]
    waiting = [s.num_waiting for s in samples] or [0]
    stats = [r.scheduler.stats for r in reps]
    end = max((r.clock for r in reps), default=0.0)
    return SimSummary(
        cost_model=cost_model, num_replicas=len(reps), routing=routing,
        kv_blocks_per_replica=blocks, kv_budget_gb_per_device=kv_budget_bytes / 1e9,
        num_steps=sum(s.num_steps for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_preempted_tokens=sum(s.num_preempted_tokens for s in stats),
        num_swapped_blocks=sum(s.num_swapped_blocks for s in stats),
        peak_num_requests_running=max(s.peak_running for s in stats),
        num_rejected=sum(r.record.error is not None for r in run.requests),
        samples_per_request=max((r.n for r in run.requests), default=1),
        mean_kv_usage=float(np.mean(used)), peak_kv_usage=float(max(used)),
        mean_queue_length=float(np.mean(waiting)), peak_queue_length=int(max(waiting)),
        kv_usage_over_time=_buckets(reps, end, "kv_blocks_used", blocks),
        queue_length_over_time=_buckets(reps, end, "num_waiting", 1.0),
        requests_per_replica=[sum(q.replica == r.index for q in run.requests) for r in reps],
        busy_share_per_replica=[r.busy_time / end if end else 0.0 for r in reps],
        simulated_s=run.duration_s, wall_s=run.wall_s)


def result_dict(model: str, dataset: DatasetConfig, rate: float, burstiness: float,
                metrics: BenchmarkMetrics, run: SimRun, summary: SimSummary,
                load: ClientLoad | None = None) -> dict[str, Any]:
    """`bench serve --json`'s keys (see BenchmarkResult.to_dict), plus "simulation";
    `load` None: bench serve's defaults with --ignore-eos."""
    load = load or ClientLoad(ignore_eos=True)
    first_error = next((r.error for r in run.records if r.error is not None), None)
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "simulate",
        "base_url": None,
        "endpoint": "/v1/completions",
        "model_id": model,
        "dataset_name": dataset.name,
        "num_prompts": len(run.requests),
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": burstiness,
        "max_concurrency": load.max_concurrency,
        "ignore_eos": load.ignore_eos,
        "abort_fraction": load.abort_fraction,
        "n": load.n,
        **metrics_to_dict(metrics),
        "first_error": first_error,
        # record_to_dict's keys, without its deep copy (thousands of ITL lists)
        "requests": [{**vars(r), "itl": list(r.itl), "tpot": r.tpot} for r in run.records],
        "simulation": asdict(summary),
    }


def _series(values: list[float], fmt: str) -> str:
    return " ".join(format(v, fmt) for v in values)


def format_summary(s: SimSummary) -> str:
    """The simulation's section under `bench serve`'s table."""
    cost = s.cost_model
    where = (f"{cost['device']} x{cost['tp']}" if cost["cost_model"] == "roofline"
             else f"profile of {cost['model']} on {cost['machine']}")
    lines = [
        " Simulation ".center(50, "-"),
        f"{'Cost model:':<40}{cost['cost_model']} ({where})",
        f"{'Replicas (routing):':<40}{s.num_replicas} ({s.routing})",
        f"{'KV blocks per replica:':<40}{s.kv_blocks_per_replica}",
        f"{'Rejected requests (never fit):':<40}{s.num_rejected}",
        f"{'Engine steps:':<40}{s.num_steps}",
        f"{'Preemptions:':<40}{s.num_preemptions}",
        f"{'Tokens recomputed after preemption:':<40}{s.num_preempted_tokens}",
        f"{'Peak running requests (one replica):':<40}{s.peak_num_requests_running}",
        f"{'KV usage mean / peak (%):':<40}{s.mean_kv_usage:.0%} / {s.peak_kv_usage:.0%}",
        f"{'Queue length mean / peak:':<40}{s.mean_queue_length:.1f} / {s.peak_queue_length}",
        f"KV usage over time (% per tenth of the run): "
        f"{_series([100 * v for v in s.kv_usage_over_time], '.0f')}",
        f"Queue length over time (per tenth): {_series(s.queue_length_over_time, '.1f')}",
        f"{'Simulated / wall time (s):':<40}{s.simulated_s:.1f} / {s.wall_s:.2f}",
        "=" * 50,
    ]
    return "\n".join(lines)


def _timeline_trace(trace: list[StepTrace]) -> list[StepTrace]:
    """The steps up to the last one any traced request appears in."""
    last = max((i for i, s in enumerate(trace)
                if s.scheduled or s.waiting or s.preempted or s.finished), default=-1)
    return trace[:last + 1]


def write_plots(run: SimRun, plot_dir: str) -> list[str]:
    """The batch timeline (first replica, traced requests), KV blocks and queue over time."""
    from conveyor.bench import plots

    out = Path(plot_dir)
    reps = run.replicas
    names = {r.index: f"replica {r.index}" if len(reps) > 1 else "simulated" for r in reps}
    paths = [plots.plot_timelines({names[0]: _timeline_trace(reps[0].trace or [])},
                                  out / "simulate_timeline.png",
                                  "Simulated batch timeline (first requests)"),
             plots.plot_kv_usage({names[r.index]: r.trace or [] for r in reps},
                                 out / "simulate_kv_usage.png", "Simulated KV blocks in use"),
             plots.plot_series({names[r.index]: ([s.time for s in r.samples],
                                                 [s.num_waiting for s in r.samples])
                                for r in reps}, out / "simulate_queue.png",
                               "waiting requests", "Simulated queue length")]
    return [str(p) for p in paths]

"""`conveyor bench sweep`: throughput vs latency over ``max_num_seqs``, and the roofline.

For each batch cap the same seeded workload runs through a fresh engine; the curve of output
throughput against mean time per output token shows where a bigger batch stops being free:
the knee is the first cap after which doubling the batch buys less than `knee_gain` more
throughput. A second measurement times a decode step at each batch size against the
machine's limits: the memory-bound time (weights + KV read once, at the measured copy
bandwidth) and the compute-bound time (2 FLOPs per parameter per sequence, at the measured
matmul FLOP/s in the engine's dtype).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.bench.offline import Workload, bare_matmul_time, decode_step_time
from conveyor.bench.workloads import build_llm, run_requests, warm_up
from conveyor.config import EngineArgs
from conveyor.engine.llm import LLM
from conveyor.planner.measure import matmul_flops_per_s, memory_bandwidth_bytes_per_s

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
KNEE_GAIN = 0.15  # doubling the batch must buy at least this much more throughput
PROBE_BUDGET_S = 0.3  # per machine probe (bandwidth, FLOP/s): best run within this time


@dataclass(frozen=True)
class SweepConfig:
    workload: Workload = dataclasses.field(default_factory=lambda: Workload(num_requests=32))
    batches: tuple[int, ...] = DEFAULT_BATCHES
    knee_gain: float = KNEE_GAIN
    roofline_batches: tuple[int, ...] = DEFAULT_BATCHES
    roofline_context_len: int = 128  # tokens of context per decoding sequence
    plot_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches must be positive integers, got {list(self.batches)}")
        if self.roofline_batches and min(self.roofline_batches) < 1:
            raise ValueError("roofline_batches must be positive integers, "
                             f"got {list(self.roofline_batches)}")
        if not 0 < self.knee_gain < 1:
            raise ValueError(f"knee_gain must be in (0, 1), got {self.knee_gain}")


def find_knee(points: Sequence[dict[str, Any]], knee_gain: float = KNEE_GAIN,
              key: str = "max_num_seqs") -> Any:
    """The batch cap after which more batch stops being free: the first point whose next
    point (more sequences) gains less than `knee_gain` per doubling of the cap. None if
    every step up still pays (or there are fewer than two points). `key` names the swept
    setting (any positive number: a batch cap, a request rate)."""
    ordered = sorted(points, key=lambda p: p[key])
    for a, b in zip(ordered, ordered[1:], strict=False):
        doublings = math.log2(b[key] / a[key])
        gain = b["output_tokens_per_s"] / a["output_tokens_per_s"] - 1
        if gain < knee_gain * doublings:
            return a[key]
    return None


def roofline(llm: LLM, batches: Sequence[int], context_len: int) -> dict[str, Any]:
    """Decode step and bare-matmul times per batch size, with the two limits."""
    engine = llm.engine
    device, dtype = engine.device, engine.dtype
    bandwidth = memory_bandwidth_bytes_per_s(PROBE_BUDGET_S, str(device))
    flops = matmul_flops_per_s(PROBE_BUDGET_S, str(device), str(dtype).removeprefix("torch."))
    params = engine.model_config.num_parameters()
    weight_bytes = engine.runner.model.decode_weight_bytes()  # GGUF blocks where read
    kv_per_token = engine.kv_layout.bytes_per_token
    rows = []
    for batch in batches:
        step = decode_step_time(llm, batch, context_len=context_len)
        matmul = bare_matmul_time(llm, batch)
        rows.append({
            "batch": batch, "decode_step_ms": step * 1e3, "bare_matmul_ms": matmul * 1e3,
            "memory_bound_ms": (weight_bytes + batch * context_len * kv_per_token)
            / bandwidth * 1e3,
            "compute_bound_ms": 2 * params * batch / flops * 1e3,
        })
    engine.check_integrity()
    # Where 2·params·B / FLOP/s overtakes weight bytes / bandwidth (KV reads left out).
    ridge = flops * weight_bytes / (2 * params * bandwidth)
    return {"bandwidth_gb_s": bandwidth / 1e9, "matmul_tflop_s": flops / 1e12,
            "dtype": str(dtype).removeprefix("torch."), "num_parameters": params,
            "weight_bytes": weight_bytes, "context_len": context_len,
            "compute_bound_batch": ridge, "rows": rows}


def run_sweep(base: EngineArgs, config: SweepConfig) -> dict[str, Any]:
    """The sweep over batch caps, the knee, the roofline, and the plots if asked."""
    points = []
    for batch in sorted(set(config.batches)):
        llm = build_llm(base, max_num_seqs=batch)
        warm_up(llm)
        result = run_requests(llm, config.workload.requests(llm.engine.model_config.vocab_size))
        points.append({"max_num_seqs": batch, **result.summary()})
        del llm
    knee = find_knee(points, config.knee_gain)
    report: dict[str, Any] = {"workload": dataclasses.asdict(config.workload),
                              "knee_gain": config.knee_gain, "knee_max_num_seqs": knee,
                              "points": points}
    if config.roofline_batches:
        llm = build_llm(base, max_num_seqs=max(max(config.roofline_batches), 1))
        warm_up(llm)
        report["roofline"] = roofline(llm, sorted(set(config.roofline_batches)),
                                      config.roofline_context_len)
        del llm
    if config.plot_dir:
        from conveyor.bench import plots

        out = Path(config.plot_dir)
        report["plots"] = [str(plots.plot_throughput_latency(
            points, out / "sweep_throughput_latency.png", knee))]
        if "roofline" in report:
            report["plots"].append(str(plots.plot_roofline(
                report["roofline"]["rows"], out / "sweep_roofline.png",
                f"Decode step time vs batch size ({report['roofline']['dtype']}, "
                f"{config.roofline_context_len}-token contexts)")))
    return report


def format_sweep(report: dict[str, Any]) -> str:
    lines = [" Sweep over max_num_seqs ".center(78, "="),
             f"{'max_num_seqs':>12}{'out tok/s':>12}{'mean TPOT ms':>14}{'mean E2E ms':>14}"
             f"{'mean TTFT ms':>14}{'peak run':>10}"]
    for p in report["points"]:
        lines.append(f"{p['max_num_seqs']:>12}{p['output_tokens_per_s']:>12.1f}"
                     f"{p['mean_tpot_ms'] or 0:>14.1f}{p['mean_e2el_ms'] or 0:>14.0f}"
                     f"{p['mean_ttft_ms'] or 0:>14.0f}{p['peak_num_requests_running']:>10}")
    knee = report["knee_max_num_seqs"]
    lines.append(f"knee (doubling buys < {report['knee_gain']:.0%} throughput after): "
                 f"{'none' if knee is None else f'max_num_seqs={knee}'}")
    if "roofline" in report:
        r = report["roofline"]
        lines += [" Decode step vs machine limits ".center(78, "-"),
                  f"measured: copy bandwidth {r['bandwidth_gb_s']:.1f} GB/s, "
                  f"{r['dtype']} matmul {r['matmul_tflop_s'] * 1e3:.0f} GFLOP/s; "
                  f"decode turns compute-bound near B={r['compute_bound_batch']:.0f}",
                  f"{'batch':>6}{'decode step ms':>16}{'matmuls ms':>12}"
                  f"{'memory-bound ms':>17}{'compute-bound ms':>18}"]
        for row in r["rows"]:
            lines.append(f"{row['batch']:>6}{row['decode_step_ms']:>16.1f}"
                         f"{row['bare_matmul_ms']:>12.1f}{row['memory_bound_ms']:>17.1f}"
                         f"{row['compute_bound_ms']:>18.2f}")
    lines += ["=" * 78] + [f"plot: {p}" for p in report.get("plots", [])]
    return "\n".join(lines)

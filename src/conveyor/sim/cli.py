"""``conveyor simulate``: the engine's scheduler on a step cost model, under `bench serve`'s load.

    conveyor simulate --model llama-3-8b --device H100-80GB --dataset skewed \\
        --request-rate 8 --num-prompts 2000 --max-num-seqs 128
    conveyor bench profile --output prof.json
    conveyor simulate --cost-model measured --profile prof.json --request-rate 4 ...
    conveyor simulate ... --sweep max_num_seqs=8,16,32,64

Takes `bench serve`'s dataset, load, client and output flags and the engine arguments, and
prints `bench serve`'s report (or its --json keys) for the simulated run, plus the
simulation's own figures. With --ignore-eos requests end at their dataset output length (as
`bench serve --ignore-eos`); without it, at an EOS whose position is drawn from the dataset's
output lengths.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from conveyor.bench import serve_cli
from conveyor.bench.metrics import compute_metrics, format_table, parse_goodput
from conveyor.cli.engine_args import add_engine_args, parse_engine_override
from conveyor.config import EngineArgs
from conveyor.sim.report import format_summary, result_dict, summarize, write_plots
from conveyor.sim.setup import (
    COST_MODELS,
    ClientLoad,
    CostSettings,
    build_plan,
    build_requests,
    resolve_model,
)
from conveyor.sim.simulator import ROUTING_POLICIES, simulate

# Engine arguments that mean nothing to a simulation, or whose flag means something else here
# (--device is a device preset, --seed seeds the workload as in `bench serve`, --tp replaces
# --tensor-parallel-size).
_SKIPPED = ("model", "device", "seed", "tokenizer", "load_format", "served_model_name",
            "step_trace", "quantized_matmuls", "int8_activations", "amx_matmuls",
            "kv_cache_memory", "tensor_parallel_size")  # --tp: the simulated devices
DEFAULT_TIMELINE_REQUESTS = 64
SWEEP_RATE = "request_rate"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate", help="the scheduler on a step cost model: bench serve's report in seconds",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--model", default=None,
                     help="a model preset (as `conveyor plan`), or a model file/folder "
                          "(default: the profile's model, else the default model)")
    sim.add_argument("--cost-model", choices=COST_MODELS, default="roofline")
    sim.add_argument("--device", default=None, help="roofline: a device preset, e.g. H100-80GB")
    sim.add_argument("--tp", type=int, default=1, help="roofline: tensor-parallel devices")
    sim.add_argument("--link", default=None,
                     help="roofline: device link preset for --tp (default: the device's)")
    sim.add_argument("--step-overhead-ms", type=float, default=1.0,
                     help="roofline: fixed cost of every step (scheduling, launches)")
    sim.add_argument("--activation-reserve", type=float, default=0.05,
                     help="roofline: device memory kept from the KV cache (fraction, or bytes)")
    sim.add_argument("--kv-cache-memory", default=None,
                     help="KV budget per device (default: what a device preset leaves after "
                          "weights and reserve; the engine's 1GiB with a profile)")
    sim.add_argument("--profile", default=None, help="measured: `conveyor bench profile` file")
    sim.add_argument("--replicas", type=int, default=1, help="engines behind a router")
    sim.add_argument("--routing", choices=ROUTING_POLICIES, default="round-robin")
    sim.add_argument("--sweep", default=None, metavar="NAME=V1,V2,...",
                     help="run once per value of an engine argument or request_rate")
    sim.add_argument("--plot-dir", default=None, help="write the PNG plots here")
    sim.add_argument("--timeline-requests", type=int, default=DEFAULT_TIMELINE_REQUESTS,
                     help="requests shown in the timeline plot")
    serve_cli.add_client_arguments(serve_cli.add_load_arguments(parser))
    serve_cli.add_dataset_arguments(parser)
    serve_cli.add_output_arguments(parser)
    add_engine_args(parser, skip=_SKIPPED)


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """The parsed command line, resolved once for every run of a sweep."""

    settings: CostSettings
    engine_args: EngineArgs
    rate: float
    load: ClientLoad
    args: argparse.Namespace


def _check_load(rate: float, burstiness: float) -> None:
    """As `bench serve` checks them: NaN, zero and negative rates are refused."""
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")


def _inputs(args: argparse.Namespace) -> _Inputs:
    _check_load(args.request_rate, args.burstiness)
    settings = CostSettings(
        cost_model=args.cost_model, device=args.device, tp=args.tp, link=args.link,
        step_overhead_ms=args.step_overhead_ms, activation_reserve=args.activation_reserve,
        profile=args.profile)
    values = {f: getattr(args, f) for f in EngineArgs.field_names() if f not in _SKIPPED}
    load = ClientLoad(ignore_eos=args.ignore_eos, n=args.n, abort_fraction=args.abort_fraction,
                      max_concurrency=args.max_concurrency)
    return _Inputs(settings, EngineArgs(**values), args.request_rate, load, args)


def run_once(inputs: _Inputs, model: Any, engine_args: EngineArgs, rate: float,
             trace: bool) -> dict[str, Any]:
    """One simulated benchmark: its result dict (bench serve's keys plus "simulation")."""
    args = inputs.args
    plan = build_plan(inputs.settings, model, engine_args, args.kv_cache_memory)
    dataset = serve_cli.dataset_from_args(args)
    requests = build_requests(dataset, model, rate, args.burstiness, args.seed, inputs.load)
    trace_ids = frozenset(r.request_id for r in requests[:args.timeline_requests]) \
        if trace else None
    run = simulate(plan.setup, plan.cost, requests, args.replicas, args.routing, trace_ids,
                   inputs.load.max_concurrency)
    metrics = compute_metrics(run.records, run.duration_s,
                              serve_cli.parse_percentiles(args.metric_percentiles),
                              parse_goodput(args.goodput or []))
    summary = summarize(run, plan.cost.describe(), args.routing, plan.kv_budget_bytes)
    result = result_dict(model.name, dataset, rate, args.burstiness, metrics, run, summary,
                         inputs.load)
    if trace:
        result["plots"] = write_plots(run, args.plot_dir)
    result["_table"] = format_table(metrics) + "\n" + format_summary(summary)
    return result


def _model_for(inputs: _Inputs) -> Any:
    name = inputs.args.model
    if name is None and inputs.settings.cost_model == "measured":
        from conveyor.sim.cost import Profile

        name = Profile.load(inputs.settings.profile or "").model_path
    return resolve_model(name)


def run(args: argparse.Namespace) -> int:
    inputs = _inputs(args)
    model = _model_for(inputs)
    if args.sweep:
        report = run_sweep(inputs, model, args.sweep)
        text = format_sweep(report)
    else:
        report = run_once(inputs, model, inputs.engine_args, inputs.rate, bool(args.plot_dir))
        text = report.pop("_table")
        if report.get("plots"):
            text += "\n" + "\n".join(f"plot: {p}" for p in report["plots"])
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2) if args.json else text)
    return 0


# ---------------------------------------------------------------------------- sweep
def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """"name=v1,v2,..." -> (an EngineArgs field or request_rate, typed values)."""
    name, sep, raw = text.partition("=")
    name = name.strip().replace("-", "_")
    items = [v.strip() for v in raw.split(",") if v.strip()]
    if not sep or not items:
        raise ValueError(f"--sweep must be NAME=V1,V2,... got {text!r}")
    if name == SWEEP_RATE:
        try:
            rates = [float(v) for v in items]
        except ValueError:
            raise ValueError(f"--sweep request_rate takes numbers, got {raw!r}") from None
        for rate in rates:
            _check_load(rate, 1.0)
        return name, rates
    if name in _SKIPPED:
        raise ValueError(f"--sweep: {name} cannot be swept in a simulation")
    return name, [parse_engine_override(f"{name}={v}")[1] for v in items]


SWEEP_KEYS = ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms",
              "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms", "completed", "failed")


def run_sweep(inputs: _Inputs, model: Any, spec: str) -> dict[str, Any]:
    """One simulation per value; the points, the knee (numeric settings) and the plot."""
    from conveyor.bench.sweep import KNEE_GAIN, find_knee

    name, values = parse_sweep(spec)
    points = []
    for value in values:
        rate = value if name == SWEEP_RATE else inputs.rate
        engine_args = inputs.engine_args if name == SWEEP_RATE else \
            dataclasses.replace(inputs.engine_args, **{name: value})
        result = run_once(inputs, model, engine_args, rate, trace=False)
        sim = result["simulation"]
        points.append({name: value, **{k: result.get(k) or 0.0 for k in SWEEP_KEYS},
                       "output_tokens_per_s": result["output_throughput"],
                       "num_preemptions": sim["num_preemptions"],
                       "peak_kv_usage": sim["peak_kv_usage"]})
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0
                  and math.isfinite(v) for v in values)
    knee = find_knee(points, KNEE_GAIN, key=name) if numeric and len(points) > 1 else None
    report: dict[str, Any] = {"sweep": name, "knee_gain": KNEE_GAIN, "knee": knee,
                              "points": points}
    if inputs.args.plot_dir and numeric:
        from pathlib import Path

        from conveyor.bench import plots

        report["plots"] = [str(plots.plot_throughput_latency(
            points, Path(inputs.args.plot_dir) / f"simulate_sweep_{name}.png", knee,
            title=f"Simulated throughput vs latency over {name}", key=name, label=name))]
    return report


def format_sweep(report: dict[str, Any]) -> str:
    name = report["sweep"]
    lines = [f" Simulated sweep over {name} ".center(96, "="),
             f"{name:>22}{'out tok/s':>11}{'req/s':>8}{'TTFT mean':>10}{'TTFT p99':>10}"
             f"{'TPOT mean':>11}{'TPOT p99':>10}{'preempt':>9}{'peak KV':>9}"]
    for p in report["points"]:
        lines.append(f"{p[name]!s:>22}{p['output_tokens_per_s']:>11.1f}"
                     f"{p['request_throughput']:>8.2f}{p['mean_ttft_ms']:>10.0f}"
                     f"{p['p99_ttft_ms']:>10.0f}{p['mean_tpot_ms']:>11.1f}"
                     f"{p['p99_tpot_ms']:>10.1f}{p['num_preemptions']:>9}"
                     f"{p['peak_kv_usage']:>9.0%}")
    knee = report["knee"]
    lines.append(f"knee (doubling buys < {report['knee_gain']:.0%} throughput after): "
                 f"{'none' if knee is None else f'{name}={knee}'}")
    lines += ["=" * 96] + [f"plot: {p}" for p in report.get("plots", [])]
    return "\n".join(lines)

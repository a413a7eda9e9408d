"""`conveyor bench`: offline throughput, serving load, comparisons, sweeps and the step
cost profile of `conveyor simulate`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from conveyor.bench import serve_cli
from conveyor.cli.engine_args import add_engine_args, engine_args_from, parse_engine_override

# bench sweep's default max_num_seqs values (and decode batch sizes of its roofline).
_SWEEP_BATCHES = (1, 2, 4, 8, 16, 32, 64)


class LengthRange(argparse.Action):
    """MIN MAX lengths (each positive_int): MIN may not be above MAX."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        low, high = values
        if low > high:
            parser.error(f"argument {option_string}: MIN {low} is above MAX {high}")
        setattr(namespace, self.dest, values)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a request count)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    offline = sub.add_parser("offline", help="a seeded workload through LLM.generate")
    offline.add_argument("--num-requests", type=positive_int, default=None,
                         help="default: the workload's (64; nano-vllm: 256)")
    offline.add_argument("--workload-seed", type=int, default=0)
    offline.add_argument("--workload", choices=("reference", "grounded", "nano-vllm"),
                         default="reference",
                         help="reference: random prompts, fixed output lengths; grounded: "
                              "chat requests to repeat, correct or reformat a passage of "
                              "their prompt (greedy, real EOS), what speculation serves; "
                              "nano-vllm: its benchmark, 256 requests with prompt and output "
                              "lengths uniform in 100-1024 (ignore_eos)")
    offline.add_argument("--no-warmup", dest="warmup", action="store_false",
                         help="skip the untimed warm-up run of each engine")
    offline.add_argument("--roofline-batches", type=int, nargs="*", default=[1, 16, 64])
    offline.add_argument("--against-reference-ops", action="store_true",
                         help="also run the workload with the torch reference ops instead of "
                              "the C++ kernels (a second engine) and print the ratio")
    offline.add_argument("--against", action="append", default=[], metavar="NAME=VALUE",
                         help="also run the workload and the decode-step timing on a second "
                              "engine with this engine argument changed (repeatable), e.g. "
                              "--against kv_cache_dtype=auto, and print the ratios")
    offline.add_argument("--rounds", type=positive_int, default=1,
                         help="run the workload this many times on each engine, the engines "
                              "in turn with --against (A, B, A, B, ...), and report totals: "
                              "on a machine whose speed drifts, both sides of the ratio then "
                              "see the same conditions")
    offline.add_argument("--json", action="store_true", help="print the JSON result only")
    offline.add_argument("--result-file", default=None, help="write the JSON result here")
    add_engine_args(offline)
    offline.set_defaults(func=run_offline_cmd)
    serve_cli.register(sub)
    http = sub.add_parser("http", help="the reference workload offline and through "
                          "`conveyor serve` in one run: the server's throughput cost")
    http.add_argument("--num-requests", type=positive_int, default=64)
    http.add_argument("--workload-seed", type=int, default=0)
    http.add_argument("--json", action="store_true", help="print the JSON result only")
    http.add_argument("--result-file", default=None, help="write the JSON result here")
    add_engine_args(http)
    http.set_defaults(func=run_http_cmd)
    _register_compare(sub)
    _register_sweep(sub)
    _register_profile(sub)
    _register_web(sub)


def run_offline_cmd(args: argparse.Namespace) -> int:
    from conveyor.bench.grounded import GroundedWorkload
    from conveyor.bench.offline import WORKLOADS, format_offline, run_offline
    from conveyor.engine.llm import LLM

    engine_args = engine_args_from(args)
    overrides = dict(parse_engine_override(text) for text in args.against)
    llm = LLM.from_engine_args(engine_args)
    reference = LLM.from_engine_args(engine_args) if args.against_reference_ops else None
    against = (LLM.from_engine_args(engine_args_from(args, **overrides)), args.against) \
        if overrides else None
    base = GroundedWorkload() if args.workload == "grounded" else WORKLOADS[args.workload]
    workload = replace(base, num_requests=args.num_requests or base.num_requests,
                       seed=args.workload_seed)
    # The roofline times rank 0's bare matmuls alone: at TP > 1 its LM head's all-gather
    # would wait for ranks that are not running them.
    roofline = tuple(args.roofline_batches) if engine_args.tensor_parallel_size == 1 else ()
    report = run_offline(llm, workload, roofline, warmup=args.warmup,
                         reference_llm=reference, against=against, rounds=args.rounds)
    _emit(report, args, format_offline)
    return 0


def run_http_cmd(args: argparse.Namespace) -> int:
    from conveyor.bench.http_overhead import format_http_overhead, run_http_overhead
    from conveyor.bench.offline import Workload

    report = run_http_overhead(engine_args_from(args),
                               Workload(num_requests=args.num_requests, seed=args.workload_seed))
    _emit(report, args, format_http_overhead)
    return 0


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the JSON result only")
    parser.add_argument("--result-file", default=None, help="write the JSON result here")
    parser.add_argument("--plot-dir", default=None, help="write the PNG plots here")


def _register_compare(sub: argparse._SubParsersAction) -> None:
    # Workload flags default to None = the workload dataclass's own default, so that building
    # the parser imports no torch (`conveyor plan` must not pay for it).
    p = sub.add_parser("compare", help="one workload through several engine configurations: "
                       "continuous vs static, paged vs reserve, prefix caching on vs off")
    p.add_argument("--scenario", choices=("hol", "fragmentation", "prefix", "all"),
                   default="all")
    p.add_argument("--workload-seed", type=int, default=0)
    pair = {"type": positive_int, "nargs": 2, "metavar": ("MIN", "MAX"), "action": LengthRange}
    g = p.add_argument_group("head-of-line scenario, continuous vs static "
                             "(defaults: 64 requests, prompts 16-64, outputs 20 / 500)")
    g.add_argument("--hol-num-requests", type=positive_int)
    g.add_argument("--hol-prompt-len", **pair)
    g.add_argument("--hol-short-output", type=positive_int)
    g.add_argument("--hol-long-output", type=positive_int)
    g.add_argument("--hol-group", type=positive_int, help="one long request in every GROUP (8)")
    g.add_argument("--hol-max-num-seqs", type=positive_int, default=8)
    g = p.add_argument_group("fragmentation scenario, paged vs reserve "
                             "(defaults: the 64-request reference workload of bench offline)")
    g.add_argument("--frag-num-requests", type=positive_int)
    g.add_argument("--frag-max-model-len", type=positive_int, default=2048)
    g.add_argument("--frag-budget-seqs", type=positive_int, default=8,
                   help="KV budget in sequences of --frag-max-model-len tokens (default: 8)")
    g.add_argument("--frag-prompt-len", **pair)
    g.add_argument("--frag-short-output", **pair)
    g.add_argument("--frag-long-output", type=positive_int)
    g = p.add_argument_group("prefix-caching scenario, on vs off "
                             "(defaults: 64 requests, 500-token shared prompt)")
    g.add_argument("--prefix-num-requests", type=positive_int)
    g.add_argument("--prefix-len", type=positive_int, help="tokens of the shared system prompt")
    g.add_argument("--prefix-suffix-len", **pair)
    g.add_argument("--prefix-output-len", type=positive_int)
    _add_output_args(p)
    add_engine_args(p)
    p.set_defaults(func=run_compare_cmd)


def _given(args: argparse.Namespace, **flags: str) -> dict[str, Any]:
    """{field: value} of the flags given on the command line (pairs become tuples)."""
    out = {}
    for name, flag in flags.items():
        value = getattr(args, flag)
        if value is not None:
            out[name] = tuple(value) if isinstance(value, list) else value
    return out


def run_compare_cmd(args: argparse.Namespace) -> int:
    from conveyor.bench.compare import SCENARIOS, CompareConfig, format_compare, run_compare
    from conveyor.bench.offline import Workload
    from conveyor.bench.workloads import HeadOfLineWorkload, SharedPrefixWorkload

    seed = args.workload_seed
    config = CompareConfig(
        hol=HeadOfLineWorkload(seed=seed, **_given(
            args, num_requests="hol_num_requests", prompt_len="hol_prompt_len",
            short_output="hol_short_output", long_output="hol_long_output", group="hol_group")),
        hol_max_num_seqs=args.hol_max_num_seqs,
        fragmentation=Workload(seed=seed, **_given(
            args, num_requests="frag_num_requests", prompt_len="frag_prompt_len",
            short_output="frag_short_output", long_output="frag_long_output")),
        fragmentation_max_model_len=args.frag_max_model_len,
        fragmentation_budget_seqs=args.frag_budget_seqs,
        prefix=SharedPrefixWorkload(seed=seed, **_given(
            args, num_requests="prefix_num_requests", prefix_len="prefix_len",
            suffix_len="prefix_suffix_len", output_len="prefix_output_len")),
        plot_dir=args.plot_dir)
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    report = run_compare(engine_args_from(args), config, scenarios)
    _emit(report, args, format_compare)
    return 0


def _register_sweep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="throughput vs latency over max_num_seqs (knee), and "
                       "decode step time vs batch size against the roofline")
    p.add_argument("--batches", type=int, nargs="+", default=list(_SWEEP_BATCHES),
                   help="max_num_seqs values to run the workload at")
    p.add_argument("--knee-gain", type=float, default=0.15,
                   help="the knee: doubling the batch buys less than this share of throughput")
    p.add_argument("--roofline-batches", type=int, nargs="*", default=list(_SWEEP_BATCHES),
                   help="batch sizes of the decode-step measurement (none: skip it)")
    p.add_argument("--roofline-context-len", type=positive_int, default=128)
    p.add_argument("--num-requests", type=positive_int, default=32)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--prompt-len", type=positive_int, nargs=2, metavar=("MIN", "MAX"),
                   default=[50, 300], action=LengthRange)
    p.add_argument("--short-output", type=positive_int, nargs=2, metavar=("MIN", "MAX"),
                   default=[16, 64], action=LengthRange)
    p.add_argument("--long-output", type=positive_int, default=256)
    _add_output_args(p)
    add_engine_args(p)
    p.set_defaults(func=run_sweep_cmd)


def run_sweep_cmd(args: argparse.Namespace) -> int:
    from conveyor.bench.offline import Workload
    from conveyor.bench.sweep import SweepConfig, format_sweep, run_sweep

    config = SweepConfig(
        workload=Workload(num_requests=args.num_requests, prompt_len=tuple(args.prompt_len),
                          short_output=tuple(args.short_output), long_output=args.long_output,
                          seed=args.workload_seed),
        batches=tuple(args.batches), knee_gain=args.knee_gain,
        roofline_batches=tuple(args.roofline_batches),
        roofline_context_len=args.roofline_context_len, plot_dir=args.plot_dir)
    report = run_sweep(engine_args_from(args), config)
    _emit(report, args, format_sweep)
    return 0


def _register_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="time engine steps over a grid of shapes and fit the "
                       "step cost model of `conveyor simulate --cost-model measured`")
    from conveyor.sim.profile import ProfileGrid

    grid = ProfileGrid()
    p.add_argument("--output", required=True, help="the profile file (JSON) to write")
    p.add_argument("--batches", type=int, nargs="+", default=list(grid.batches),
                   help="decode batch sizes")
    p.add_argument("--context-lens", type=int, nargs="+", default=list(grid.context_lens),
                   help="context tokens of the decoding sequences")
    p.add_argument("--prefill-tokens", type=int, nargs="+", default=list(grid.prefill_tokens),
                   help="prompt tokens computed alongside the decodes")
    p.add_argument("--steps", type=int, default=grid.steps, help="timed decode steps per point")
    p.add_argument("--idle-gap", type=float, default=grid.idle_gap_s,
                   help="seconds without a step before the lone prefills that price the "
                        "first step after an idle spell (0: not measured)")
    p.add_argument("--serve-batches", type=int, nargs="+", default=[1, 8, 32],
                   help="the server's terms: streamed requests sent at once through a short "
                        "real `conveyor serve` run (1: lone requests)")
    p.add_argument("--no-serve", action="store_true",
                   help="time the engine only (no server terms: `simulate` then predicts "
                        "an engine without its HTTP server's per-token work)")
    add_engine_args(p)
    p.set_defaults(func=run_profile_cmd)


def run_profile_cmd(args: argparse.Namespace) -> int:
    from conveyor.sim.profile import ProfileGrid, ServeGrid, format_profile, run_profile

    grid = ProfileGrid(batches=tuple(args.batches), context_lens=tuple(args.context_lens),
                       prefill_tokens=tuple(args.prefill_tokens), steps=args.steps,
                       idle_gap_s=args.idle_gap)
    serve = None if args.no_serve else ServeGrid(batches=tuple(args.serve_batches))
    profile = run_profile(engine_args_from(args), grid, serve)
    profile.save(args.output)
    print(format_profile(profile, args.output))
    return 0


def _register_web(sub: argparse._SubParsersAction) -> None:
    from conveyor.bench.web_overhead import MODES, WATCHERS, WebOverheadConfig

    defaults = WebOverheadConfig()
    p = sub.add_parser("web", help="what the web page's live view costs the engine: the "
                       "time its listener and publisher take in one run (cost), or "
                       "throughput open vs not on one `conveyor serve` (ab)")
    p.add_argument("--mode", choices=MODES, default=defaults.mode,
                   help="cost: one offline run, the live view's share of its time; ab: "
                        "alternating HTTP runs with and without a watcher")
    p.add_argument("--num-requests", type=positive_int, default=defaults.num_requests,
                   help="requests per run (cost: the head-of-line mix; ab: skewed)")
    p.add_argument("--rounds", type=int, default=defaults.rounds,
                   help="ab: pairs of runs (watched, unwatched)")
    p.add_argument("--watcher", choices=WATCHERS, default=defaults.watcher,
                   help="ab: events: a client reading /v1/engine/events; page: the page itself "
                        "in headless chromium (Playwright)")
    p.add_argument("--long-output", type=positive_int, default=defaults.long_output,
                   help="cost: output tokens of the long requests (one in eight)")
    p.add_argument("--workload-seed", type=int, default=defaults.workload_seed)
    p.add_argument("--json", action="store_true", help="print the JSON result only")
    p.add_argument("--result-file", default=None, help="write the JSON result here")
    add_engine_args(p)
    p.set_defaults(func=run_web_cmd)


def run_web_cmd(args: argparse.Namespace) -> int:
    from conveyor.bench.web_overhead import (
        WebOverheadConfig,
        format_web_overhead,
        run_web_overhead,
    )

    config = WebOverheadConfig(num_requests=args.num_requests, rounds=args.rounds,
                               watcher=args.watcher, workload_seed=args.workload_seed,
                               mode=args.mode, long_output=args.long_output)
    _emit(run_web_overhead(engine_args_from(args), config), args, format_web_overhead)
    return 0


def _emit(report: dict[str, Any], args: argparse.Namespace,
          fmt: Callable[[dict[str, Any]], str]) -> None:
    """The report as JSON (--result-file, --json) or as the command's table."""
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2) if args.json else fmt(report))

"""`conveyor bench`: offline throughput, serving load, comparisons and sweeps."""

from __future__ import annotations

import argparse
import json

from conveyor.bench import serve_cli
from conveyor.cli.engine_args import add_engine_args, engine_args_from


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    offline = sub.add_parser("offline", help="a seeded workload through LLM.generate")
    offline.add_argument("--num-requests", type=int, default=64)
    offline.add_argument("--workload-seed", type=int, default=0)
    offline.add_argument("--roofline-batches", type=int, nargs="*", default=[1, 16, 64])
    offline.add_argument("--json", action="store_true", help="print the JSON result only")
    offline.add_argument("--result-file", default=None, help="write the JSON result here")
    add_engine_args(offline)
    offline.set_defaults(func=run_offline_cmd)
    serve_cli.register(sub)


def run_offline_cmd(args: argparse.Namespace) -> int:
    from conveyor.bench.offline import Workload, format_offline, run_offline
    from conveyor.engine.llm import LLM

    engine_args = engine_args_from(args)
    llm = LLM(**{k: v for k, v in vars(engine_args).items() if k != "extra"})
    report = run_offline(llm, Workload(num_requests=args.num_requests, seed=args.workload_seed),
                         tuple(args.roofline_batches))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2) if args.json else format_offline(report))
    return 0

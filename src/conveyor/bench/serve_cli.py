"""``conveyor bench serve``: the command line of the serving benchmark (flags as vLLM's).

    conveyor bench serve --url http://127.0.0.1:8000 --dataset random \\
        --input-len 512 --output-len 128 --num-prompts 200 --request-rate 8
    conveyor bench serve --url http://127.0.0.1:8000 --dataset json-schema \\
        --endpoint /v1/chat/completions --num-prompts 64 --output-len 160
        # the same requests free, with their JSON Schema, then free with each one's
        # max_tokens = what its constrained twin wrote (ignore_eos): the grammar's cost alone

Also runnable alone: ``python -m conveyor.bench.serve_cli --url ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from conveyor.bench.datasets import DATASET_NAMES, DatasetConfig, SkewedMix
from conveyor.bench.metrics import format_table, parse_goodput
from conveyor.bench.serve import ENDPOINTS, BenchmarkConfig, BenchmarkResult, run_benchmark
from conveyor.bench.structured import format_comparison, run_structured_comparison

DEFAULTS_MIX = SkewedMix()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the serving benchmark's flags to `parser`."""
    server = parser.add_argument_group("server")
    server.add_argument("--url", required=True,
                        help="server root, e.g. http://127.0.0.1:8000 (without /v1)")
    server.add_argument("--endpoint", default=ENDPOINTS[0], choices=ENDPOINTS)
    server.add_argument("--model", default=None,
                        help="model name to send (default: the first id of GET /v1/models)")
    server.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")

    load = add_load_arguments(parser)
    add_client_arguments(load)
    load.add_argument("--temperature", type=float, default=0.0)
    add_dataset_arguments(parser)
    add_output_arguments(parser)


def add_load_arguments(parser: argparse.ArgumentParser) -> Any:
    """The arrival flags `bench serve` and `conveyor simulate` share; returns their group."""
    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=1000)
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="mean requests/s; 'inf' (default) sends all at once")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of arrival gaps: 1.0 = Poisson, <1 burstier")
    load.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrivals")
    return load


def add_client_arguments(load: Any) -> None:
    """The client flags `bench serve` and `conveyor simulate` share besides the arrivals."""
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="most requests in flight at once (default: unlimited)")
    load.add_argument("--ignore-eos", action="store_true",
                      help="send ignore_eos: true, so every request generates max_tokens "
                           "(simulate: without it, each request ends at an EOS whose position "
                           "is drawn from the dataset's output lengths)")
    load.add_argument("--n", type=int, default=1,
                      help="choices per request (sampling's n; simulate: the samples share "
                           "the prompt's KV blocks); records count every choice's tokens")
    load.add_argument("--abort-fraction", type=float, default=0.0,
                      help="cancel this share of the streams after a random number of chunks "
                           "(seeded; counted apart, out of the latencies): a soak with aborts")


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload flags (`bench serve`, `conveyor simulate`)."""
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", default="random", type=dataset_name,
                      metavar="{" + ",".join(DATASET_NAMES) + ",FILE.json}",
                      help="a generated workload, or a ShareGPT-format JSON file (the same "
                           "as --dataset sharegpt --dataset-path FILE.json)")
    data.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens")
    data.add_argument("--output-len", type=int, default=128, help="random: output tokens")
    data.add_argument("--range-ratio", type=float, default=0.0,
                      help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    data.add_argument("--skewed-long-fraction", type=float, default=DEFAULTS_MIX.long_fraction,
                      help="skewed: share of requests with --skewed-long-output-len tokens")
    data.add_argument("--skewed-short-output", type=int, nargs=2, metavar=("MIN", "MAX"),
                      default=[DEFAULTS_MIX.short_output_min, DEFAULTS_MIX.short_output_max],
                      help="skewed: output tokens of the short requests (uniform)")
    data.add_argument("--skewed-long-output-len", type=int, default=DEFAULTS_MIX.long_output_len)
    data.add_argument("--skewed-prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"),
                      default=[DEFAULTS_MIX.prompt_min, DEFAULTS_MIX.prompt_max],
                      help="skewed: prompt tokens (uniform)")
    data.add_argument("--dataset-path", default=None, help="sharegpt: the JSON file")
    data.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="sharegpt: fixed output length instead of the answer's")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """The report flags (`bench serve`, `conveyor simulate`)."""
    out = parser.add_argument_group("output")
    out.add_argument("--metric-percentiles", default="99",
                     help="comma-separated latency percentiles to report (default: 99)")
    out.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                     help="SLOs for goodput, any of ttft:MS tpot:MS e2el:MS")
    out.add_argument("--result-file", default=None, help="write the result JSON here")
    out.add_argument("--json", action="store_true",
                     help="print the result JSON on stdout instead of the table")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` sub-command to the `conveyor bench` subparsers."""
    parser = subparsers.add_parser(
        "serve", help="load-test an OpenAI-compatible server (conveyor, vLLM, llama.cpp)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(
            f"--metric-percentiles must be numbers like '50,90,99', got {text!r}"
        ) from None


def dataset_name(text: str) -> str:
    """--dataset: one of DATASET_NAMES, or a path ending in .json (a ShareGPT file)."""
    if text in DATASET_NAMES or text.endswith(".json"):
        return text
    raise argparse.ArgumentTypeError(
        f"invalid choice: {text!r} (choose from {', '.join(DATASET_NAMES)}, or a .json file)")


def dataset_from_args(args: argparse.Namespace) -> DatasetConfig:
    """The DatasetConfig the parsed dataset flags describe (ValueError on a bad value)."""
    mix = SkewedMix(
        long_fraction=args.skewed_long_fraction,
        short_output_min=args.skewed_short_output[0],
        short_output_max=args.skewed_short_output[1],
        long_output_len=args.skewed_long_output_len,
        prompt_min=args.skewed_prompt_len[0],
        prompt_max=args.skewed_prompt_len[1],
    )
    name, path = args.dataset, args.dataset_path
    if name.endswith(".json"):  # --dataset FILE.json: a ShareGPT file
        if path is not None and path != name:
            raise ValueError(f"--dataset {name} and --dataset-path {path}: give the file once")
        name, path = "sharegpt", name
    dataset = DatasetConfig(
        name=name, num_prompts=args.num_prompts, seed=args.seed,
        input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
        skewed=mix, dataset_path=path, sharegpt_output_len=args.sharegpt_output_len,
    )
    return dataset


def config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
    """The BenchmarkConfig the parsed flags describe (ValueError on a bad value)."""
    dataset = dataset_from_args(args)
    return BenchmarkConfig(
        base_url=args.url.rstrip("/"), endpoint=args.endpoint, model=args.model,
        api_key=args.api_key, dataset=dataset, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed,
        ignore_eos=args.ignore_eos, temperature=args.temperature,
        percentiles=parse_percentiles(args.metric_percentiles),
        goodput_slos_ms=parse_goodput(args.goodput or []),
        show_progress=not args.no_progress, abort_fraction=args.abort_fraction, n=args.n,
    )


def report(result: BenchmarkResult, as_json: bool, result_file: str | None) -> None:
    """Print the table (or JSON) and write the result file; the first error goes to stderr."""
    data = result.to_dict()
    if result_file:
        with open(result_file, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        print(format_table(result.metrics))
    if result.first_error is not None:
        print(f"{result.metrics.failed} request(s) failed; first error: {result.first_error}",
              file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when at least one request succeeded, 1 otherwise or on bad input."""
    # httpx logs every request at INFO: thousands of lines that would bury the table.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = config_from_args(args)
        if config.dataset.name == "json-schema":
            return _run_structured(config, args.json, args.result_file)
        result = asyncio.run(run_benchmark(config))
    except (ValueError, OSError) as e:
        print(f"conveyor bench serve: error: {e}", file=sys.stderr)
        return 1
    report(result, args.json, args.result_file)
    return 0 if result.metrics.completed > 0 else 1


def _run_structured(config: BenchmarkConfig, as_json: bool, result_file: str | None) -> int:
    """--dataset json-schema: the requests free, constrained, then free length-matched."""
    comparison = asyncio.run(run_structured_comparison(config))
    data = comparison.to_dict()
    if result_file:
        with open(result_file, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
    print(json.dumps(data, indent=2) if as_json else format_comparison(comparison))
    for result in (comparison.free, comparison.constrained, comparison.matched):
        if result.first_error is not None:
            print(f"{result.metrics.failed} request(s) failed; first error: "
                  f"{result.first_error}", file=sys.stderr)
    return 0 if comparison.constrained.metrics.completed > 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m conveyor.bench.serve_cli``."""
    parser = argparse.ArgumentParser(
        prog="conveyor bench serve", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

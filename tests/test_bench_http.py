"""`conveyor bench http`: the same workload offline and through a live server, in one run."""

from __future__ import annotations

from dataclasses import replace

from conveyor.bench.http_overhead import _engine_flags, format_http_overhead, run_http_overhead
from conveyor.bench.offline import Workload
from conveyor.config import EngineArgs


def test_engine_flags_round_trip_only_non_defaults() -> None:
    from conveyor.cli import build_parser
    from conveyor.cli.engine_args import engine_args_from

    args = EngineArgs(max_model_len=512, enable_prefix_caching=False, kv_cache_memory="64MiB",
                      speculative_config={"method": "ngram"})
    flags = _engine_flags(args)
    assert sorted(f for f in flags if f.startswith("--")) == [
        "--kv-cache-memory", "--max-model-len", "--no-enable-prefix-caching",
        "--speculative-config"]
    parsed = engine_args_from(build_parser().parse_args(["bench", "offline", *flags]))
    assert parsed.spec_config() == args.spec_config()  # the JSON of the dict
    assert replace(parsed, speculative_config=None) == replace(args, speculative_config=None)


def test_http_and_offline_run_the_same_workload() -> None:
    workload = Workload(num_requests=6, prompt_len=(20, 40), short_output=(4, 8),
                        long_output=12, seed=3)
    report = run_http_overhead(EngineArgs(max_model_len=256, kv_cache_memory="32MiB"),
                               workload)
    assert report["http_failed"] == 0
    assert report["http_output_tokens"] == report["offline_output_tokens"]  # same requests
    assert report["offline_output_tokens_per_s"] > 0 and report["http_output_tokens_per_s"] > 0
    assert report["http_over_offline"] == (report["http_output_tokens_per_s"]
                                           / report["offline_output_tokens_per_s"])
    assert report["http_mean_itl_ms"] > 0 and report["offline_mean_step_ms"] > 0
    assert "HTTP / offline:" in format_http_overhead(report)

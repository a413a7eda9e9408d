"""`conveyor bench serve` without a server: metrics arithmetic, datasets, arrivals, parsing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from conveyor.bench.datasets import (
    PROMPT_WORDS,
    ChatLengths,
    DatasetConfig,
    SkewedMix,
    load_sharegpt_requests,
    sample_chat_like_requests,
    sample_random_requests,
    sample_requests,
    sample_skewed_requests,
)
from conveyor.bench.metrics import (
    RequestRecord,
    compute_metrics,
    format_table,
    latency_stats,
    meets_slos,
    metrics_to_dict,
    parse_goodput,
    peak_concurrency,
)
from conveyor.bench.serve import (
    BenchmarkConfig,
    BenchmarkResult,
    abort_points,
    arrivals,
    build_payload,
    chunk_text,
)
from conveyor.bench.structured import length_matched


def _record(
    start: float, ttft: float, itl: list[float], out: int, prompt: int = 10
) -> RequestRecord:
    latency = ttft + sum(itl)
    return RequestRecord(
        success=True, prompt_len=prompt, output_tokens=out, ttft=ttft, itl=itl,
        latency=latency, start_time=start, end_time=start + latency,
    )


# ---------------------------------------------------------------- metrics


def test_tpot_definition() -> None:
    r = _record(0.0, 0.1, [0.02, 0.03, 0.05], out=5)
    assert r.ttft <= r.latency
    assert r.tpot == pytest.approx((0.2 - 0.1) / 4)
    assert _record(0.0, 0.1, [], out=1).tpot is None


def test_compute_metrics_counts_and_throughputs() -> None:
    records = [
        _record(0.0, 0.1, [0.01] * 9, out=10, prompt=100),
        _record(0.5, 0.2, [0.02] * 4, out=5, prompt=50),
        RequestRecord(success=False, prompt_len=77, start_time=0.2, end_time=0.3, error="boom"),
    ]
    m = compute_metrics(records, duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert m.completed + m.failed == len(records)
    assert m.total_input_tokens == 150  # failed request's prompt not counted
    assert m.total_output_tokens == 15
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(7.5)
    assert m.total_token_throughput == pytest.approx(82.5)
    assert m.ttft.mean_ms == pytest.approx(150.0)
    assert m.ttft.mean_ms <= m.e2el.mean_ms
    # ITL pools every gap of every successful request: 9 of 10 ms and 4 of 20 ms.
    assert m.itl.mean_ms == pytest.approx((9 * 10 + 4 * 20) / 13)
    assert m.tpot.mean_ms == pytest.approx((10.0 + 20.0) / 2)
    assert m.e2el.median_ms == pytest.approx((190.0 + 280.0) / 2)
    assert m.request_goodput is None


def test_latency_stats_percentiles_and_empty() -> None:
    s = latency_stats([i / 1000 for i in range(1, 101)], [50, 90, 99])
    assert s.mean_ms == pytest.approx(50.5)
    assert s.median_ms == pytest.approx(50.5)
    assert s.percentiles_ms[90.0] == pytest.approx(np.percentile(np.arange(1, 101), 90))
    assert s.percentiles_ms[50.0] <= s.percentiles_ms[90.0] <= s.percentiles_ms[99.0] <= 100.0
    empty = latency_stats([], [99])
    assert (empty.mean_ms, empty.percentiles_ms[99.0]) == (0.0, 0.0)


def test_peak_concurrency() -> None:
    assert peak_concurrency([]) == 0
    assert peak_concurrency([(0, 1), (2, 3)]) == 1
    assert peak_concurrency([(0, 10), (1, 2), (1.5, 3), (2.5, 4)]) == 3
    # Touching intervals: one ends exactly when the next starts, never both in flight.
    assert peak_concurrency([(0, 1), (1, 2), (2, 3)]) == 1
    assert compute_metrics([_record(float(i), 0.1, [0.1], 2) for i in range(4)], 5.0) \
        .peak_concurrency == 1


def test_goodput() -> None:
    fast = _record(0.0, 0.05, [0.01] * 9, out=10)  # ttft 50 ms, tpot 10 ms, e2el 140 ms
    slow_start = _record(0.0, 0.5, [0.01] * 9, out=10)  # ttft 500 ms
    one_token = _record(0.0, 0.05, [], out=1)  # no TPOT: only ttft/e2el apply
    failed = RequestRecord(success=False, error="x")
    slos = parse_goodput(["ttft:100", "tpot:20"])
    assert slos == {"ttft": 100.0, "tpot": 20.0}
    assert meets_slos(fast, slos) and meets_slos(one_token, slos)
    assert not meets_slos(slow_start, slos) and not meets_slos(failed, slos)
    assert not meets_slos(fast, {"e2el": 100.0})
    m = compute_metrics([fast, slow_start, one_token, failed], 2.0, goodput_slos_ms=slos)
    assert m.request_goodput == pytest.approx(1.0)
    assert "Request goodput (req/s):" in format_table(m)


@pytest.mark.parametrize("bad", ["ttft", "foo:3", "ttft:abc", "tpot:-1"])
def test_parse_goodput_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput([bad])


def test_aborted_requests_count_apart_from_latencies() -> None:
    done = _record(0.0, 0.1, [0.01, 0.02], 3)
    aborted = RequestRecord(success=False, ttft=5.0, latency=9.0, start_time=0.0,
                            end_time=9.0, aborted=True)
    failed = RequestRecord(success=False, error="x", start_time=0.0, end_time=0.5)
    m = compute_metrics([done, aborted, failed], 10.0)
    assert (m.completed, m.failed, m.aborted) == (1, 1, 1)
    assert m.ttft.mean_ms == pytest.approx(100.0) and m.e2el.mean_ms == pytest.approx(130.0)
    assert m.total_output_tokens == 3 and m.peak_concurrency == 3
    assert "Aborted requests:" in format_table(m) and metrics_to_dict(m)["aborted"] == 1
    assert "Aborted requests:" not in format_table(compute_metrics([done], 1.0))


def test_abort_points_seeded_and_in_range() -> None:
    lens = [1, 4, 9, 16] * 25
    points = abort_points(100, 0.2, lens, seed=3)
    assert points == abort_points(100, 0.2, lens, seed=3)
    assert points != abort_points(100, 0.2, lens, seed=4)
    chosen = [(p, n) for p, n in zip(points, lens, strict=True) if p is not None]
    assert len(chosen) == 20 and all(0 <= p < n for p, n in chosen)
    assert len({p for p, _ in chosen}) > 3  # random points, not one
    assert abort_points(10, 0.0, [4] * 10, seed=0) == [None] * 10
    assert None not in abort_points(10, 1.0, [4] * 10, seed=0)
    with pytest.raises(ValueError, match="abort_fraction"):
        BenchmarkConfig("http://x", abort_fraction=1.5)


def test_table_and_dict_keys() -> None:
    m = compute_metrics([_record(0.0, 0.1, [0.01, 0.02], 3)], 1.0, percentiles=[50, 99.9])
    table = format_table(m)
    for label in ("Successful requests:", "Mean TTFT (ms):", "P99.9 ITL (ms):",
                  "Median E2EL (ms):", "Peak concurrent requests:"):
        assert label in table
    assert "goodput" not in table
    d = metrics_to_dict(m)
    assert {"mean_ttft_ms", "p50_tpot_ms", "p99.9_itl_ms", "std_e2el_ms"} <= d.keys()
    json.dumps(d)


# ---------------------------------------------------------------- datasets


def test_random_lengths_in_range_and_seeded() -> None:
    reqs = sample_random_requests(200, input_len=100, output_len=40, range_ratio=0.25, seed=7)
    assert len(reqs) == 200
    assert all(75 <= r.prompt_len_hint <= 125 and 30 <= r.output_len <= 50 for r in reqs)
    assert all(len(r.prompt.split()) == r.prompt_len_hint for r in reqs)
    assert all(w in PROMPT_WORDS for w in reqs[0].prompt.split())
    assert len({r.output_len for r in reqs}) > 5  # actually spread, not constant
    assert reqs == sample_random_requests(200, 100, 40, 0.25, seed=7)
    assert reqs != sample_random_requests(200, 100, 40, 0.25, seed=8)
    fixed = sample_random_requests(10, 16, 8, seed=0)
    assert {(r.prompt_len_hint, r.output_len) for r in fixed} == {(16, 8)}
    assert len({r.prompt for r in fixed}) == 10  # distinct prompts: no accidental prefix hits


def test_skewed_fractions() -> None:
    reqs = sample_skewed_requests(100, seed=3)
    long = [r for r in reqs if r.output_len == 256]
    short = [r for r in reqs if r.output_len != 256]
    assert len(long) == 20 and len(short) == 80
    assert all(16 <= r.output_len <= 64 for r in short)
    assert all(50 <= r.prompt_len_hint <= 300 for r in reqs)
    assert reqs == sample_skewed_requests(100, seed=3)
    custom = sample_skewed_requests(50, SkewedMix(long_fraction=0.5, long_output_len=512), seed=1)
    assert sum(r.output_len == 512 for r in custom) == 25
    with pytest.raises(ValueError, match="long_fraction"):
        SkewedMix(long_fraction=1.5)


def test_sharegpt(tmp_path: Path) -> None:
    words = "one two three four five six seven eight nine ten"
    data = [
        {"conversations": [{"from": "human", "value": words}, {"from": "gpt", "value": words * 2}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": words}]},
        {"conversations": [{"from": "human", "value": words}]},  # no answer: skipped
        {"id": "no conversations"},
    ] + [
        {"conversations": [{"from": "human", "value": f"{words} {i}"},
                           {"from": "gpt", "value": words}]}
        for i in range(5)
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = load_sharegpt_requests(path, num_prompts=6, seed=0)
    assert len(reqs) == 6
    assert all(r.prompt != "hi" for r in reqs)  # under MIN_SHAREGPT_TOKENS
    assert {r.output_len for r in reqs} <= {13, 25}  # 10 words * 1.3, 19 words * 1.3
    assert reqs == load_sharegpt_requests(path, 6, seed=0)
    assert {r.output_len for r in load_sharegpt_requests(path, 3, 0, output_len=7)} == {7}
    with pytest.raises(ValueError, match="usable"):
        load_sharegpt_requests(path, num_prompts=7)
    cfg = DatasetConfig(name="sharegpt", num_prompts=2, dataset_path=str(path))
    assert len(sample_requests(cfg)) == 2


def test_sharegpt_like_lengths_are_heavy_tailed_around_their_medians() -> None:
    reqs = sample_requests(DatasetConfig(name="sharegpt-like", num_prompts=2000, seed=5))
    prompts = np.array([r.prompt_len_hint for r in reqs])
    outputs = np.array([r.output_len for r in reqs])
    lengths = ChatLengths()
    assert 0.85 < np.median(prompts) / lengths.prompt_median < 1.15
    assert 0.85 < np.median(outputs) / lengths.output_median < 1.15
    assert prompts.mean() > 1.5 * np.median(prompts)  # the long pastes: a heavy tail
    assert np.percentile(prompts, 99) > 8 * lengths.prompt_median
    assert prompts.min() >= 4 and prompts.max() <= lengths.prompt_max
    assert outputs.min() >= 4 and outputs.max() <= lengths.output_max
    assert all(len(r.prompt.split()) == r.prompt_len_hint for r in reqs[:50])
    assert reqs[:20] == sample_chat_like_requests(2000, seed=5)[:20]
    assert reqs[:20] != sample_chat_like_requests(2000, seed=6)[:20]


def test_dataset_flag_takes_a_name_or_a_sharegpt_file(tmp_path: Path) -> None:
    import argparse

    from conveyor.bench import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)  # bench serve's flags (simulate takes the same)

    def config(*flags: str) -> DatasetConfig:
        return serve_cli.dataset_from_args(parser.parse_args(["--url", "http://x", *flags]))

    path = str(tmp_path / "w.json")
    assert (config("--dataset", path).name, config("--dataset", path).dataset_path) == (
        "sharegpt", path)
    assert config("--dataset", "sharegpt-like").name == "sharegpt-like"
    with pytest.raises(ValueError, match="give the file once"):
        config("--dataset", path, "--dataset-path", "other.json")
    with pytest.raises(SystemExit):
        config("--dataset", "sharegpt_like")


def test_dataset_config_validation() -> None:
    with pytest.raises(ValueError, match="dataset_path"):
        DatasetConfig(name="sharegpt")
    with pytest.raises(ValueError, match="range_ratio"):
        DatasetConfig(range_ratio=1.0)
    with pytest.raises(ValueError, match="dataset must be"):
        DatasetConfig(name="nope")


# ---------------------------------------------------------------- client pieces


def test_payload_and_chunk_text() -> None:
    req = sample_random_requests(1, 4, 9)[0]
    comp = build_payload(BenchmarkConfig("http://x", ignore_eos=True), "m", req)
    assert comp["prompt"] == req.prompt and comp["max_tokens"] == 9
    assert comp["stream"] is True and comp["stream_options"] == {"include_usage": True}
    assert comp["ignore_eos"] is True
    chat = build_payload(BenchmarkConfig("http://x", endpoint="/v1/chat/completions"), "m", req)
    assert chat["messages"] == [{"role": "user", "content": req.prompt}]
    assert "ignore_eos" not in chat and "prompt" not in chat
    assert chunk_text({"choices": [{"text": " a b"}]}, chat=False) == " a b"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}, chat=True) == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}, chat=True) == ""


def test_length_matched_requests() -> None:
    """The length-matched half sends each request with max_tokens = what its constrained
    twin wrote; one whose twin failed or was aborted keeps its own max_tokens."""
    config = BenchmarkConfig("http://x", endpoint="/v1/chat/completions",
                             dataset=DatasetConfig(name="json-schema", num_prompts=3,
                                                   output_len=50))
    requests = sample_requests(config.dataset)
    records = [_record(0.0, 0.1, [0.01] * 11, out=12), RequestRecord(success=False, error="x"),
               RequestRecord(success=True, output_tokens=7, aborted=True)]
    constrained = BenchmarkResult(config, "m", compute_metrics(records, 1.0), records, "d")
    matched = length_matched(requests, constrained)
    assert [r.output_len for r in matched] == [12, 50, 50]
    assert [r.prompt for r in matched] == [r.prompt for r in requests]
    payload = build_payload(dataclasses.replace(config, constrained=False), "m", matched[0])
    assert payload["max_tokens"] == 12 and "response_format" not in payload


def test_benchmark_config_validation() -> None:
    with pytest.raises(ValueError, match="endpoint"):
        BenchmarkConfig("http://x", endpoint="/v1/embeddings")
    with pytest.raises(ValueError, match="request_rate"):
        BenchmarkConfig("http://x", request_rate=0.0)
    with pytest.raises(ValueError, match="url"):
        BenchmarkConfig("localhost:8000")


def test_arrivals_rate() -> None:
    reqs = sample_random_requests(40, 2, 2)

    async def collect(rate: float, burstiness: float) -> float:
        start = time.perf_counter()
        got = [r async for r in arrivals(reqs, rate, burstiness, seed=0)]
        assert got == reqs
        return time.perf_counter() - start

    assert asyncio.run(collect(math.inf, 1.0)) < 0.05
    # 39 gaps of mean 1/400 s ≈ 0.1 s; wide bounds for a loaded machine.
    assert 0.03 < asyncio.run(collect(400.0, 1.0)) < 1.0
    assert 0.03 < asyncio.run(collect(400.0, 0.5)) < 1.0

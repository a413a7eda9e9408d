"""`conveyor bench serve` against a live `conveyor serve`: every metric present and consistent."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conveyor.bench.serve import abort_points
from server_fixtures import ServerProcess, metric_value, start_server, wait_idle

NUM_PROMPTS = 8
OUTPUT_LEN = 6


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    server = start_server("--max-model-len", "512", "--kv-cache-memory", "32MiB",
                          "--max-num-seqs", "4")
    yield server
    server.stop()
    server.remove_log()


def _run_cli(server: ServerProcess, tmp_path: Path, *args: str) -> tuple[dict, str]:
    """`conveyor bench serve ARGS` against `server`: (the result file's JSON, stdout)."""
    result_file = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "conveyor.cli", "bench", "serve", "--url", server.base_url,
           "--no-progress", "--result-file", str(result_file), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(result_file.read_text()), done.stdout


def _bench(server: ServerProcess, tmp_path: Path, *extra: str) -> tuple[dict, str]:
    return _run_cli(server, tmp_path, "--num-prompts", str(NUM_PROMPTS), "--input-len", "24",
                    "--output-len", str(OUTPUT_LEN), "--ignore-eos", *extra)


def test_bench_serve_metrics_are_present_and_consistent(server: ServerProcess,
                                                        tmp_path: Path) -> None:
    result, table = _bench(server, tmp_path, "--goodput", "e2el:600000")
    assert "Serving Benchmark Result" in table and "Mean TTFT (ms):" in table
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos: exact
    assert result["total_input_tokens"] >= NUM_PROMPTS * 12  # the server's own counts
    assert 1 <= result["max_concurrent_requests"] <= NUM_PROMPTS
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    for family in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            assert result[f"{stat}_{family}_ms"] > 0, f"{stat}_{family}_ms"
    assert result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["output_throughput"] == pytest.approx(
        result["total_output_tokens"] / result["duration"])
    records = result["requests"]
    assert len(records) == NUM_PROMPTS
    for r in records:
        assert r["success"] and r["output_tokens"] == OUTPUT_LEN
        assert 0 < r["ttft"] <= r["latency"]
        assert len(r["itl"]) >= 1 and sum(r["itl"]) <= r["latency"] - r["ttft"] + 1e-6
        assert r["start_time"] < r["end_time"]


def test_bench_serve_json_on_stdout_and_chat_endpoint(server: ServerProcess,
                                                      tmp_path: Path) -> None:
    result, stdout = _bench(server, tmp_path, "--json", "--endpoint", "/v1/chat/completions",
                            "--request-rate", "20", "--max-concurrency", "2")
    assert json.loads(stdout)["completed"] == NUM_PROMPTS
    assert result["completed"] == NUM_PROMPTS and result["max_concurrent_requests"] <= 2
    assert result["endpoint"] == "/v1/chat/completions"


def test_bench_serve_abort_fraction(server: ServerProcess, tmp_path: Path) -> None:
    result, table = _bench(server, tmp_path, "--abort-fraction", "0.5")
    points = abort_points(NUM_PROMPTS, 0.5, [OUTPUT_LEN] * NUM_PROMPTS, seed=0)
    # A stream cut before its first or second chunk is surely aborted; a later cut may come
    # after the server sent every token in fewer chunks (then the stream completes).
    surely = sum(p is not None and p <= 1 for p in points)
    assert surely >= 1
    assert surely <= result["aborted"] <= NUM_PROMPTS // 2
    assert result["completed"] + result["aborted"] == NUM_PROMPTS and result["failed"] == 0
    assert "Aborted requests:" in table and result["abort_fraction"] == 0.5
    records = result["requests"]
    assert all(r["output_tokens"] == OUTPUT_LEN for r in records if not r["aborted"])
    # The server sees the last disconnects within a step or two: then nothing is left.
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(server.base_url + "/metrics").text
        busy = [n for n in names if metric_value(text, "conveyor:" + n) != 0]
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not busy, text


def test_bench_serve_n_counts_every_choice(server: ServerProcess, tmp_path: Path) -> None:
    """`--n 2` (as `conveyor simulate --n`): each request asks for two choices, streamed
    interleaved; a record's output tokens are both choices' (the server's usage)."""
    result, _ = _bench(server, tmp_path, "--n", "2", "--temperature", "0.8",
                       "--endpoint", "/v1/chat/completions")
    assert result["n"] == 2 and result["completed"] == NUM_PROMPTS and result["failed"] == 0
    assert result["total_output_tokens"] == 2 * NUM_PROMPTS * OUTPUT_LEN
    assert all(r["output_tokens"] == 2 * OUTPUT_LEN for r in result["requests"])


def test_chunk_text_reads_every_choice_and_n_is_checked() -> None:
    from conveyor.bench.serve import BenchmarkConfig, chunk_text

    chat = {"choices": [{"index": 0, "delta": {"content": "a"}},
                        {"index": 1, "delta": {"reasoning_content": "b"}}]}
    assert chunk_text(chat, chat=True) == "ab"
    assert chunk_text({"choices": [{"index": 1, "text": "c"}]}, chat=False) == "c"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}, chat=False) == ""
    with pytest.raises(ValueError, match="n must be"):
        BenchmarkConfig(base_url="http://x", n=0)


def _printed(table: str, label: str) -> float:
    """The figure the table prints after `label` (the line's last field)."""
    line = next(line for line in table.splitlines() if line.startswith(label))
    return float(line.split()[-1])


def test_bench_serve_json_schema_length_matched(server: ServerProcess, tmp_path: Path) -> None:
    """--dataset json-schema runs free, constrained, then free length-matched: the last
    writes, request by request, exactly the tokens the constrained one wrote."""
    output_len = 32  # the "record" schema's object closes in 25 tokens, the others run on
    result, table = _run_cli(server, tmp_path, "--dataset", "json-schema", "--endpoint",
                             "/v1/chat/completions", "--num-prompts", "4",
                             "--output-len", str(output_len))
    halves = [result[h] for h in ("free", "constrained", "free_matched")]
    assert [(h["completed"], h["failed"]) for h in halves] == [(4, 0)] * 3
    constrained, matched = halves[1], halves[2]
    assert matched["output_tokens_per_request"] == constrained["output_tokens_per_request"]
    assert matched["total_output_tokens"] == constrained["total_output_tokens"]
    # The grammar ended some objects before max_tokens: the matching is not trivial.
    assert min(constrained["output_tokens_per_request"]) < output_len
    assert result["matched_output_throughput_ratio"] == pytest.approx(
        constrained["output_throughput"] / matched["output_throughput"])
    assert result["matched_median_tpot_ratio"] == pytest.approx(
        constrained["median_tpot_ms"] / matched["median_tpot_ms"])
    assert result["output_throughput_ratio"] == pytest.approx(
        constrained["output_throughput"] / halves[0]["output_throughput"])
    assert result["grammar"]["compiles"] + result["grammar"]["cache_hits"] == 4
    assert "free, matched" in table
    for label, key in (("Output throughput ratio:", "output_throughput_ratio"),
                       ("Median TPOT ratio:", "median_tpot_ratio"),
                       ("Output throughput ratio, matched:", "matched_output_throughput_ratio"),
                       ("Median TPOT ratio, matched:", "matched_median_tpot_ratio")):
        assert _printed(table, label) == pytest.approx(result[key], abs=5e-4), label
    metrics = wait_idle(server)
    assert metric_value(metrics, "conveyor:kv_cache_usage_perc") == 0

"""The simulator against the engine it simulates, on the tiny model: profile this machine,
simulate a workload with the measured cost model, run the same workload through a real
`conveyor serve` with `bench serve`'s client, and compare (loose bounds: a shared CI
machine is noisy, and the tiny model's steps are short enough for HTTP to matter)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from conftest import TINY_KV_MEMORY
from conveyor.bench.datasets import DatasetConfig
from conveyor.bench.serve import BenchmarkConfig, run_benchmark
from conveyor.cli import main
from conveyor.config import EngineArgs
from conveyor.sim.profile import ProfileGrid, ServeGrid, run_profile
from server_fixtures import start_server

KV = str(4 * TINY_KV_MEMORY)  # 256 blocks of 16 tokens
WORKLOAD = ["--dataset", "random", "--input-len", "48", "--output-len", "24",
            "--range-ratio", "0.5", "--num-prompts", "24", "--request-rate", "inf"]


def _ratio(a: float, b: float) -> float:
    return max(a, b) / min(a, b)


def test_simulated_serve_matches_real_serve_on_the_tiny_model(
        tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = str(tiny_llama_dir)
    grid = ProfileGrid(batches=(1, 8, 24), context_lens=(32, 96), prefill_tokens=(16, 128),
                       steps=2)
    serve = ServeGrid(batches=(1, 8, 24), prompt_len=48, output_len=24)
    profile = run_profile(EngineArgs(model=model, dtype="float32", kv_cache_memory=KV,
                                     max_model_len=512), grid, serve)
    assert set(profile.server_coefficients) == {"server_step", "server_token",
                                                "server_request"}
    print("server terms:", profile.server_coefficients, profile.server_samples)
    path = tmp_path / "profile.json"
    profile.save(path)

    assert main(["simulate", "--cost-model", "measured", "--profile", str(path),
                 "--model", model, "--kv-cache-memory", KV, "--max-model-len", "512",
                 *WORKLOAD, "--ignore-eos", "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    server = start_server("--model", model, "--dtype", "float32", "--kv-cache-memory", KV,
                          "--max-model-len", "512")
    try:
        dataset = DatasetConfig(name="random", num_prompts=24, input_len=48, output_len=24,
                                range_ratio=0.5)
        real = asyncio.run(run_benchmark(BenchmarkConfig(
            base_url=server.base_url, dataset=dataset, ignore_eos=True, show_progress=False)))
    finally:
        server.stop()
    measured = real.to_dict()
    assert measured["completed"] == simulated["completed"] == 24
    # The same prompts (the model's tokenizer) and outputs in both.
    assert measured["total_input_tokens"] == simulated["total_input_tokens"]
    assert measured["total_output_tokens"] == simulated["total_output_tokens"]
    print({k: (simulated[k], measured[k]) for k in
           ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_tpot_ms")})
    # The profile times engine steps; a real server also streams every token of every
    # request (an SSE event each) on its event loop, which the measured cost model does not
    # price: with the tiny model's ~1-4 ms steps that work is most of a step, and on a quiet
    # 2-core machine the real serve ran 2.9-5.4x slower than simulated (TTFT 3.7-7.7x, TPOT
    # 2.2-3.4x). So here the simulator must be optimistic, never pessimistic, and within
    # loose bounds of that known gap (issue 16's default-model validation, with ~50 ms
    # steps, is where the 10-25 % bounds apply).
    assert simulated["output_throughput"] >= 0.8 * measured["output_throughput"]
    assert simulated["median_ttft_ms"] <= 1.25 * measured["median_ttft_ms"]
    assert _ratio(simulated["output_throughput"], measured["output_throughput"]) < 10.0
    assert _ratio(simulated["median_tpot_ms"], measured["median_tpot_ms"]) < 6.0
    assert _ratio(simulated["median_ttft_ms"], measured["median_ttft_ms"]) < 15.0

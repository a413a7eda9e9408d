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


BOUND = 4.0  # simulated vs real, either way (see the end of the test)


def _ratio(a: float, b: float) -> float:
    return max(a, b) / min(a, b)


def _simulate_and_serve(model: str, tmp_path: Path,
                        capsys: pytest.CaptureFixture[str]) -> tuple[dict, dict]:
    """The workload simulated with this machine's profile, then served for real."""
    grid = ProfileGrid(batches=(1, 8, 24), context_lens=(32, 96), prefill_tokens=(16, 128),
                       steps=2, idle_gap_s=0.05, idle_pairs=2)
    serve = ServeGrid(batches=(1, 8, 24), prompt_len=48, output_len=24)
    profile = run_profile(EngineArgs(model=model, dtype="float32", kv_cache_memory=KV,
                                     max_model_len=512), grid, serve)
    assert set(profile.server_coefficients) == {"server_step", "server_token",
                                                "server_request"}
    assert profile.idle_gap_s == 0.05 and profile.idle_step_s >= 0.0
    path = tmp_path / "profile.json"
    profile.save(path)

    capsys.readouterr()  # drop what an earlier attempt printed: only the simulation's JSON
    assert main(["simulate", "--cost-model", "measured", "--profile", str(path),
                 "--model", model, "--kv-cache-memory", KV, "--max-model-len", "512",
                 *WORKLOAD, "--ignore-eos", "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    with capsys.disabled():
        print("server terms:", profile.server_coefficients, profile.server_samples)
    server = start_server("--model", model, "--dtype", "float32", "--kv-cache-memory", KV,
                          "--max-model-len", "512")
    try:
        dataset = DatasetConfig(name="random", num_prompts=24, input_len=48, output_len=24,
                                range_ratio=0.5)
        real = asyncio.run(run_benchmark(BenchmarkConfig(
            base_url=server.base_url, dataset=dataset, ignore_eos=True, show_progress=False)))
    finally:
        server.stop()
    measured: dict = real.to_dict()
    assert measured["completed"] == simulated["completed"] == 24
    # The same prompts (the model's tokenizer) and outputs in both.
    assert measured["total_input_tokens"] == simulated["total_input_tokens"]
    assert measured["total_output_tokens"] == simulated["total_output_tokens"]
    print({k: (simulated[k], measured[k]) for k in
           ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_tpot_ms")})
    return simulated, measured


def test_simulated_serve_matches_real_serve_on_the_tiny_model(
        tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The profile prices the engine's steps and, from a short real serve run, the server's
    # own work (per streamed token, per step, per request: at the tiny model's ~1-4 ms steps
    # it is most of the time; without it a quiet 2-core machine showed real serve 2.9-5.4x
    # slower than simulated). With it the simulation has no known direction of error, so
    # the bounds are symmetric; they hold a loaded CI machine, where the load can change
    # between the profile and the real run (at load 11-14 on 2 cores, simulated TPOT was
    # 2.7x the real one: the profile had been timed under more load). Issue 16's 10-25 %
    # bounds are for the default model on a quiet machine (docs/benchmarks.md).
    # The other test worker's load can still change between the profile and the real run
    # (simulated throughput 4.2x the real one once): a second measurement, profile and all,
    # decides then; the simulator would have to be off twice in a row.
    keys = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
    for _ in range(2):
        simulated, measured = _simulate_and_serve(str(tiny_llama_dir), tmp_path, capsys)
        if all(_ratio(simulated[k], measured[k]) < BOUND for k in keys):
            break
    for key in keys:
        assert _ratio(simulated[key], measured[key]) < BOUND, key


def test_a_grid_larger_than_the_kv_cache_is_refused_before_timing() -> None:
    """The default model's default cache (1456 blocks of 16 tokens, 46,080 bytes per token)
    holds the default grid; contexts up to 320 once did not, and the profile preempted its
    own prefills forever."""
    from conveyor.runner.model_runner import KVCacheLayout
    from conveyor.sim.profile import _check_capacity

    layout = KVCacheLayout(num_blocks=1456, block_size=16, bytes_per_token=46080)
    _check_capacity(ProfileGrid(), layout)
    with pytest.raises(ValueError, match="--kv-cache-memory 1103MiB"):
        _check_capacity(ProfileGrid(context_lens=(128, 320)), layout)

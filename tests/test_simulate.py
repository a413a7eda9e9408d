"""`conveyor simulate`: the step cost models and the simulator (torch-free: the real core
scheduler on a virtual clock). The validation against the real engine is in
test_simulate_validation.py."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from conveyor.bench.metrics import compute_metrics, record_to_dict
from conveyor.bench.serve import BenchmarkConfig, BenchmarkResult
from conveyor.cli import main
from conveyor.config import SchedulerConfig
from conveyor.planner.plan import decode_bound
from conveyor.planner.presets import device_preset, model_preset
from conveyor.sim.cost import (
    TERMS,
    MeasuredCost,
    Profile,
    RooflineCost,
    StepShape,
    fit_terms,
    term_values,
)
from conveyor.sim.report import result_dict, summarize
from conveyor.sim.simulator import SimRequest, SimRun, SimSetup, arrival_times, simulate

LLAMA2_7B = model_preset("llama-2-7b")
A100 = device_preset("A100-80GB")


def _roofline(**kw: object) -> RooflineCost:
    return RooflineCost(LLAMA2_7B, A100, **{"step_overhead_s": 0.0, **kw})  # type: ignore


def test_roofline_decode_step_is_the_planners_memory_bound() -> None:
    """A decode step of B sequences of S tokens reads the weights and B*S tokens of KV once:
    the planner's memory time (decode is memory-bound at B=8)."""
    batch, seq = 8, 1000
    shape = StepShape(num_seqs=batch, num_decode=batch, decode_context=batch * seq)
    bound = decode_bound(LLAMA2_7B, A100, 2, 2, seq, batch)
    assert bound.bound == "memory"
    assert _roofline().step_time(shape) == pytest.approx(bound.memory_time_s, rel=1e-9)
    overhead = _roofline(step_overhead_s=0.002).step_time(shape)
    assert overhead == pytest.approx(bound.memory_time_s + 0.002, rel=1e-9)


def test_roofline_prefill_is_compute_bound_and_quadratic_attention_counts() -> None:
    n = 4096
    shape = StepShape(num_seqs=1, num_prefill_tokens=n, prefill_context=n,
                      prefill_attention=n * (n + 1) // 2)
    params = LLAMA2_7B.num_parameters()
    linear = 2 * params * n / A100.flops_per_s
    attention = 4 * 32 * 32 * 128 * shape.prefill_attention / A100.flops_per_s
    assert _roofline().step_time(shape) == pytest.approx(linear + attention, rel=1e-9)
    assert attention > 0.05 * linear  # at 4k tokens the quadratic term is no rounding error


def test_roofline_tensor_parallel_splits_weights_and_pays_all_reduce() -> None:
    shape = StepShape(num_seqs=16, num_decode=16, decode_context=16 * 500)
    one, two = _roofline(), _roofline(tp=2, link_bytes_per_s=300e9)
    assert two.step_time(shape) < one.step_time(shape)
    slow_link = _roofline(tp=2, link_bytes_per_s=1e9)
    assert slow_link.allreduce_time(16) > two.allreduce_time(16) > 0
    assert two.allreduce_time(512) > two.allreduce_time(16)
    assert one.allreduce_time(512) == 0.0
    # Without the link, two devices halve the (memory-bound) time exactly.
    assert two.step_time(shape) - two.allreduce_time(16) == pytest.approx(
        one.step_time(shape) / 2, rel=1e-9)


def test_fit_terms_recovers_known_coefficients_and_stays_non_negative() -> None:
    truth = [0.004, 0.0002, 0.0, 3e-7, 1e-8, 0.002]
    shapes = [StepShape(num_seqs=b + (p > 0), num_decode=b, num_prefill_tokens=p,
                        decode_context=b * c, prefill_context=p, prefill_attention=p * p // 2)
              for b in (1, 4, 16, 64) for c in (64, 512) for p in (0, 32, 256)]
    times = [sum(t * v for t, v in zip(truth, term_values(s), strict=True)) for s in shapes]
    fitted = fit_terms(shapes, times)
    assert fitted == pytest.approx(truth, rel=1e-6, abs=1e-12)
    # A term that hurts the fit (negative per-seq cost) is dropped, not made negative.
    noisy = [t * (0.9 if s.num_seqs > 8 else 1.0) for s, t in zip(shapes, times, strict=True)]
    assert min(fit_terms(shapes, noisy)) >= 0.0
    with pytest.raises(ValueError, match="at least"):
        fit_terms(shapes[:2], times[:2])


def _profile(**kw: object) -> Profile:
    base = dict(model="m", model_path=None, model_fingerprint="abc", engine_version="0.1.0",
                dtype="float32", kv_cache_dtype="auto", device="cpu", machine="x",
                coefficients=dict.fromkeys(TERMS, 0.001), samples=[], median_abs_error=0.0)
    return Profile(**{**base, **kw})  # type: ignore[arg-type]


def test_profile_round_trip_and_refusals(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    _profile().save(path)
    profile = Profile.load(path)
    assert MeasuredCost(profile).step_time(StepShape(num_seqs=1, num_decode=1)) == \
        pytest.approx(0.001 * (1 + 1 + 1 + 0 + 0))
    profile.check_matches("m", "abc", "0.1.0", "auto")
    with pytest.raises(ValueError, match="measured on model 'm', not 'other'"):
        profile.check_matches("other", "zzz", "0.1.0", "auto")
    with pytest.raises(ValueError, match="conveyor 0.1.0, this is 0.2.0"):
        profile.check_matches("m", "abc", "0.2.0", "auto")
    path.write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="not a profile"):
        Profile.load(path)


# ---------------------------------------------------------------------------- simulator
def _setup(num_blocks: int = 64, block_size: int = 4, **sched: object) -> SimSetup:
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64,
                                "max_model_len": 256, **sched})  # type: ignore[arg-type]
    return SimSetup(config, num_blocks, block_size, eos_token_ids=(1,), output_token=7)


class FixedCost:
    """1 ms per step plus 0.1 ms per token: easy to reason about."""

    request_time_s = 0.0

    def step_time(self, shape: StepShape) -> float:
        return 0.001 + 0.0001 * shape.num_tokens if shape.num_seqs else 0.0

    def idle_time(self, idle_s: float) -> float:
        return 0.0

    def describe(self) -> dict[str, object]:
        return {"cost_model": "fixed", "device": "test", "tp": 1}


def _requests(n: int, prompt: int, output: int, gap: float = 0.0,
              shared: int = 0) -> list[SimRequest]:
    return [SimRequest(str(i), i * gap, list(range(100, 100 + shared))
                       + [200 + i * 50 + j for j in range(prompt - shared)], output)
            for i in range(n)]


def test_lone_request_ttft_is_its_prefill_step_and_tpot_its_decode_step() -> None:
    run = simulate(_setup(), FixedCost(), _requests(1, prompt=20, output=5))
    record = run.records[0]
    assert record.success and record.output_tokens == 5
    assert record.ttft == pytest.approx(0.001 + 0.0001 * 20)
    assert record.itl == pytest.approx([0.0011] * 4)
    assert record.latency == pytest.approx(0.003 + 4 * 0.0011)
    assert run.duration_s == pytest.approx(record.latency)


def test_memory_pressure_preempts_and_every_block_is_free_at_the_end() -> None:
    # 24 blocks of 4 tokens; 8 requests of 20 + 40 tokens want 15 blocks each at the end.
    run = simulate(_setup(num_blocks=24), FixedCost(), _requests(8, prompt=20, output=40))
    assert all(r.success and r.output_tokens == 40 for r in run.records)
    sched = run.replicas[0].scheduler
    assert sched.stats.num_preemptions > 0
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    assert not sched.has_unfinished_requests()
    summary = summarize(run, FixedCost().describe(), "round-robin", 0.0)
    assert summary.num_preemptions == sched.stats.num_preemptions
    assert summary.peak_kv_usage > 0.8


def test_requests_that_never_fit_are_rejected_as_the_engine_rejects_them() -> None:
    requests = _requests(3, prompt=20, output=8)
    requests[1].prompt_token_ids = list(range(300, 300 + 256))  # >= max_model_len
    requests[2].output_len = 200  # 20 + 200 tokens > 16 blocks of 4
    run = simulate(_setup(num_blocks=16), FixedCost(), requests)
    ok, long_prompt, too_big = run.records
    assert ok.success
    assert not long_prompt.success and "maximum context length" in (long_prompt.error or "")
    assert not too_big.success and "KV cache" in (too_big.error or "")
    metrics = compute_metrics(run.records, run.duration_s)
    assert (metrics.completed, metrics.failed) == (1, 2)


def test_arrivals_are_seeded_gamma_gaps_with_the_rates_mean() -> None:
    times = arrival_times(4000, rate=8.0, burstiness=1.0, seed=3)
    assert times == arrival_times(4000, rate=8.0, burstiness=1.0, seed=3)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:], strict=False))
    assert times[-1] / 3999 == pytest.approx(1 / 8, rel=0.05)
    assert arrival_times(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]


def test_replica_routing_policies() -> None:
    requests = _requests(12, prompt=16, output=4, gap=0.0005)
    run = simulate(_setup(), FixedCost(), requests, num_replicas=3, routing="round-robin")
    assert [r.replica for r in run.requests] == [0, 1, 2] * 4
    # Two prompt families with a 12-token shared prefix: affinity keeps each on one replica.
    family = [_requests(6, prompt=16, output=4, gap=0.001, shared=12),
              [SimRequest(f"b{i}", 0.0005 + i * 0.001, list(range(900, 912)) + [i] * 4, 4)
               for i in range(6)]]
    run = simulate(_setup(), FixedCost(), family[0] + family[1], num_replicas=3,
                   routing="prefix-affinity")
    by_family = [{r.replica for r in run.requests if r.request_id.startswith("b") == (f == 1)}
                 for f in (0, 1)]
    assert all(len(s) == 1 for s in by_family) and by_family[0] != by_family[1]
    run = simulate(_setup(), FixedCost(), _requests(9, prompt=16, output=30),
                   num_replicas=3, routing="least-loaded")
    assert sorted(sum(r.replica == i for r in run.requests) for i in range(3)) == [3, 3, 3]
    for replica in run.replicas:
        assert replica.scheduler.kv_cache.num_free_blocks == replica.scheduler.kv_cache.num_blocks


def test_json_has_bench_serve_keys() -> None:
    from conveyor.bench.datasets import DatasetConfig

    run = simulate(_setup(), FixedCost(), _requests(4, prompt=10, output=3, gap=0.01))
    metrics = compute_metrics(run.records, run.duration_s)
    summary = summarize(run, FixedCost().describe(), "round-robin", 0.0)
    data = result_dict("m", DatasetConfig(), 100.0, 1.0, metrics, run, summary)
    serve = BenchmarkResult(BenchmarkConfig(base_url="http://x"), "m", metrics,
                            run.records, "d").to_dict()
    assert set(data) == set(serve) | {"simulation"}
    assert data["requests"][0] == record_to_dict(run.records[0])
    json.dumps(data)  # JSON-ready


def test_cli_simulate_roofline_json_and_bad_presets(capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path) -> None:
    args = ["simulate", "--model", "llama-3-8b", "--device", "H100-80GB", "--dataset", "skewed",
            "--num-prompts", "300", "--request-rate", "20", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["completed"] == 300 and data["failed"] == 0
    assert data["simulation"]["simulated_s"] > 300 / 20 * 0.8
    assert main(["simulate", "--model", "llama-3-8b", "--device", "B300"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'B300'" in err and "H100-80GB" in err and "A100-80GB" in err
    assert main(["simulate", "--model", "gpt-5", "--device", "H100-80GB"]) == 2
    assert "llama-3-8b" in capsys.readouterr().err
    assert main(["simulate", "--cost-model", "measured"]) == 2
    assert "--profile" in capsys.readouterr().err


def test_cli_sweep_marks_the_knee(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["simulate", "--model", "llama-3-8b", "--device", "A100-80GB", "--dataset", "random",
            "--input-len", "200", "--output-len", "50", "--num-prompts", "100",
            "--sweep", "max_num_seqs=1,4,16,64,256", "--json", "--plot-dir", str(tmp_path)]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    points = report["points"]
    assert [p["max_num_seqs"] for p in points] == [1, 4, 16, 64, 256]
    throughput = [p["output_tokens_per_s"] for p in points]
    assert throughput[2] > 8 * throughput[0]  # batching pays on a memory-bound decode
    # 100 requests at once: past 64 slots there is little left to batch.
    assert report["knee"] == 64
    assert Path(report["plots"][0]).stat().st_size > 0


def test_cli_replicas_table_and_plots(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["simulate", "--model", "llama-2-13b", "--device", "L4", "--tp", "2",
            "--dataset", "skewed", "--num-prompts", "120", "--request-rate", "4",
            "--replicas", "2", "--routing", "least-loaded", "--plot-dir", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Successful requests:" in out
    assert "Replicas (routing):                     2 (least-loaded)" in out
    assert "L4 x2" in out
    for name in ("simulate_timeline.png", "simulate_kv_usage.png", "simulate_queue.png"):
        assert (tmp_path / name).stat().st_size > 0


# ---------------------------------------------------------------------------- client load
def _in_flight_peak(run: SimRun) -> int:
    return compute_metrics(run.records, run.duration_s).peak_concurrency


def test_max_concurrency_holds_requests_at_the_client() -> None:
    requests = _requests(6, prompt=8, output=5)
    run = simulate(_setup(), FixedCost(), requests, max_concurrency=2)
    assert all(r.success and r.output_tokens == 5 for r in run.records)
    assert _in_flight_peak(run) == 2
    first_two_end = sorted(r.record.end_time for r in run.requests[:2])
    # The third is sent when the first slot frees; its TTFT counts from then, as the
    # client times it (bench serve starts the clock after the semaphore).
    third = run.requests[2]
    assert third.sent == pytest.approx(first_two_end[0]) and third.sent > third.arrival
    assert third.record.start_time == third.sent
    assert third.record.ttft < 0.01
    unlimited = simulate(_setup(), FixedCost(), _requests(6, prompt=8, output=5))
    assert _in_flight_peak(unlimited) == 6
    assert run.duration_s > unlimited.duration_s
    with pytest.raises(ValueError, match="--max-concurrency"):
        simulate(_setup(), FixedCost(), _requests(2, 8, 5), max_concurrency=0)


def test_aborted_streams_end_in_the_engine_and_are_counted_apart() -> None:
    requests = _requests(4, prompt=8, output=10)
    requests[1].abort_after = 3  # after its third token
    requests[2].abort_after = 0  # as soon as the response starts: never scheduled
    run = simulate(_setup(), FixedCost(), requests)
    ok, cut, at_once, _ = run.records
    assert ok.success and ok.output_tokens == 10
    assert cut.aborted and not cut.success and len(cut.itl) == 2 and cut.ttft > 0
    assert at_once.aborted and at_once.ttft == 0.0
    stats = run.replicas[0].scheduler.stats
    assert stats.num_steps == 10  # the others' 10 tokens; the cut one freed its blocks
    metrics = compute_metrics(run.records, run.duration_s)
    assert (metrics.completed, metrics.aborted, metrics.failed) == (2, 2, 0)
    assert metrics.total_output_tokens == 20


def test_requests_end_at_eos_before_max_tokens() -> None:
    requests = [SimRequest("a", 0.0, list(range(200, 210)), 10, eos_at=(4,)),
                SimRequest("b", 0.0, list(range(300, 310)), 10, eos_at=(25,)),
                SimRequest("c", 0.0, list(range(400, 410)), 10)]
    for setup in (_setup(), dataclasses.replace(_setup(), eos_token_ids=())):
        run = simulate(setup, FixedCost(), requests)  # with a model EOS, or a stop token
        assert [r.output_tokens for r in run.records] == [4, 10, 10]
    with pytest.raises(ValueError, match="one length per sample"):
        SimRequest("x", 0.0, [1, 2], 5, eos_at=(1, 2), n=3)


def test_eos_positions_are_drawn_from_the_datasets_output_lengths() -> None:
    from conveyor.bench.datasets import DatasetConfig
    from conveyor.sim.setup import ClientLoad, SimModel, build_requests

    model = SimModel("llama-2-7b", LLAMA2_7B)
    dataset = DatasetConfig(name="skewed", num_prompts=200, seed=5)
    eos = build_requests(dataset, model, math.inf, 1.0, 5)
    again = build_requests(dataset, model, math.inf, 1.0, 5)
    assert [r.eos_at for r in eos] == [r.eos_at for r in again]  # seeded
    lengths = {r.output_len for r in eos}
    assert all(len(r.eos_at) == 1 and r.eos_at[0] in lengths for r in eos)
    assert any(r.eos_at[0] < r.output_len for r in eos)  # some end early, at EOS
    plain = build_requests(dataset, model, math.inf, 1.0, 5, ClientLoad(ignore_eos=True))
    assert all(r.eos_at == () for r in plain)
    many = build_requests(dataset, model, math.inf, 1.0, 5, ClientLoad(n=3, abort_fraction=0.1))
    assert all(r.n == 3 and len(r.eos_at) == 3 for r in many)
    assert sum(r.abort_after is not None for r in many) == 20
    for bad, flag in (({"n": 0}, "--n"), ({"abort_fraction": 1.5}, "--abort-fraction"),
                      ({"max_concurrency": 0}, "--max-concurrency")):
        with pytest.raises(ValueError, match=flag):
            ClientLoad(**bad)  # type: ignore[arg-type]


def test_parallel_samples_share_the_prompts_blocks() -> None:
    # 40 prompt tokens = 10 blocks of 4; 3 samples of 6 tokens need 2 more blocks each.
    def run_with(caching: bool) -> SimRun:
        setup = dataclasses.replace(_setup(num_blocks=64), enable_prefix_caching=caching)
        request = SimRequest("r", 0.0, list(range(500, 540)), 6, n=3)
        return simulate(setup, FixedCost(), [request])

    shared, apart = run_with(True), run_with(False)
    for run in (shared, apart):
        record = run.records[0]
        assert record.success and record.output_tokens == 18  # usage counts every sample
    peak = [max(s.kv_blocks_used for s in r.replicas[0].samples) for r in (shared, apart)]
    # Shared: the prompt's blocks once, plus each sample's own (decode, and the last prompt
    # block a cache hit recomputes); apart: the prompt's 10 blocks three times.
    assert peak[0] <= 10 + 3 * 3 < 3 * 10 <= peak[1]
    # The samples wait for the first to compute the prompt, as in the engine.
    assert shared.records[0].ttft == pytest.approx(0.001 + 0.0001 * 40)


def test_the_issues_command_with_sharegpt_like_lengths(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    args = ["simulate", "--model", "llama-3-8b", "--device", "H100-80GB", "--dataset",
            "sharegpt-like", "--request-rate", "8", "--num-prompts", "300", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["completed"] == 300 and data["dataset_name"] == "sharegpt-like"
    assert data["total_input_tokens"] > 300 * 100  # the long prompts pull the mean up


def test_cli_client_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--model", "llama-3-8b", "--device", "H100-80GB", "--dataset", "skewed",
            "--num-prompts", "80", "--json", "--max-concurrency", "8", "--n", "2",
            "--abort-fraction", "0.25", "--ignore-eos"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["max_concurrency"], data["ignore_eos"], data["abort_fraction"]) == (8, True,
                                                                                     0.25)
    assert data["aborted"] == 20 and data["completed"] == 60
    assert data["max_concurrent_requests"] == 8 and data["simulation"]["samples_per_request"] == 2
    assert main(args[:-1] + ["--n", "0"]) == 2
    assert "--n must be >= 1" in capsys.readouterr().err


# ---------------------------------------------------------------------------- server terms
def test_measured_cost_prices_the_servers_tokens_and_requests() -> None:
    server = {"server_step": 0.0005, "server_token": 0.0002, "server_request": 0.003}
    cost = MeasuredCost(_profile(server_coefficients=server))
    shape = StepShape(num_seqs=4, num_decode=4, num_sampled=4)
    assert cost.step_time(shape) == pytest.approx(cost.engine_step_time(shape)
                                                  + 0.0005 + 4 * 0.0002)
    assert cost.request_time_s == 0.003
    assert MeasuredCost(_profile()).request_time_s == 0.0
    # The server's front end takes requests one at a time before the engine sees them.
    run = simulate(_setup(), cost, _requests(3, prompt=8, output=2))
    assert [r.admit_at for r in run.requests] == pytest.approx([0.003, 0.006, 0.009])
    assert run.records[2].ttft > 0.009


def test_the_first_step_after_an_idle_spell_pays_the_profiles_idle_cost() -> None:
    """A step that starts after the engine ran out of work pays the measured idle cost in
    proportion to the gap (up to the gap it was measured after); steps of a busy engine
    do not."""
    profile = _profile(idle_step_s=0.010, idle_gap_s=1.0)
    cost = MeasuredCost(profile)
    assert cost.idle_time(2.0) == pytest.approx(0.010)
    assert cost.idle_time(0.25) == pytest.approx(0.0025)
    assert MeasuredCost(_profile()).idle_time(5.0) == 0.0  # not measured: no cost
    requests = _requests(3, prompt=8, output=3, gap=2.0)
    idle, plain = simulate(_setup(), cost, requests), simulate(_setup(), MeasuredCost(_profile()),
                                                               _requests(3, prompt=8, output=3,
                                                                         gap=2.0))
    # The first request finds an engine idle since the start (time 0): no gap, no cost; the
    # later ones arrive 2 s after the previous one ended, less its run time.
    assert idle.records[0].ttft == pytest.approx(plain.records[0].ttft)
    for a, b in zip(idle.records[1:], plain.records[1:], strict=True):
        assert a.ttft == pytest.approx(b.ttft + 0.010)
        assert a.itl == pytest.approx(b.itl)  # only the first step after the spell


def test_the_front_end_stalls_a_busy_engine() -> None:
    """The front end shares the engine's process (and GIL): a request it hands over while the
    engine runs adds its front-end time to the step that admits it; one reaching an idle
    engine adds nothing."""

    class FrontEnd(FixedCost):
        request_time_s = 0.005

    run = simulate(_setup(), FrontEnd(), _requests(2, prompt=20, output=10))
    first, second = run.records
    assert first.ttft == pytest.approx(0.005 + 0.001 + 0.0001 * 20)  # idle engine: no stall
    assert first.itl[:2] == pytest.approx([0.0011, 0.0011])
    # the second request is handed over at 0.010, during the first's decodes: the step that
    # admits it (its prefill and the first's decode) pays the 5 ms too
    assert first.itl[2] == pytest.approx(0.005 + 0.001 + 0.0001 * 21)
    assert second.ttft == pytest.approx(0.008 + 2 * 0.0011 + first.itl[2])


def test_fit_server_terms_recovers_step_and_token_costs() -> None:
    from conveyor.sim.cost import ServeRun, fit_server_terms

    runs = [ServeRun(b, 0.010 + 0.002 + 0.0004 * b + 0.004 if b == 1 else 0.05,
                      0.003 + 0.002 + 0.0004 * b, 0.010, 0.003) for b in (1, 8, 32)]
    terms = fit_server_terms(runs)
    assert terms["server_step"] == pytest.approx(0.002)
    assert terms["server_token"] == pytest.approx(0.0004)
    assert terms["server_request"] == pytest.approx(0.004)
    # A server faster than the engine-only prediction gets no negative cost.
    fast = [ServeRun(b, 0.001, 0.001, 0.010, 0.003) for b in (1, 8)]
    assert min(fit_server_terms(fast).values()) == 0.0
    # Where the server reported its own TTFT, the front end is the gap to it, whatever the
    # simulated engine made of the lone prefill (here 20 ms too fast).
    measured = [dataclasses.replace(r, engine_ttft=r.engine_ttft - 0.020,
                                    front_end=0.004 + 0.002 + 0.0004)
                if r.batch == 1 else r for r in runs]
    assert fit_server_terms(measured)["server_request"] == pytest.approx(0.004)

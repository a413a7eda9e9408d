"""Built-in shapes with dummy weights (`--model qwen3-0.6b --load-format dummy`) and the
``enforce_eager`` setting, as the engine and the command line take them."""

from __future__ import annotations

import argparse

import pytest

from conveyor import LLM, SamplingParams
from conveyor.cli.engine_args import add_engine_args, engine_args_from
from conveyor.model.loader import load_checkpoint
from conveyor.planner.presets import model_preset


def test_a_preset_name_loads_its_shape_without_files() -> None:
    checkpoint = load_checkpoint("Llama-3-8B", "dummy")  # case-insensitive, as conveyor plan
    assert checkpoint.config == model_preset("llama-3-8b")
    assert (checkpoint.path, checkpoint.format, checkpoint.tokenizer) == ("llama-3-8b", "dummy",
                                                                         None)
    qwen = load_checkpoint("qwen3-0.6b", "dummy").config
    assert (qwen.architecture, qwen.hidden_size, qwen.num_hidden_layers, qwen.vocab_size,
            qwen.num_key_value_heads, qwen.qk_norm, qwen.tie_word_embeddings) == \
        ("qwen3", 1024, 28, 151936, 8, True, True)
    with pytest.raises(ValueError, match="load_format='dummy'"):
        load_checkpoint("qwen3-0.6b")  # no weights to load
    with pytest.raises(FileNotFoundError, match="qwen9"):
        load_checkpoint("qwen9-1b", "dummy")  # neither a file nor a preset


def test_command_line_takes_a_preset_and_enforce_eager() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(
        ["--model", "llama-3-8b", "--load-format", "dummy", "--enforce-eager"]))
    assert (args.model, args.load_format, args.enforce_eager) == ("llama-3-8b", "dummy", True)
    assert engine_args_from(parser.parse_args([])).enforce_eager is False


def test_qwen3_preset_builds_and_decodes_on_cpu(kv_free) -> None:
    """The whole 0.6B shape with random weights (bf16, ~1.2 GB), two tokens, no tokenizer."""
    llm = LLM(model="qwen3-0.6b", load_format="dummy", dtype="bfloat16", max_model_len=64,
              max_num_seqs=2, kv_cache_memory="16MiB", enforce_eager=True)
    model = llm.engine.runner.model
    assert llm.get_tokenizer() is None and llm.engine.runner.graphs is None  # CPU: eager
    assert tuple(model.embed_tokens.weight.shape) == (151936, 1024)
    assert len(model.layers) == 28
    attn = model.layers[0].self_attn
    assert attn.q_norm is not None and attn.q_norm.weight.shape[0] == 128
    out = llm.generate([{"prompt_token_ids": [1000, 2000, 3000]}],
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2 and out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["some text"], SamplingParams(max_tokens=1))
    kv_free(llm)

"""Shared fixtures for the engine tests: the default model, tiny random HF models, references.

Everything heavy is session-scoped: the default SmolLM2 engine loads once (~10 s), the tiny
random models are written once with transformers' ``save_pretrained`` and served by conveyor
and by transformers (the reference) on the same weights, in float32 on both sides.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Two test workers (xdist) and their servers share CI's two cores: OpenMP threads that spin
# at every barrier (libgomp's default) take the core another process needs; sleeping ones
# halved a decode on a loaded machine here. Set before torch loads the OpenMP runtime;
# server subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from conftest_models import default_gguf  # noqa: E402

# Without CUDA (CI) Triton kernels run in Triton's interpreter (tests/test_triton_attention.py).
# Triton reads the variable when a kernel, or its own library (tl.sum, tl.max), is wrapped by
# triton.jit, at import: so it is set here, before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny random decoders: big enough to exercise GQA, biases, q/k norm and paging across many
# blocks, small enough that a step costs milliseconds on two CPU cores.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                  max_position_embeddings=1024, rms_norm_eps=1e-6)
# Std of the tiny models' weights: large, so that logits are well separated (greedy ties
# between engines would make token-exact comparisons flaky) and every weight matters.
TINY_INIT_STD = 0.25
TINY_VOCAB = 512  # target size of the trained byte-level BPE (the trainer may stop short)
TINY_KV_MEMORY = 1 << 20  # 1 MiB: 64 blocks of 16 tokens for the MHA tiny model in float32

_WORDS = ("the sea sky is blue a haiku write about hello world of and to in with light dreams "
          "canvas colors quick brown fox jumps over lazy dog number one two three four five six "
          "seven eight nine ten café naïve über 東京 日本語 Привет мир 🙂 🎉 def return print").split()


def _train_tokenizer(folder: Path) -> int:
    """A byte-level BPE (multi-byte characters span tokens) with <s> and </s>; its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(_WORDS) for _ in range(40)) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}))
    return tok.get_vocab_size()


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm weights around 1, biases non-zero), so that a weight the
    loader drops or misplaces changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.5 * noise)
            else:
                param.copy_(TINY_INIT_STD * noise)


def build_tiny_model(folder: Path, tokenizer_dir: Path, vocab_size: int, arch: str,
                     seed: int = 0, **overrides: Any) -> Path:
    """Save a random `arch` ("llama" | "qwen2" | "qwen3") model + tokenizer to `folder`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    shape = {**TINY_SHAPE, **overrides}
    config = config_class(vocab_size=vocab_size, bos_token_id=0, eos_token_id=1,
                          tie_word_embeddings=shape.pop("tie_word_embeddings", False), **shape)
    if arch == "qwen2":
        assert config.use_sliding_window is False
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    return folder


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """(folder with tokenizer.json + tokenizer_config.json, vocab size)."""
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    return folder, _train_tokenizer(folder)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory,
                       tiny_tokenizer: tuple[Path, int]) -> Callable[..., Path]:
    """make(name, arch, **config overrides) -> folder; built once per name."""
    built: dict[str, Path] = {}
    tokenizer_dir, vocab_size = tiny_tokenizer

    def make(name: str, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
        if name not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{name}")
            built[name] = build_tiny_model(folder, tokenizer_dir, vocab_size, arch, seed,
                                           **overrides)
        return built[name]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", "llama")


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir: Path) -> Any:
    """The tiny random Llama (with its byte-level BPE tokenizer) behind conveyor, float32."""
    from conveyor import LLM

    return LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=TINY_KV_MEMORY,
               max_model_len=1024)


@pytest.fixture(scope="session")
def default_llm() -> Any:
    """The default SmolLM2-135M GGUF behind conveyor, float32, a small KV cache (91 blocks)."""
    from conveyor import LLM

    default_gguf()  # skips the test when the model package is not installed
    return LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=1024)


@pytest.fixture(scope="session")
def hf_tiny_model() -> Callable[[Path], Any]:
    """load(folder) -> the transformers model on the same weights (float32, eval), cached."""
    from transformers import AutoModelForCausalLM

    cache: dict[Path, Any] = {}

    def load(folder: Path) -> Any:
        if folder not in cache:
            cache[folder] = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32).eval()
        return cache[folder]

    return load


@pytest.fixture(scope="session")
def hf_default_model() -> Any:
    """transformers' Llama with the default GGUF's weights, as transformers dequantizes them."""
    from transformers import AutoModelForCausalLM

    from conftest_models import hf_gguf_config, hf_gguf_state_dict

    default_gguf()
    config = hf_gguf_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.float() for k, v in hf_gguf_state_dict().items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # off the meta device
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not meta, f"parameters left on the meta device: {meta[:5]}"
    return model.float().eval()


def hf_greedy(model: Any, prompt_token_ids: list[int], max_tokens: int
              ) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation by transformers with its KV cache, never stopping on EOS:
    (token ids, float32 logits [vocab] of each generated position)."""
    out_ids, logits = [], []
    with torch.inference_mode():
        result = model(torch.tensor([prompt_token_ids]), use_cache=True, logits_to_keep=1)
        for _ in range(max_tokens):
            row = result.logits[0, -1].float()
            token = int(row.argmax())
            out_ids.append(token)
            logits.append(row)
            result = model(torch.tensor([[token]]), use_cache=True, **_cache_kwargs(result))
    return out_ids, logits


def _cache_kwargs(result: Any) -> dict[str, Any]:
    """The KV cache of a forward's output, under the keyword this transformers version takes
    (`cache` from 5.x, `past_key_values` before)."""
    if getattr(result, "cache", None) is not None:
        return {"cache": result.cache}
    return {"past_key_values": result.past_key_values}


@pytest.fixture(scope="session")
def greedy_reference() -> Callable[..., tuple[list[int], list[torch.Tensor]]]:
    """hf_greedy as a fixture (test modules do not import conftest)."""
    return hf_greedy


def assert_kv_free(llm: Any) -> None:
    """With no request alive every KV block is free and the cache's invariants hold."""
    stats = llm.stats()
    assert stats.num_requests_running == 0 and stats.num_requests_waiting == 0, stats
    assert stats.kv_blocks_free == stats.kv_blocks_total, stats
    llm.engine.check_integrity()


@pytest.fixture(scope="session")
def kv_free() -> Callable[[Any], None]:
    """check(llm): the end-of-workload leak check (all KV blocks free, integrity holds)."""
    return assert_kv_free

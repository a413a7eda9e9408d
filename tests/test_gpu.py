"""The CUDA path, end to end (skipped without a CUDA device; CI has none).

On a GPU the engine runs the torch reference ops (conveyor/ops/reference.py) and SDPA; the
CPU suite checks the same code against the C++ kernels and transformers, so these tests
check what changes on a GPU: tensors on the device, asynchronous kernels, pinned-memory swap,
device generators for seeded sampling, and the bf16 default. Every workload ends with all KV
blocks free.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch

from conftest_models import TINY_VARIANTS, assert_greedy_matches_reference
from conveyor import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

def cuda_llm(folder: Any, **engine_args: Any) -> LLM:
    args: dict[str, Any] = dict(device="cuda", dtype="float32", kv_cache_memory=1 << 20,
                                max_model_len=1024)
    args.update(engine_args)
    llm = LLM(model=str(folder), **args)
    assert llm.engine.device.type == "cuda"
    assert llm.engine.runner.kv_caches.is_cuda
    return llm


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randrange(1, 61))] for _ in range(n)]


def ids(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name,arch,overrides", TINY_VARIANTS,
                         ids=[v[0] for v in TINY_VARIANTS])
def test_greedy_on_cuda_matches_transformers_on_cpu(name, arch, overrides, tiny_model_factory,
                                                    hf_tiny_model, greedy_reference,
                                                    kv_free) -> None:
    folder = tiny_model_factory(f"gpu-{name}", arch, seed=len(name), **overrides)
    reference = hf_tiny_model(folder)
    llm = cuda_llm(folder, block_size=8)
    batch = prompts(4, reference.config.vocab_size)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    assert_greedy_matches_reference(outputs, batch, reference, greedy_reference,
                                    GREEDY.max_tokens, name)
    kv_free(llm)


@pytest.mark.parametrize("preemption,kv_cache_dtype",
                         [("recompute", "auto"), ("swap", "auto"), ("recompute", "int8")])
def test_batch_chunking_and_preemption_keep_outputs_on_cuda(tiny_llama_dir, kv_free,
                                                            preemption: str,
                                                            kv_cache_dtype: str) -> None:
    roomy = cuda_llm(tiny_llama_dir, kv_cache_dtype=kv_cache_dtype)
    batch = prompts(32, roomy.engine.model_config.vocab_size, seed=1)
    alone = [ids(roomy.generate({"prompt_token_ids": p}, GREEDY))[0] for p in batch[:6]]
    together = ids(roomy.generate([{"prompt_token_ids": p} for p in batch], GREEDY))
    assert together[:6] == alone
    kv_free(roomy)
    # 12 blocks for 32 requests of up to 76 tokens and a 16-token budget: chunked prefills
    # next to decodes, and preemptions.
    block_bytes = 16 * roomy.engine.kv_layout.bytes_per_token
    tight = cuda_llm(tiny_llama_dir, kv_cache_memory=12 * block_bytes, preemption=preemption,
                     swap_space=24 * block_bytes / 2**30, max_num_batched_tokens=16,
                     kv_cache_dtype=kv_cache_dtype)
    assert tight.stats().kv_blocks_total == 12
    assert ids(tight.generate([{"prompt_token_ids": p} for p in batch], GREEDY)) == together
    stats = tight.stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swapped_blocks > 0) == (preemption == "swap")
    kv_free(tight)


def test_seeded_sampling_on_cuda_is_batch_independent(tiny_llama_dir, kv_free) -> None:
    llm = cuda_llm(tiny_llama_dir)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16,
                            ignore_eos=True)
    (alone,) = ids(llm.generate(prompt, seeded))
    others = SamplingParams(temperature=0.7, max_tokens=10, ignore_eos=True)
    mixed = ids(llm.generate([prompt, prompt, prompt], [others, seeded, GREEDY]))
    assert mixed[1] == alone
    assert ids(llm.generate(prompt, seeded.replace(seed=4321)))[0] != alone
    kv_free(llm)


# SmolLM2-135M's shape (the default model), as an HF config: the GGUF does not travel to
# every GPU machine, and random weights serve a shape test.
SMOLLM2_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                  "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                  "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                  "max_position_embeddings": 8192, "tie_word_embeddings": True,
                  "bos_token_id": 0, "eos_token_id": 1}


def test_default_model_shape_runs_in_bf16_on_cuda(tmp_path, tiny_tokenizer, kv_free) -> None:
    """The default model's shape with random weights and the engine's defaults on a GPU
    (bfloat16): 64 requests of mixed lengths and sampling all finish, every KV block free."""
    tokenizer_dir, _ = tiny_tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    llm = LLM(model=str(tmp_path), load_format="dummy", device="cuda", max_model_len=1024)
    assert llm.engine.dtype == torch.bfloat16
    vocab = llm.engine.model_config.vocab_size
    batch = prompts(64, vocab, seed=2)
    rng = random.Random(3)
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randrange(1, 48),
                             ignore_eos=True, seed=i) for i in range(len(batch))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert all(0 <= t < vocab for o in outputs for t in o.outputs[0].token_ids)
    kv_free(llm)


def test_async_scheduling_on_cuda_gives_the_synchronous_outputs(tiny_llama_dir, kv_free) -> None:
    """Async scheduling where it is meant to pay: step N+1 launched before N's tokens reach
    the host, its decodes reading them on the device; greedy, seeded, penalized and logprob
    requests, with chunked prefills and preemption, give what the synchronous engine gives."""
    block_bytes = 16 * cuda_llm(tiny_llama_dir).engine.kv_layout.bytes_per_token
    args = dict(kv_cache_memory=12 * block_bytes, max_num_batched_tokens=16)
    sync, lagged = cuda_llm(tiny_llama_dir, **args), cuda_llm(tiny_llama_dir, **args,
                                                              async_scheduling=True)
    vocab = sync.engine.model_config.vocab_size
    batch = [{"prompt_token_ids": p} for p in prompts(24, vocab, seed=4)]
    params = [GREEDY, SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=16),
              SamplingParams(temperature=0, logprobs=2, max_tokens=12)] * 6

    def run(llm: LLM) -> list[Any]:
        return [(o.outputs[0].token_ids, [sorted(d) for d in o.outputs[0].logprobs or []])
                for o in llm.generate(batch, params)]

    assert run(lagged) == run(sync)
    assert lagged.stats().num_preemptions > 0
    for llm in (sync, lagged):
        kv_free(llm)

"""Batch invariance of the default model in the default dtype, on whatever CPU runs the tests
(bf16 with the AMX or the AVX512-BF16 kernels where the CPU has them, float32 elsewhere).

A request's greedy output must be the same bits alone, in a batch, chunked next to running
decodes, under static scheduling, with prefix-cache hits or without prefix caching, and after
recompute preemptions: the matmul kernels give a row the same result whatever else shares the
call, prefill attention gives a query row the same result whatever its chunk, and recomputed
generated tokens attend as the decodes they were. Every comparison the project prints (static
against continuous, chunk sizes, policies) rests on this.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest_models import default_gguf
from conveyor import LLM, SamplingParams, ops
from conveyor.ops.reference import is_tiles

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle on a "
    "stormy night, and what she does next. Make it vivid, with the sea, the wind and the light.",
    "The capital of France is",
    "def fib(n):",
    "1, 2, 3,",
    "Explain why the sky is blue in two sentences.",
]
# The sampled tokens' logprobs are compared too: equal to the last bit, they show the logits
# are the same bits, where equal tokens alone would hide most differences.
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
Output = list[tuple[int, float]]  # (token id, its logprob) per generated token


def _tokens(llm: LLM, prompts: list[str]) -> list[Output]:
    outputs = [o.outputs[0] for o in llm.generate(prompts, PARAMS)]
    return [[(t, lp[t].logprob) for t, lp in zip(o.token_ids, o.logprobs or [], strict=True)]
            for o in outputs]


def _engine(**engine_args: Any) -> LLM:
    default_gguf()  # skips the test when the model package is not installed
    return LLM(**{"kv_cache_memory": "32MiB", "max_model_len": 512, **engine_args})


@pytest.fixture(scope="module")
def reference() -> tuple[list[Output], int]:
    """Each prompt's output on its own (its prompt in one prefill, then plain decodes), and
    the bytes of a KV block."""
    llm = _engine()
    layout = llm.engine.kv_layout
    return [_tokens(llm, [p])[0] for p in PROMPTS], layout.bytes_per_token * layout.block_size


@pytest.fixture(scope="module")
def alone(reference) -> list[Output]:
    return reference[0]


def test_the_cache_takes_the_tile_layout_where_the_cpu_has_bf16_products() -> None:
    """bf16 on a CPU with AMX or AVX512-BF16: the KV cache in the tile layout, which decode
    attention reads in place (rows elsewhere), so the tests here run on the layout this CPU
    serves with."""
    llm = _engine()
    tiles = llm.engine.dtype == torch.bfloat16 and ops.prefill_attention_available()
    assert llm.engine.kv_layout.tiles == tiles
    assert is_tiles(llm.engine.runner.kv_caches[0]) == tiles


def test_batched_and_prefix_cached_outputs_equal_each_alone(alone, kv_free) -> None:
    llm = _engine()
    assert _tokens(llm, PROMPTS) == alone
    hits_before = llm.stats().prefix_cache_hits
    assert _tokens(llm, PROMPTS[::-1]) == alone[::-1]  # the long prompt's blocks are cached
    assert llm.stats().prefix_cache_hits > hits_before
    kv_free(llm)


def test_chunked_outputs_without_prefix_caching_equal_each_alone(alone, kv_free) -> None:
    # 16 tokens a step: the long prompt is cut into chunks next to running decodes.
    llm = _engine(max_num_batched_tokens=16, enable_prefix_caching=False)
    assert _tokens(llm, PROMPTS) == alone
    assert llm.stats().num_steps > 24 + 40 // 16
    kv_free(llm)


def test_a_long_prompt_in_one_chunk_equals_it_chunked(kv_free) -> None:
    """A prompt of ~250 tokens prefilled in one step (a matmul of that many rows, where oneDNN
    may pick another algorithm than for a small batch: it did for the 1536-input MLP down
    projection at 150-256 rows on a 2-core AMX Xeon) against 64-token chunks beside decodes."""
    prompts = [" ".join([PROMPTS[0]] * 6), PROMPTS[1]]
    llm = _engine()
    assert len(llm.get_tokenizer().encode(prompts[0])) > 200
    whole = [_tokens(llm, [p])[0] for p in prompts]
    chunked = _engine(max_num_batched_tokens=64, enable_prefix_caching=False)
    assert _tokens(chunked, prompts) == whole
    kv_free(llm)
    kv_free(chunked)


def test_static_scheduling_gives_the_continuous_outputs(alone, kv_free) -> None:
    llm = _engine(scheduling="static", max_num_seqs=2)
    assert _tokens(llm, PROMPTS) == alone
    kv_free(llm)


def test_recompute_preemption_keeps_the_outputs(reference, kv_free) -> None:
    """A KV cache of 8 blocks of 16 tokens holds two or three of these requests at once: the
    others are preempted and recomputed, their generated tokens through the decode kernel."""
    alone, bytes_per_block = reference
    llm = _engine(kv_cache_memory=8 * bytes_per_block, max_model_len=128, preemption="recompute")
    assert _tokens(llm, PROMPTS) == alone
    assert llm.stats().num_preemptions > 0
    kv_free(llm)


def test_a_head_dim_the_prefill_kernel_does_not_take_stays_batch_invariant(tiny_llama_dir,
                                                                           kv_free) -> None:
    """The tiny model's head_dim of 16 is no multiple of the prefill attention kernel's 32:
    its prefill rows attend as decodes (as float32's do), not through SDPA, whose result for a
    row depends on its chunk: a prompt computed whole in a batch, and again alone after a
    prefix-cache hit on its own blocks (its last token a one-row chunk), gives the same bits."""
    import random

    llm = LLM(model=str(tiny_llama_dir), kv_cache_memory=1 << 22, max_model_len=256)
    if llm.engine.dtype != torch.bfloat16 or not llm.engine.runner.model.backend \
            .prefill_attention_kernel:
        pytest.skip("the bf16 prefill attention kernel needs a CPU with AVX512-BF16 or AMX")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 400) for _ in range(rng.randrange(5, 60))]}
               for _ in range(12)]
    params = PARAMS.replace(max_tokens=8)
    batched = [o.outputs[0] for o in llm.generate(prompts, params)]
    for prompt, together in zip(prompts, batched, strict=True):
        (alone,) = llm.generate([prompt], params)
        assert alone.num_cached_tokens > 0 or len(prompt["prompt_token_ids"]) < 16
        assert alone.outputs[0].token_ids == together.token_ids
        assert alone.outputs[0].logprobs == together.logprobs
    kv_free(llm)


def test_the_dot_kernels_keep_outputs_batch_invariant_on_any_cpu(kv_free) -> None:
    """``amx_matmuls=False``: every matmul takes the dot kernels (with int8 inputs where the
    CPU has VNNI), the default family of CPUs without AMX, and on an AMX CPU the one for a
    single stream's speed. A request's output is the same alone, batched (10 at once: decode
    steps of 8 or more rows split between the threads by request), and chunked."""
    if not ops.dot_kernels_available(amx_matmuls=False):
        pytest.skip("the dot kernels need AVX512-BF16")
    llm = _engine(amx_matmuls=False)
    model = llm.engine.runner.model
    assert all(m.dot and m.blocks is not None for m in [*model._layer_linears(), model.lm_head])
    prompts = PROMPTS + [f"{p} Once more, in other words." for p in PROMPTS]
    alone = [_tokens(llm, [p])[0] for p in prompts]
    assert _tokens(llm, prompts) == alone
    chunked = _engine(amx_matmuls=False, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert _tokens(chunked, prompts) == alone
    kv_free(llm)
    kv_free(chunked)

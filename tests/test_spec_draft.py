"""Speculative decoding with a draft model (``method: draft_model``) on tiny random models.

Three drafts of the tiny Llama, all with its tokenizer and vocabulary: the target itself
(every draft must be accepted, and its K/V must equal the target's), a perturbed copy of it
(some drafts accepted, some rejected) and a smaller model of another shape (1 layer, 2 KV
heads of 8 dims: its own K/V tensors). Greedy tokens and their logprobs equal speculation
off, alone, batched, chunked, preempted (recompute and swap) and prefix-cached; seeded
samples too. Bit-identity rests on conveyor's row-invariant float32 matmuls, as in
tests/test_spec_decode.py.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY_KV_MEMORY
from conveyor import LLM, SamplingParams, StructuredOutputsParams

GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)


def draft_config(path: Path, k: int = 4) -> dict[str, Any]:
    # not adaptive: which steps draft must not depend on how long steps took
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k,
            "adaptive": False}


def tiny(path: Path, draft: Path | None, **engine_args: Any) -> LLM:
    args = {"dtype": "float32", "kv_cache_memory": TINY_KV_MEMORY, "max_model_len": 256,
            **engine_args}
    if draft is not None:
        args["speculative_config"] = draft_config(draft)
    return LLM(model=str(path), **args)


def prompts(count: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 400) for _ in range(5 + 7 * i)] for i in range(count)]


def run(llm: LLM, prompt_list: list[list[int]], params: SamplingParams) -> list[Any]:
    """Per prompt: (token, logprob) pairs, or the token ids when no logprobs were asked."""
    result = []
    for o in llm.generate([{"prompt_token_ids": p} for p in prompt_list], params):
        c = o.outputs[0]
        result.append(c.token_ids if c.logprobs is None else
                      [(t, lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs, strict=True)])
    return result


def copy_model(source: Path, folder: Path, weights: Callable[[dict[str, torch.Tensor]],
                                                 dict[str, torch.Tensor]],
               **config: Any) -> Path:
    """``source`` (an HF folder) with its weights mapped by ``weights`` and its config.json
    fields replaced by ``config``."""
    for item in source.iterdir():
        if item.suffix == ".safetensors":
            save_file(weights(load_file(item)), folder / item.name, metadata={"format": "pt"})
        elif item.name == "config.json":
            (folder / item.name).write_text(json.dumps({**json.loads(item.read_text()),
                                                        **config}))
        elif item.is_file():
            (folder / item.name).write_bytes(item.read_bytes())
    return folder


@pytest.fixture(scope="module")
def perturbed_draft(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's weights plus noise: it agrees with the target on most tokens."""
    gen = torch.Generator().manual_seed(5)
    return copy_model(tiny_llama_dir, tmp_path_factory.mktemp("tiny-draft-perturbed"),
                      lambda weights: {name: w + 0.005 * torch.randn(w.shape, generator=gen)
                                       for name, w in weights.items()})


@pytest.fixture(scope="module")
def small_draft(tiny_model_factory: Any) -> Path:
    return tiny_model_factory("draft-small", "llama", seed=3, num_hidden_layers=1,
                              num_key_value_heads=2, head_dim=8, hidden_size=32,
                              intermediate_size=64)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[Any]:
    """Each prompt alone with logprobs, speculation off."""
    llm = tiny(tiny_llama_dir, None)
    params = SamplingParams(**GREEDY, logprobs=1)
    return [run(llm, [p], params)[0] for p in prompts()]


def test_target_as_its_own_draft_accepts_every_draft(tiny_llama_dir, reference,
                                                     kv_free) -> None:
    """Self-drafting: outputs bit-identical to speculation off, every draft accepted, and
    after every step the draft model's K/V equal to the target's at every position the
    draft model holds as computed (its lazy catch-up saw the tokens the target verified);
    the draft model runs only in drafting steps (not in the prompts' prefill steps)."""
    llm = tiny(tiny_llama_dir, tiny_llama_dir)
    runner = llm.engine.runner
    drafter = runner.drafter
    assert drafter is not None
    execute, checked, passes = runner.execute, [], {"expected": 0, "run": 0}
    draft_step = drafter.model.step

    def counted_step(*args: Any) -> Any:
        passes["run"] += 1
        return draft_step(*args)

    def execute_and_compare(out: Any) -> Any:
        # A drafting step: a catch-up pass and one per further draft position; none else.
        passes["expected"] += max([s.num_spec_tokens for s in out.scheduled], default=0)
        result = execute(out)
        for s in out.scheduled:
            if (computed := drafter.computed.get(s.request_id)) is None:
                continue
            pos = torch.arange(computed)
            blocks = torch.tensor(s.block_ids)[pos // 16]
            for caches in (runner.kv_caches, drafter.kv_caches):
                assert caches.shape[3] == 16  # [layers, 2, blocks, block_size, KVH, D]
            assert torch.equal(drafter.kv_caches[:, :, blocks, pos % 16],
                               runner.kv_caches[:, :, blocks, pos % 16]), s.request_id
            checked.append(computed)
        return result

    runner.execute = execute_and_compare  # type: ignore[method-assign]
    drafter.model.step = counted_step  # type: ignore[method-assign]
    params = SamplingParams(**GREEDY, logprobs=1)
    assert run(llm, prompts(), params) == reference
    stats = llm.stats()
    assert stats.spec_decode_num_draft_tokens > 20
    assert stats.spec_decode_acceptance_rate == 1.0
    assert stats.spec_decode_num_accepted_tokens_per_pos[3] > 0
    assert len(checked) > 10 and max(checked) > max(len(p) for p in prompts())
    assert passes["run"] == passes["expected"] > 0
    assert set(drafter.computed) <= set(runner.states)  # dropped with the runner's state
    kv_free(llm)


def test_draft_outputs_equal_speculation_off(tiny_llama_dir, perturbed_draft, small_draft,
                                             reference, kv_free) -> None:
    """A perturbed copy (partial acceptance) alone and batched, and a smaller model of
    another shape: the tokens and logprobs of speculation off."""
    params = SamplingParams(**GREEDY, logprobs=1)
    llm = tiny(tiny_llama_dir, perturbed_draft)
    assert [run(llm, [p], params)[0] for p in prompts()] == reference
    assert run(llm, prompts(), params) == reference
    stats = llm.stats()
    assert 0.2 < stats.spec_decode_acceptance_rate < 1, stats
    kv_free(llm)
    small = tiny(tiny_llama_dir, small_draft)
    assert run(small, prompts(), params) == reference
    assert small.stats().spec_decode_num_drafts > 0
    kv_free(small)


def test_draft_outputs_equal_when_chunked_preempted_or_prefix_cached(
        tiny_llama_dir, perturbed_draft, reference, kv_free) -> None:
    params = SamplingParams(**GREEDY, logprobs=1)
    chunked = tiny(tiny_llama_dir, perturbed_draft, max_num_batched_tokens=8,
                   enable_prefix_caching=False)
    assert run(chunked, prompts(), params) == reference
    assert chunked.stats().spec_decode_num_accepted_tokens > 0
    kv_free(chunked)
    # 8 blocks of 16 tokens (both models' K/V) for four requests of up to 50 tokens
    bytes_per_block = chunked.engine.kv_layout.bytes_per_token * 16
    for preemption in ("recompute", "swap"):
        small = tiny(tiny_llama_dir, perturbed_draft, kv_cache_memory=8 * bytes_per_block,
                     max_model_len=128, preemption=preemption, swap_space=0.01)
        assert run(small, prompts(), params) == reference, preemption
        stats = small.stats()
        assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0
        assert (stats.num_swapped_blocks > 0) == (preemption == "swap")
        kv_free(small)
    cached = tiny(tiny_llama_dir, perturbed_draft)
    run(cached, prompts()[2:], params)
    assert run(cached, prompts(), params) == reference
    assert cached.stats().prefix_cache_hits > 0
    kv_free(cached)


def test_seeded_samples_equal_speculation_off(tiny_llama_dir, perturbed_draft,
                                              kv_free) -> None:
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=20) for s in range(4)]
    off, on = tiny(tiny_llama_dir, None), tiny(tiny_llama_dir, perturbed_draft)
    ids = [{"prompt_token_ids": p} for p in prompts()]
    expect = [o.outputs[0].token_ids for o in off.generate(ids, params)]
    assert [o.outputs[0].token_ids for o in on.generate(ids, params)] == expect
    assert on.stats().spec_decode_num_accepted_tokens > 0
    kv_free(on)


def test_grammar_forced_drafts_beside_the_draft_models(tiny_llama_dir, perturbed_draft,
                                                       kv_free) -> None:
    """Constrained requests: in one step some verify what their grammar forces, others
    what the draft model proposes (its K/V catching up on the forced tokens it never
    read); the tokens equal speculation and forced drafts off."""
    grammar = StructuredOutputsParams(grammar='root ::= ("abc" | "xy" | "z"){8,12} "!"')
    params = [SamplingParams(temperature=t, seed=i, max_tokens=40, structured_outputs=grammar)
              for i, t in enumerate((0, 0, 0.8, 0.8))]
    ids = [{"prompt_token_ids": p} for p in prompts()]
    off = tiny(tiny_llama_dir, None, grammar_forced_drafts=False)
    expect = [o.outputs[0].token_ids for o in off.generate(ids, params)]
    on = tiny(tiny_llama_dir, perturbed_draft)
    assert [o.outputs[0].token_ids for o in on.generate(ids, params)] == expect
    stats = on.stats()
    assert stats.grammar_forced_accepted_tokens > 0 and stats.spec_decode_num_drafts > 0
    kv_free(on)


def test_kv_budget_pays_both_caches(tiny_llama_dir, small_draft) -> None:
    """The budget's blocks hold the target's and the draft's K/V; the summary says so."""
    off, on = tiny(tiny_llama_dir, None), tiny(tiny_llama_dir, small_draft)
    # float32 K and V: target 2 layers x 4 heads x 16, draft 1 layer x 2 heads x 8
    target_bytes, draft_bytes = 2 * 2 * 4 * 16 * 4, 2 * 1 * 2 * 8 * 4
    assert off.engine.kv_layout.bytes_per_token == target_bytes
    layout = on.engine.kv_layout
    assert (layout.bytes_per_token, layout.draft_bytes_per_token) == \
        (target_bytes + draft_bytes, draft_bytes)
    assert layout.num_blocks == TINY_KV_MEMORY // ((target_bytes + draft_bytes) * 16)
    drafter = on.engine.runner.drafter
    assert drafter is not None
    assert drafter.kv_caches.shape == (1, 2, layout.num_blocks, 16, 2, 8)
    assert drafter.kv_caches.numel() * 4 == layout.num_blocks * 16 * draft_bytes
    assert f"{draft_bytes} of them the draft model's" in on.engine.capacity_summary()


def test_draft_with_another_vocabulary_is_refused(tiny_llama_dir, tmp_path) -> None:
    """The tiny Llama with 8 more embedding rows (the same tokenizer file): refused."""
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]

    def grow(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: torch.cat([w, w[:8]]) if w.shape[0] == vocab else w
                for name, w in weights.items()}

    other = copy_model(tiny_llama_dir, tmp_path, grow, vocab_size=vocab + 8)
    with pytest.raises(ValueError, match=r"speculative_config\.model .*vocabulary of "
                                         rf"{vocab + 8} tokens, the target model {vocab}"):
        tiny(tiny_llama_dir, other)


def test_a_missing_draft_model_names_the_setting(tiny_llama_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"^speculative_config\.model: model path not found"):
        tiny(tiny_llama_dir, tmp_path / "no-such-draft.gguf")

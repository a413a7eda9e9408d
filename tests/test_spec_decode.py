"""Speculative decoding end to end on the tiny random Llama: outputs do not change.

Greedy tokens and their logprobs with n-gram speculation equal speculation off alone,
batched, chunked, preempted and prefix-cached; sampling params that depend on the tokens so
far (penalties, min_tokens, stop strings, max_tokens, logprobs, n) work through verifies; a
seeded sample is the same on and off; unseeded sampling keeps the target's distribution
(chi-square, on the sampler and on the model). A repetition penalty below 1 makes the random
model copy its prompt, so n-gram drafts are proposed and many accepted.

The bit-identity of the logprobs (``test_logprobs_are_bit_identical_with_speculation``)
needs every matmul to give a row the same result whatever the number of rows in the call (a
verify computes k+1 rows of a request where a decode computes one): conveyor's float32 dot
kernels (``csrc/f32_linear.cpp``, every CPU with AVX2) give that; torch's float32 linear
does not (a single row takes a GEMV).
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from typing import Any

import pytest
import torch

from conftest import TINY_KV_MEMORY
from conveyor import LLM, SamplingParams, StructuredOutputsParams
from conveyor.runner.sampler import Sampler, SamplingState

# Not adaptive: which steps draft must not depend on how long steps took on a loaded machine.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2, "adaptive": False}
COPYING = dict(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=0.2)


def tiny(path: Any, spec: bool, **engine_args: Any) -> LLM:
    args = {"dtype": "float32", "kv_cache_memory": TINY_KV_MEMORY, "max_model_len": 512,
            **engine_args}
    if spec:
        args["speculative_config"] = NGRAM
    return LLM(model=str(path), **args)


def prompts(seed: int = 0, count: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        phrase = [rng.randrange(2, 400) for _ in range(6 + i)]
        out.append(phrase * 3 + [rng.randrange(2, 400) for _ in range(i)])
    return out


def run(llm: LLM, prompt_list: list[list[int]], params: SamplingParams) -> list[Any]:
    result = []
    for o in llm.generate([{"prompt_token_ids": p} for p in prompt_list], params):
        c = o.outputs[0]
        if c.logprobs is None:
            result.append(c.token_ids)
        else:
            result.append([(t, lp[t].logprob)
                           for t, lp in zip(c.token_ids, c.logprobs, strict=True)])
    return result


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[Any]:
    """Each prompt alone, speculation off."""
    llm = tiny(tiny_llama_dir, spec=False)
    return [run(llm, [p], SamplingParams(**COPYING))[0] for p in prompts()]


def test_logprobs_are_bit_identical_with_speculation(tiny_llama_dir, kv_free) -> None:
    """Each greedy token's logprob, alone and batched, on and off: the same bits (needs
    row-invariant matmuls, see the module's docstring)."""
    params = SamplingParams(**COPYING, logprobs=1)
    off, on = tiny(tiny_llama_dir, spec=False), tiny(tiny_llama_dir, spec=True)
    expect = run(off, prompts(), params)
    assert run(on, prompts()[:1], params) == expect[:1]
    assert run(on, prompts(), params) == expect
    assert on.stats().spec_decode_num_accepted_tokens > 0
    kv_free(on)


def test_greedy_outputs_equal_speculation_off_alone_and_batched(tiny_llama_dir, reference,
                                                                kv_free) -> None:
    llm = tiny(tiny_llama_dir, spec=True)
    alone = [run(llm, [p], SamplingParams(**COPYING))[0] for p in prompts()]
    assert alone == reference
    assert run(llm, prompts(), SamplingParams(**COPYING)) == reference
    stats = llm.stats()
    accepted, drafts = stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_drafts
    assert accepted > 20  # speculation did happen
    assert stats.spec_decode_num_draft_tokens >= accepted
    assert stats.spec_decode_num_draft_tokens >= drafts > 0
    assert 0 < stats.spec_decode_acceptance_rate < 1
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    # a draft's token is accepted only after every one before it: fewer at each position
    assert sum(per_pos) == accepted and list(per_pos) == sorted(per_pos, reverse=True)
    assert stats.spec_decode_mean_accepted_length == pytest.approx(1 + accepted / drafts)
    kv_free(llm)


def test_verify_rows_are_decode_rows_except_over_the_int8_cache(tiny_llama_dir,
                                                                 kv_free) -> None:
    """A step of decodes and verifies is decode-only (each verify row a decode row, so the
    fused decode path runs it); over the int8 cache, whose CPU kernel writes each row's
    K/V inside its own attention task, a verify stays a chunk. Greedy tokens equal
    speculation off in both."""
    params = SamplingParams(**COPYING)
    for kv_dtype in ("auto", "int8"):
        off = tiny(tiny_llama_dir, spec=False, kv_cache_dtype=kv_dtype)
        on = tiny(tiny_llama_dir, spec=True, kv_cache_dtype=kv_dtype)
        runner, metas = on.engine.runner, []
        prepare = runner._prepare

        def prepare_and_keep(batch: Any, prepare: Any = prepare, metas: list = metas) -> Any:
            result = prepare(batch)
            if any(s.num_spec_tokens for s in batch):
                metas.append(result[2])
            return result

        runner._prepare = prepare_and_keep  # type: ignore[method-assign]
        assert run(on, prompts(), params) == run(off, prompts(), params), kv_dtype
        assert metas, "no verify ran"
        as_decodes = [not m.prefills for m in metas]
        assert all(as_decodes) if kv_dtype == "auto" else not any(as_decodes), kv_dtype
        kv_free(on)


def test_greedy_outputs_equal_when_chunked_preempted_or_prefix_cached(
        tiny_llama_dir, reference, kv_free) -> None:
    chunked = tiny(tiny_llama_dir, spec=True, max_num_batched_tokens=8,
                   enable_prefix_caching=False)
    assert run(chunked, prompts(), SamplingParams(**COPYING)) == reference
    assert chunked.stats().spec_decode_num_drafts > 0
    kv_free(chunked)
    # 10 blocks of 16 tokens for four requests of up to 64 tokens: preemptions
    bytes_per_block = chunked.engine.kv_layout.bytes_per_token * 16
    small = tiny(tiny_llama_dir, spec=True, kv_cache_memory=10 * bytes_per_block,
                 max_model_len=128)
    assert run(small, prompts(), SamplingParams(**COPYING)) == reference
    assert small.stats().num_preemptions > 0
    kv_free(small)
    cached = tiny(tiny_llama_dir, spec=True)
    run(cached, prompts()[:2], SamplingParams(**COPYING))
    assert run(cached, prompts(), SamplingParams(**COPYING)) == reference
    assert cached.stats().prefix_cache_hits > 0
    kv_free(cached)


def test_sampling_params_through_verifies(tiny_llama_dir, kv_free) -> None:
    """stop strings, max_tokens inside an accepted run, min_tokens with EOS, n > 1: the same
    as speculation off."""
    off, on = tiny(tiny_llama_dir, spec=False), tiny(tiny_llama_dir, spec=True)
    tokenizer = off.get_tokenizer()
    text_prompts = ["the sea the sky the sea the sky the sea the", "one two three one two three one"]
    free = off.generate(text_prompts, SamplingParams(temperature=0, max_tokens=30,
                                                     repetition_penalty=0.2))
    stop = free[0].outputs[0].text[10:14]  # a stop string in the middle of the output
    cases = [SamplingParams(temperature=0, max_tokens=30, repetition_penalty=0.2, stop=[stop]),
             SamplingParams(temperature=0, max_tokens=13, repetition_penalty=0.2),
             SamplingParams(temperature=0, max_tokens=30, min_tokens=20,
                            repetition_penalty=0.2, presence_penalty=-2.0, logprobs=2),
             SamplingParams(temperature=0, n=2, max_tokens=20, repetition_penalty=0.3)]
    for params in cases:
        expect = off.generate(text_prompts, params)
        got = on.generate(text_prompts, params)
        for e, g in zip(expect, got, strict=True):
            for eo, go in zip(e.outputs, g.outputs, strict=True):
                assert (go.token_ids, go.text, go.finish_reason, go.stop_reason) == \
                    (eo.token_ids, eo.text, eo.finish_reason, eo.stop_reason), params
                assert [{t: lp.rank for t, lp in d.items()} for d in go.logprobs or []] == \
                    [{t: lp.rank for t, lp in d.items()} for d in eo.logprobs or []]
                assert go.cumulative_logprob == pytest.approx(eo.cumulative_logprob, rel=1e-4)
    assert on.stats().spec_decode_num_accepted_tokens > 0
    assert tokenizer is not None
    kv_free(on)


def test_seeded_samples_equal_speculation_off(tiny_llama_dir, kv_free) -> None:
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=30, repetition_penalty=0.2)
              for s in range(4)]
    off, on = tiny(tiny_llama_dir, spec=False), tiny(tiny_llama_dir, spec=True)
    ids = [{"prompt_token_ids": p} for p in prompts()]
    expect = [o.outputs[0].token_ids for o in off.generate(ids, params)]
    assert [o.outputs[0].token_ids for o in on.generate(ids, params)] == expect
    assert [o.outputs[0].token_ids for o in on.generate(ids[::-1], params[::-1])] == expect[::-1]
    assert on.stats().spec_decode_num_accepted_tokens > 0
    kv_free(on)


def test_constrained_requests_verify_drafts_under_their_grammar(tiny_llama_dir,
                                                                kv_free) -> None:
    """Structured outputs with n-gram drafts: each draft row is masked by the grammar after
    the drafts before it, so greedy and seeded-sampled texts equal speculation off, they
    match their grammar, and drafts are accepted (repeating grammars: the n-gram proposer
    finds the pattern). Grammar-forced drafts off: they would take the n-gram drafts' place
    wherever the grammar forces a token (test_structured_outputs has them)."""
    kinds = [StructuredOutputsParams(grammar='root ::= "x" ("ab" | "cd"){10,20} "!"'),
             StructuredOutputsParams(regex=r"(ab|cd|ef)( (ab|cd|ef)){30}")]
    checks = [r"x((ab)|(cd)){10,20}!", r"(ab|cd|ef)( (ab|cd|ef)){30}"]
    texts = ["one two three", "ab cd ab ef cd ab cd", "the cat sat on"]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=80, structured_outputs=k)
              for i, (t, k) in enumerate((t, k) for t in (0, 0.8) for k in kinds
                                         for _ in texts)]
    prompt_list = [t * 2 for _ in range(2 * len(kinds)) for t in texts]
    off = tiny(tiny_llama_dir, spec=False, grammar_forced_drafts=False)
    on = tiny(tiny_llama_dir, spec=True, grammar_forced_drafts=False)
    expect = [o.outputs[0].text for o in off.generate(prompt_list, params)]
    got = on.generate(prompt_list, params)
    assert [o.outputs[0].text for o in got] == expect
    for o, check in zip(got, [c for _ in range(2) for c in checks for _ in texts],
                        strict=True):
        assert o.outputs[0].finish_reason == "stop" and re.fullmatch(check, o.outputs[0].text)
    stats = on.stats()
    assert stats.spec_decode_num_accepted_tokens > 50, stats
    assert stats.spec_decode_acceptance_rate < 1  # some drafts were refused
    kv_free(on)


# ---------------------------------------------------------------- distributions
def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square(df) (Wilson-Hilferty)."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def chi_square_two_sample(a: Counter, b: Counter) -> tuple[float, int]:
    """Homogeneity statistic of two samples' counts, and its degrees of freedom (categories
    with fewer than 10 observations in all are pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = [k for k in a.keys() | b.keys() if a[k] + b[k] >= 10]
    pooled_a = na - sum(a[k] for k in keys)
    pooled_b = nb - sum(b[k] for k in keys)
    cells = [(a[k], b[k]) for k in keys] + ([(pooled_a, pooled_b)]
                                             if pooled_a + pooled_b else [])
    stat = 0.0
    for x, y in cells:
        total = x + y
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat, len(cells) - 1


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Sampler.verify on fixed logits: the first token is distributed as p0 (kept draft or
    not), and after a kept draft the next as p1: chi-square against the exact p."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.5, 0.2, 1.0, 0.3]])
    sampler = Sampler(torch.device("cpu"), seed=1)
    batch = 400  # requests per verify call, each with the same two rows and draft
    states = [SamplingState(SamplingParams(temperature=1.0), [0], [], None)
              for _ in range(batch)]
    first, second = Counter(), Counter()
    trials = 3 * batch
    for _ in range(trials // batch):
        for tokens, _ in sampler.verify(logits.repeat(batch, 1), states, [[1]] * batch):
            first[tokens[0]] += 1
            if tokens[0] == 1:
                second[tokens[1]] += 1
    for counts, row in ((first, logits[0]), (second, logits[1])):
        p = torch.softmax(row, dim=-1).tolist()
        n = sum(counts.values())
        stat = sum((counts[i] - n * p[i]) ** 2 / (n * p[i]) for i in range(5))
        assert stat < chi_square_critical(4), (counts, p)
    assert abs(first[1] / trials - torch.softmax(logits[0], -1)[1].item()) < 0.03


def test_next_token_distribution_with_speculation_equals_off(tiny_llama_dir, kv_free) -> None:
    """300 unseeded samples of 8 tokens after a repeating prompt, on and off: the tokens at
    each position past the first are one distribution (chi-square homogeneity, 0.1% level).
    The model loops on its own output (repetition penalty below 1), and n-gram drafts of the
    loop are often accepted: a wrong acceptance rule would skew the later positions."""
    prompt = prompts()[0]
    params = SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True,
                            repetition_penalty=0.2)
    samples = {}
    for spec in (False, True):
        llm = tiny(tiny_llama_dir, spec=spec, seed=11 if spec else 12)
        outs = [o.outputs[0].token_ids
                for o in llm.generate([{"prompt_token_ids": prompt}] * 300, params)]
        samples[spec] = outs
        if spec:
            assert llm.stats().spec_decode_num_accepted_tokens > 80
        kv_free(llm)
    for pos in range(2, 8):
        stat, df = chi_square_two_sample(Counter(o[pos] for o in samples[False]),
                                         Counter(o[pos] for o in samples[True]))
        assert df >= 1 and stat < chi_square_critical(df), (pos, stat, df)


def test_bad_speculative_config_is_a_clear_error(tiny_llama_dir) -> None:
    for bad, field in [({"method": "eagle"}, "method"),
                       ({"method": "ngram", "num_speculative_tokens": 0},
                        "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 17},
                        "num_speculative_tokens"),
                       ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2},
                        "prompt_lookup_max"),
                       ({"method": "ngram", "lookup": 2}, "lookup"),
                       ({"method": "ngram", "adaptive": "yes"}, "adaptive"),
                       ("{not json", "JSON")]:
        with pytest.raises(ValueError, match=field):
            LLM(model=str(tiny_llama_dir), speculative_config=bad)

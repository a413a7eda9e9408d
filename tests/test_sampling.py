"""Sampling and stopping through LLM.generate: seeds, filters, penalties, stops, n, logprobs.

Mostly on the tiny random Llama (milliseconds a step); stop strings, EOS and min_tokens on the
default model, whose text is real language and which emits EOS by itself.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.core.outputs import Logprob

PROMPT = [11, 42, 7, 300, 12, 99, 250, 31]


def _ids(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    (out,) = llm.generate({"prompt_token_ids": prompt}, params)
    return out.outputs[0].token_ids


@pytest.fixture(scope="module")
def others(tiny_llm) -> list[list[int]]:
    rng = random.Random(3)
    vocab = tiny_llm.engine.model_config.vocab_size
    return [[rng.randrange(2, vocab) for _ in range(rng.randrange(2, 40))] for _ in range(7)]


@pytest.fixture(scope="module")
def greedy_ids(tiny_llm) -> list[int]:
    ids = _ids(tiny_llm, PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    # The penalty tests need repeats to penalize: a random model's greedy output loops.
    assert len(set(ids)) < len(ids), ids
    return ids


# --- seeds ----------------------------------------------------------------------------------

def test_seed_is_independent_of_the_batch(tiny_llm, others, kv_free) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = _ids(tiny_llm, PROMPT, seeded)
    # Other requests (unseeded, other seeds, greedy) before and after it in the same batch.
    mixed = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
             SamplingParams(temperature=0.7, seed=5, max_tokens=10, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    prompts = [others[0], others[1], PROMPT, others[2], others[3]]
    params = [mixed[0], mixed[1], seeded, mixed[2], mixed[0]]
    batched = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert batched[2].outputs[0].token_ids == alone
    assert _ids(tiny_llm, PROMPT, seeded) == alone  # and across calls
    other_seed = _ids(tiny_llm, PROMPT, seeded.replace(seed=4321))
    assert other_seed != alone  # the seed matters (16 tokens from ~400 at temperature 1)
    kv_free(tiny_llm)


def test_negative_seeds_are_seeds(tiny_llm, kv_free) -> None:
    """Any 64-bit signed seed is taken (vLLM and OpenAI take them): reproducible, its own."""
    negative = SamplingParams(temperature=1.0, seed=-1234, max_tokens=16, ignore_eos=True)
    first = _ids(tiny_llm, PROMPT, negative)
    assert _ids(tiny_llm, PROMPT, negative) == first
    assert _ids(tiny_llm, PROMPT, negative.replace(seed=1234)) != first
    low = _ids(tiny_llm, PROMPT, negative.replace(seed=-(2**63), n=2))
    assert low == _ids(tiny_llm, PROMPT, negative.replace(seed=-(2**63), n=2))
    for bad in (-(2**63) - 1, 2**63):
        with pytest.raises(ValueError, match="seed"):
            negative.replace(seed=bad)
    kv_free(tiny_llm)


def test_seed_survives_preemption(tiny_llama_dir, others, kv_free) -> None:
    """A resumed seeded request continues its random stream; it does not restart it."""
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=6 * 16 * 1024,
              max_model_len=1024)
    seeded = SamplingParams(temperature=1.0, seed=99, max_tokens=40, ignore_eos=True)
    alone = _ids(llm, PROMPT, seeded)
    filler = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # The seeded request is the newest when blocks run out, so it is the one preempted.
    prompts = [others[0], others[1], others[2], PROMPT]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [filler, filler, filler, seeded])
    assert outputs[3].metrics.num_preemptions > 0, "the scenario must preempt the seeded one"
    kv_free(llm)
    assert outputs[3].outputs[0].token_ids == alone


# --- filters that reduce to greedy -----------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.8, "top_k": 1},
    {"temperature": 1.0, "top_p": 1e-6},
    {"temperature": 1.5, "min_p": 1.0},
    {"temperature": 1e-4},
], ids=["top_k=1", "top_p-tiny", "min_p=1", "temperature-tiny"])
def test_filters_that_keep_one_token_equal_greedy(tiny_llm, greedy_ids, kwargs,
                                                  kv_free) -> None:
    params = SamplingParams(max_tokens=16, ignore_eos=True, seed=3, **kwargs)
    assert _ids(tiny_llm, PROMPT, params) == greedy_ids
    kv_free(tiny_llm)


def test_min_p_judges_the_tempered_distribution_before_top_k_and_top_p() -> None:
    """vLLM's order: temperature, min-p, then top-k and top-p on what min-p left. Probabilities
    .5/.3/.15/.05 with min_p 0.2 keep three tokens (.05 < .2 x .5); top_p 0.82 on those
    (renormalized: .53/.32/.16) keeps two. Top-p first would keep three."""
    from conveyor.runner.sampler import Sampler, SamplingState

    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    state = SamplingState(SamplingParams(temperature=1.0, min_p=0.2, top_p=0.82), [1], [], None)
    probs = Sampler(torch.device("cpu"))._probs(logits, [state])
    assert (probs[0] > 0).tolist() == [True, True, False, False]
    assert torch.allclose(probs[0, :2], torch.tensor([0.625, 0.375]))


@pytest.mark.parametrize("temperature", [1e-6, 1e-40])
def test_a_temperature_too_small_to_divide_by_is_greedy(tiny_llm, greedy_ids, temperature,
                                                        kv_free) -> None:
    """Below 1e-5 (vLLM's rule) a request decodes greedily: logits / 1e-40 overflow to inf,
    and the NaNs of their softmax sampled token 0 every time."""
    params = SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True, seed=3)
    assert params.greedy
    assert _ids(tiny_llm, PROMPT, params) == greedy_ids
    kv_free(tiny_llm)


def test_logit_bias_and_allowed_token_ids(tiny_llm, greedy_ids, others, kv_free) -> None:
    """OpenAI's logit_bias and vLLM's allowed_token_ids, greedy and sampled, alone and in a
    batch with requests that use neither (whose tokens do not change)."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    banned = greedy.replace(logit_bias={greedy_ids[0]: -100})
    assert _ids(tiny_llm, PROMPT, banned)[0] != greedy_ids[0]
    forced = 7
    assert _ids(tiny_llm, PROMPT, greedy.replace(logit_bias={forced: 100})) == [forced] * 16
    allowed = (5, 9, 11)
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True,
                             allowed_token_ids=allowed)
    outputs = tiny_llm.generate([{"prompt_token_ids": p} for p in (PROMPT, others[0], PROMPT)],
                                [sampled, greedy, greedy.replace(allowed_token_ids=allowed)])
    assert set(outputs[0].outputs[0].token_ids) <= set(allowed)
    assert len(set(outputs[0].outputs[0].token_ids)) > 1  # sampled, not one forced token
    assert outputs[1].outputs[0].token_ids == _ids(tiny_llm, others[0], greedy)
    assert set(outputs[2].outputs[0].token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="logit_bias"):
        _ids(tiny_llm, PROMPT, greedy.replace(logit_bias={10**6: 1.0}))
    kv_free(tiny_llm)


def test_top_k_and_min_p_bound_the_sampled_token(tiny_llm, others, kv_free) -> None:
    """At temperature 1 the returned (raw) logprobs are the sampling distribution."""
    prompts = [{"prompt_token_ids": p} for p in [PROMPT, *others[:3]]]
    top_k = SamplingParams(temperature=1.0, top_k=3, logprobs=1, seed=11, max_tokens=24,
                           ignore_eos=True)
    for out in tiny_llm.generate(prompts, top_k):
        for token, lps in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
            assert lps[token].rank <= 3
    min_p = 0.3
    params = SamplingParams(temperature=1.0, min_p=min_p, logprobs=1, seed=12, max_tokens=24,
                            ignore_eos=True)
    for out in tiny_llm.generate(prompts, params):
        for token, lps in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
            best = max(lp.logprob for lp in lps.values())
            assert lps[token].logprob >= best + math.log(min_p) - 1e-4
    kv_free(tiny_llm)


def test_temperature_spreads_samples(tiny_llm, kv_free) -> None:
    """Unseeded high-temperature samples are not all the same (the sampler samples)."""
    params = SamplingParams(temperature=2.0, max_tokens=8, ignore_eos=True)
    outputs = tiny_llm.generate([{"prompt_token_ids": PROMPT}] * 4, params)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) > 1
    kv_free(tiny_llm)


# --- penalties, against a reference built on transformers' logits ---------------------------

def _penalized_greedy(model, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """vLLM's penalty semantics: repetition over prompt + output, presence/frequency over
    the output only."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            if params.repetition_penalty != 1:
                seen = torch.tensor(sorted(set(prompt + out)))
                values = logits[seen]
                logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                           values * params.repetition_penalty)
            counts = torch.bincount(torch.tensor(out, dtype=torch.long),
                                    minlength=logits.numel()).float()
            logits -= params.frequency_penalty * counts
            logits -= params.presence_penalty * (counts > 0).float()
            out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("kwargs", [
    {"repetition_penalty": 1.8},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
], ids=["repetition", "frequency", "presence", "mixed"])
def test_penalties(tiny_llm, tiny_llama_dir, hf_tiny_model, greedy_ids, kwargs,
                   kv_free) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **kwargs)
    got = _ids(tiny_llm, PROMPT, params)
    assert got != greedy_ids
    assert got == _penalized_greedy(hf_tiny_model(tiny_llama_dir), PROMPT, 16, params)
    kv_free(tiny_llm)


# --- stopping ---------------------------------------------------------------------------------

STOP_PROMPT = "The sky is"


@pytest.fixture(scope="module")
def default_greedy(default_llm):
    """(token ids, text) of the default model's greedy continuation of STOP_PROMPT."""
    (out,) = default_llm.generate(STOP_PROMPT, SamplingParams(temperature=0, max_tokens=12,
                                                              ignore_eos=True))
    return out.outputs[0].token_ids, out.outputs[0].text


def test_stop_string_across_token_boundary(default_llm, default_greedy, kv_free) -> None:
    ids, text = default_greedy
    tokenizer = default_llm.get_tokenizer()
    # A stop string from the middle of one token to the middle of the next.
    k = next(k for k in range(1, len(ids) - 1)
             if len(tokenizer.decode(ids[k - 1:k])) >= 2
             and len(tokenizer.decode(ids[k:k + 1])) >= 2)
    boundary = len(tokenizer.decode(ids[:k]))
    assert text.startswith(tokenizer.decode(ids[:k]))
    stop = text[boundary - 2:boundary + 2]
    expected = text[:text.find(stop)]
    (out,) = default_llm.generate(STOP_PROMPT, SamplingParams(temperature=0, max_tokens=12,
                                                              stop=[stop, "never-appears"]))
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop
    assert completion.text == expected
    assert stop not in completion.text
    # Generation stopped on the token that completed the stop string.
    assert completion.token_ids == ids[:len(completion.token_ids)]
    assert len(completion.token_ids) <= k + 1
    kv_free(default_llm)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_on_the_last_allowed_token_is_a_stop(default_llm, default_greedy, kv_free,
                                                         include) -> None:
    """A stop string that the max_tokens-th token completes: finish_reason "stop" (as vLLM),
    not "length", and the text cut at it."""
    ids, text = default_greedy
    tokenizer = default_llm.get_tokenizer()
    k = 4
    before, through = len(tokenizer.decode(ids[:k])), tokenizer.decode(ids[:k + 1])
    stop = through[before - 1:]  # the last character of token k-1 and all of token k's text
    assert text.find(stop) == before - 1 and through.endswith(stop)
    (out,) = default_llm.generate(STOP_PROMPT, SamplingParams(
        temperature=0, max_tokens=k + 1, stop=[stop], include_stop_str_in_output=include))
    completion = out.outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert completion.text == (through if include else through[:before - 1])
    assert completion.token_ids == ids[:k + 1]
    kv_free(default_llm)


def test_min_tokens_holds_back_stop_strings(default_llm, default_greedy, kv_free) -> None:
    """As vLLM: a stop string counts only where it ends past the first min_tokens tokens."""
    ids, text = default_greedy
    tokenizer = default_llm.get_tokenizer()
    stop = tokenizer.decode(ids[1:2])  # " canvas": the greedy text says it three times
    for min_tokens in (0, 3):
        held = len(tokenizer.decode(ids[:min_tokens]))
        start = text.find(stop, max(held - len(stop) + 1, 0))
        # (a longer stop string beside it, never written, must not widen the search back
        # into the held text)
        stops = [stop, "x" * 20 + "never"]
        assert (start > text.find(stop)) == (min_tokens > 0)  # a later one, past the first
        (out,) = default_llm.generate(STOP_PROMPT, SamplingParams(
            temperature=0, max_tokens=12, min_tokens=min_tokens, stop=stops))
        completion = out.outputs[0]
        assert completion.finish_reason == "stop" and completion.text == text[:start]
        assert completion.token_ids == ids[:len(completion.token_ids)]
    kv_free(default_llm)


def test_bad_words(default_llm, default_greedy, kv_free) -> None:
    """vLLM's bad_words: a one-token word is never chosen; a longer one loses its last
    token wherever the output ends with the tokens before it."""
    ids, text = default_greedy
    assert text.startswith(" a canvas of colors,")  # the premise
    for words, kept in ((["canvas"], " a"), (["of colors"], " a canvas of")):
        (out,) = default_llm.generate(STOP_PROMPT, SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, bad_words=words))
        completion = out.outputs[0].text
        assert completion.startswith(kept) and not completion.startswith(text[:len(kept) + 3])
        assert all(word not in completion for word in words), completion
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])
    assert SamplingParams(bad_words="canvas").bad_words == ("canvas",)  # one word, as stop
    kv_free(default_llm)


def test_stop_string_included_on_request(default_llm, default_greedy, kv_free) -> None:
    ids, text = default_greedy
    stop = text[5:9]
    (out,) = default_llm.generate(STOP_PROMPT, SamplingParams(
        temperature=0, max_tokens=12, stop=stop, include_stop_str_in_output=True))
    assert out.outputs[0].text == text[:text.find(stop) + len(stop)]
    assert out.outputs[0].finish_reason == "stop"
    kv_free(default_llm)


# The prompt: greedy, its output starts ":" then a token of newline + 23 spaces, so
# the stop string ":\n" begins in earlier text and ends inside a 24-character token.
INDENTED_CODE_PROMPT = ("def check(a, b, c, d, e):\n    if a:\n        if b:\n            if c:\n"
                        "                if d:\n                    if e:\n"
                        "                        return 1\n                    else")


def test_stop_string_ending_inside_a_long_token(default_llm, kv_free) -> None:
    params = SamplingParams(temperature=0, max_tokens=24)
    (free,) = default_llm.generate(INDENTED_CODE_PROMPT, params)
    text = free.outputs[0].text
    assert ":\n" in text  # the unstopped output holds the stop string
    (out,) = default_llm.generate(INDENTED_CODE_PROMPT, params.replace(stop=(":\n",)))
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == ":\n"
    assert completion.text == text[:text.find(":\n")]
    assert len(completion.token_ids) < 24
    kv_free(default_llm)


@pytest.mark.parametrize("include", [False, True])
def test_stop_checker_finds_a_stop_string_ending_in_a_long_new_text(default_llm,
                                                                    include) -> None:
    """The checker alone, with the real tokenizer: ':' then one token of newline + 23+ spaces;
    the stop string starts in the first token's text and ends 1 character into the second."""
    from conveyor.engine.sequence import Sequence
    from conveyor.request import Request, RequestStatus
    from conveyor.tokenizer.detokenizer import IncrementalDetokenizer

    tokenizer = default_llm.get_tokenizer()
    colon, indent = tokenizer.encode(":"), tokenizer.encode("\n" + " " * 23)
    assert len(colon) == 1 and len(indent) == 1, (colon, indent)  # one long token
    params = SamplingParams(stop=("never", ":\n"), include_stop_str_in_output=include)
    request = Request("r", [1, 2], params, status=RequestStatus.RUNNING)
    seq = Sequence(0, request, IncrementalDetokenizer(tokenizer, [1, 2]))
    for token in colon + indent:
        request.append_output_token(token)
        found = seq.add_token(token, None)
    assert found == ":\n" and seq.stop_reason == ":\n"
    assert seq.text == (":\n" if include else "")


def test_stop_token_ids(default_llm, default_greedy, kv_free) -> None:
    ids, _ = default_greedy
    tokenizer = default_llm.get_tokenizer()
    stop_id = ids[6]
    first = ids.index(stop_id)
    (out,) = default_llm.generate(STOP_PROMPT, SamplingParams(
        temperature=0, max_tokens=12, stop_token_ids=[stop_id]))
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id
    assert completion.token_ids == ids[:first + 1]
    assert completion.text == tokenizer.decode(ids[:first])  # the stop token's text is not
    kv_free(default_llm)


EOS_PROMPT = "Write a haiku about the sea."


@pytest.fixture(scope="module")
def eos_greedy(default_llm) -> list[int]:
    """Greedy ids of EOS_PROMPT, which the default model ends with EOS (id 2) on its own."""
    (out,) = default_llm.generate(EOS_PROMPT, SamplingParams(temperature=0, max_tokens=40))
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.token_ids[-1] == 2
    assert len(completion.token_ids) < 30
    return completion.token_ids


def test_ignore_eos_runs_to_max_tokens(default_llm, eos_greedy, kv_free) -> None:
    max_tokens = len(eos_greedy) + 1
    (out,) = default_llm.generate(EOS_PROMPT, SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))
    completion = out.outputs[0]
    assert len(completion.token_ids) == max_tokens
    assert completion.finish_reason == "length"
    assert completion.token_ids[:len(eos_greedy)] == eos_greedy
    kv_free(default_llm)


def test_max_tokens_is_exact(tiny_llm, kv_free) -> None:
    for max_tokens in (1, 2, 7):
        (out,) = tiny_llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
            temperature=0.5, max_tokens=max_tokens, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == max_tokens
        assert out.outputs[0].finish_reason == "length"
    kv_free(tiny_llm)


@pytest.fixture(scope="module")
def min_tokens_output(default_llm, eos_greedy, kv_free):
    """(min_tokens, completion) of EOS_PROMPT asked for more tokens than it has before EOS."""
    min_tokens = len(eos_greedy) + 3
    (out,) = default_llm.generate(EOS_PROMPT, SamplingParams(
        temperature=0, max_tokens=min_tokens + 1, min_tokens=min_tokens))
    kv_free(default_llm)
    return min_tokens, out.outputs[0]


def test_min_tokens_delays_the_stop(min_tokens_output) -> None:
    min_tokens, completion = min_tokens_output
    assert len(completion.token_ids) >= min_tokens


def test_min_tokens_suppresses_eos(min_tokens_output) -> None:
    min_tokens, completion = min_tokens_output
    assert 2 not in completion.token_ids[:min_tokens]  # EOS cannot be sampled before that


# --- n samples per prompt ---------------------------------------------------------------------

LONG_PROMPT = [(i * 37) % 400 + 2 for i in range(40)]  # 2.5 blocks of 16: 2 full, shareable


def test_n_seeded_samples_differ_and_share_the_prompt(tiny_llm, kv_free) -> None:
    before = tiny_llm.stats().prefix_cache_hits
    (out,) = tiny_llm.generate({"prompt_token_ids": LONG_PROMPT}, SamplingParams(
        n=2, temperature=1.0, seed=21, max_tokens=12, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    assert tiny_llm.stats().prefix_cache_hits > before
    assert out.finished
    kv_free(tiny_llm)


def test_n_greedy_samples_are_equal(tiny_llm, kv_free) -> None:
    (out,) = tiny_llm.generate({"prompt_token_ids": LONG_PROMPT}, SamplingParams(
        n=3, temperature=0, max_tokens=12, ignore_eos=True))
    (single,) = tiny_llm.generate({"prompt_token_ids": LONG_PROMPT}, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))
    assert len(out.outputs) == 3
    assert all(c.token_ids == single.outputs[0].token_ids for c in out.outputs)
    assert all(c.text == single.outputs[0].text for c in out.outputs)
    kv_free(tiny_llm)


# --- logprobs ---------------------------------------------------------------------------------

def test_logprobs_match_transformers(tiny_llm, tiny_llama_dir, hf_tiny_model, greedy_reference,
                                     kv_free) -> None:
    top_n = 5
    (out,) = tiny_llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, logprobs=top_n))
    completion = out.outputs[0]
    expected_ids, logits = greedy_reference(hf_tiny_model(tiny_llama_dir), PROMPT, 10)
    assert completion.token_ids == expected_ids
    assert completion.logprobs is not None and len(completion.logprobs) == 10
    total = 0.0
    for token, entry, row in zip(completion.token_ids, completion.logprobs, logits,
                                 strict=True):
        reference = torch.log_softmax(row, dim=-1)
        assert top_n <= len(entry) <= top_n + 1
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == list(range(1, top_n + 1))
        top = reference.topk(top_n)
        assert [t for t, _ in sorted(entry.items(), key=lambda kv: kv[1].rank)] \
            == top.indices.tolist()
        for token_id, lp in entry.items():
            assert lp.logprob == pytest.approx(float(reference[token_id]), abs=1e-4)
            assert lp.decoded_token == tiny_llm.get_tokenizer().decode(
                [token_id], skip_special_tokens=False)
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
    kv_free(tiny_llm)


def test_logprobs_of_sampled_tokens(tiny_llm, kv_free) -> None:
    (out,) = tiny_llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=1.5, seed=8, max_tokens=16, ignore_eos=True, logprobs=2))
    completion = out.outputs[0]
    ranks = []
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token in entry and 2 <= len(entry) <= 3
        lp = entry[token]
        ranks.append(lp.rank)
        better = [e for e in entry.values() if e.logprob > lp.logprob]
        assert lp.rank >= len(better) + 1
        assert lp.logprob <= 0
    assert max(ranks) > 1  # at temperature 1.5 some sampled token is not the top one
    (zero,) = tiny_llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))
    assert [list(e) for e in zero.outputs[0].logprobs] == [[t] for t in zero.outputs[0].token_ids]
    (none,) = tiny_llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True))
    assert none.outputs[0].logprobs is None
    kv_free(tiny_llm)


def test_a_step_brings_tokens_and_logprobs_to_the_host_in_one_copy(monkeypatch) -> None:
    """The sampler computes every row's logprobs on the logits' device and copies them to the
    host once, with the token ids (issue 14: one device sync per step, not three per request
    asking for logprobs). A row's entries are what it would get alone: its sampled token's
    logprob and rank, its top n (rows asking the same n share one topk, so ties at the edge
    of the top n cannot depend on the other rows)."""
    from conveyor.runner.sampler import Sampler, SamplingState

    gen = torch.Generator().manual_seed(0)
    # bf16-like logits: few distinct values, so ties are everywhere
    logits = (torch.randn(6, 50, generator=gen) * 4).round() / 4
    wanted = [None, 0, 2, 5, 2, None]
    states = [SamplingState(SamplingParams(temperature=1.0, seed=i, logprobs=n), [1, 2], [],
                            torch.Generator().manual_seed(i)) for i, n in enumerate(wanted)]
    sampler = Sampler(torch.device("cpu"), seed=1)
    copies = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: copies.append(t.shape) or real_tolist(t))
    for name in ("item", "__int__", "__float__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, lambda t, name=name: pytest.fail(f"{name}()"))
    tokens, logprobs = sampler(logits, states)
    monkeypatch.undo()
    assert len(copies) == 1
    reference = torch.log_softmax(logits, dim=-1)
    for i, (token, n) in enumerate(zip(tokens, wanted, strict=True)):
        if n is None:
            assert logprobs[i] is None
            continue
        row = reference[i]
        expected = {token: Logprob(float(row[token]), int((row > row[token]).sum()) + 1)}
        values, ids = reference[i:i + 1].topk(n)  # the row alone
        for r, (v, t) in enumerate(zip(values[0].tolist(), ids[0].tolist(), strict=True),
                                       start=1):
            expected.setdefault(t, Logprob(v, r))
        assert logprobs[i] == expected
    assert {e[t].rank for e, t in zip(logprobs, tokens, strict=True) if e} != {1}  # sampled, not all top

"""The offline API end to end: batch invariance, preemption, chunked prefill, bad input,
incremental detokenization and per-request metrics. Every workload ends with no KV leak."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import save_file

from conftest import TINY_KV_MEMORY
from conveyor import LLM, RequestOutputKind, SamplingParams, StructuredOutputsParams
from conveyor.outputs import RequestOutput

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
NUM_PROMPTS = 32


@pytest.fixture(scope="module")
def prompts(tiny_llm) -> list[list[int]]:
    """32 token-id prompts of 3..60 tokens (1 to 4 KV blocks), seeded."""
    rng = random.Random(1)
    vocab = tiny_llm.engine.model_config.vocab_size
    return [[rng.randrange(2, vocab) for _ in range(rng.randrange(3, 61))]
            for _ in range(NUM_PROMPTS)]


# Prompts also run alone (one engine step per token each, so a subset keeps the test short):
# the shortest, the longest, and some in between.
ALONE = (0, 1, 5, 13, 21, 31)


@pytest.fixture(scope="module")
def alone(tiny_llm, prompts, kv_free) -> dict[int, list[int]]:
    """Greedy output of each ALONE prompt served by itself."""
    result = {}
    for i in ALONE:
        (out,) = tiny_llm.generate({"prompt_token_ids": prompts[i]}, GREEDY)
        result[i] = out.outputs[0].token_ids
        assert len(result[i]) == MAX_TOKENS
    kv_free(tiny_llm)
    return result


def run_staggered(llm: LLM, prompts: list[list[int]], params: SamplingParams,
                  per_step: int = 3) -> list[RequestOutput]:
    """Add `per_step` requests between engine steps (staggered arrivals); run to the end."""
    engine = llm.engine
    ids: list[str] = []
    final: dict[str, RequestOutput] = {}
    pending = list(prompts)
    while pending or engine.has_unfinished_requests():
        for prompt in pending[:per_step]:
            ids.append(engine.add_request({"prompt_token_ids": prompt}, params))
        del pending[:per_step]
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    return [final[i] for i in ids]


def _assert_same(outputs: list[RequestOutput], expected: dict[int, list[int]]) -> None:
    for i, want in expected.items():
        assert outputs[i].outputs[0].token_ids == want, f"prompt {i}"


def test_batch_of_32_at_once_matches_alone(tiny_llm, prompts, alone, kv_free) -> None:
    outputs = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    _assert_same(outputs, alone)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
    kv_free(tiny_llm)


def test_staggered_arrivals_match_alone(tiny_llm, prompts, alone, kv_free) -> None:
    together = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    staggered = run_staggered(tiny_llm, prompts, GREEDY)
    _assert_same(staggered, alone)
    for a, b in zip(together, staggered, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    kv_free(tiny_llm)


def test_preemption_keeps_outputs(tiny_llama_dir, prompts, alone, kv_free) -> None:
    # 12 blocks of 16 tokens for 32 requests of up to 76 tokens: preemptions are certain.
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=12 * 16 * 1024,
              max_model_len=1024)
    assert llm.stats().kv_blocks_total == 12
    outputs = run_staggered(llm, prompts, GREEDY, per_step=8)
    stats = llm.stats()
    assert stats.num_preemptions > 0
    _assert_same(outputs, alone)
    reference = {i: o.outputs[0].token_ids for i, o in
                 enumerate(run_staggered(llm, prompts, GREEDY, per_step=NUM_PROMPTS))}
    _assert_same(outputs, reference)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert sum(o.metrics.num_preemptions for o in outputs) <= llm.stats().num_preemptions
    for output in outputs:
        _assert_metrics_ordered(output)
    kv_free(llm)


def test_chunked_prefill_keeps_outputs(tiny_llama_dir, prompts, alone, kv_free) -> None:
    # A 16-token budget splits every prompt longer than 16 tokens across steps, next to
    # running decodes; block_size 8 puts chunk edges inside and across blocks.
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=1 << 20,
              max_model_len=1024, max_num_batched_tokens=16, block_size=8)
    long_prompt = prompts[0] * 4 + prompts[1]
    (long_alone,) = llm.generate({"prompt_token_ids": long_prompt}, GREEDY)
    outputs = run_staggered(llm, [long_prompt, *prompts], GREEDY, per_step=4)
    assert outputs[0].outputs[0].token_ids == long_alone.outputs[0].token_ids
    _assert_same(outputs[1:], alone)
    assert llm.stats().num_steps > sum(len(p) for p in prompts) // 16
    kv_free(llm)


def test_default_model_batch_invariance(default_llm, kv_free) -> None:
    prompts = ["The capital of France is", "Once upon a time", "def add(a, b):"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (alone,) = default_llm.generate(prompts[0], params)
    together = default_llm.generate(prompts * 2, params)
    assert all(o.outputs[0].token_ids == alone.outputs[0].token_ids for o in together[::3])
    for i in range(3):
        assert together[i].outputs[0].token_ids == together[i + 3].outputs[0].token_ids
    kv_free(default_llm)


# --- incremental detokenization -------------------------------------------------------------

REPLACEMENT_CHAR = "\ufffd"


@pytest.fixture(scope="module")
def sampled_tiny(tiny_llm, prompts, kv_free) -> list[RequestOutput]:
    """Seeded samples of the tiny model: random byte-level tokens, which split multi-byte
    characters."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    outputs = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts[:12]], params)
    kv_free(tiny_llm)
    return outputs


def test_text_equals_decode_of_token_ids_tiny(tiny_llm, sampled_tiny) -> None:
    """The streamed text equals one decode of all ids (where the last character is whole)."""
    tokenizer = tiny_llm.get_tokenizer()
    checked = 0
    for output in sampled_tiny:
        completion = output.outputs[0]
        assert completion.finish_reason == "length" and len(completion.token_ids) == 24
        decoded = tokenizer.decode(completion.token_ids)
        if decoded.endswith(REPLACEMENT_CHAR):
            continue  # see test_text_keeps_a_trailing_incomplete_character
        assert completion.text == decoded, completion.token_ids
        checked += 1
    assert checked >= 6


def test_text_keeps_a_trailing_incomplete_character(tiny_llm, prompts, sampled_tiny,
                                                    kv_free) -> None:
    """A sequence that ends inside a multi-byte character: the final text still equals
    decode(token_ids) (with U+FFFD), as for any other finished sequence."""
    tokenizer = tiny_llm.get_tokenizer()
    cut = next(((i, m) for i, o in enumerate(sampled_tiny) for m in range(1, 25)
                if tokenizer.decode(o.outputs[0].token_ids[:m]).endswith(REPLACEMENT_CHAR)),
               None)
    assert cut is not None, "no sample ends inside a character: pick another seed"
    i, m = cut
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=m, ignore_eos=True)
    (out,) = tiny_llm.generate({"prompt_token_ids": prompts[i]}, params)
    kv_free(tiny_llm)
    completion = out.outputs[0]
    assert completion.token_ids == sampled_tiny[i].outputs[0].token_ids[:m]
    assert completion.text == tokenizer.decode(completion.token_ids)


def test_text_equals_decode_of_token_ids_default(default_llm, kv_free) -> None:
    tokenizer = default_llm.get_tokenizer()
    prompts = ["Write one sentence in French about cafés.", "Les élèves de l'école"]
    outputs = default_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                           ignore_eos=True))
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "length" and len(completion.token_ids) == 12
        assert completion.text == tokenizer.decode(completion.token_ids)
        assert output.prompt == prompts[outputs.index(output)]
        assert output.prompt_token_ids == tokenizer.encode(output.prompt)
    kv_free(default_llm)


# --- output kinds ---------------------------------------------------------------------------

def _run_kind(llm: LLM, prompts: list[list[int]], params: SamplingParams
              ) -> dict[str, list[RequestOutput]]:
    """Every output the engine emits per request, staggered arrivals."""
    engine, emitted = llm.engine, {}
    for prompt in prompts:
        emitted[engine.add_request({"prompt_token_ids": prompt}, params)] = []
        for output in engine.step():
            emitted[output.request_id].append(output)
    while engine.has_unfinished_requests():
        for output in engine.step():
            emitted[output.request_id].append(output)
    return emitted


def test_output_kinds_deltas_add_up_to_the_cumulative_output(tiny_llm, prompts,
                                                             kv_free) -> None:
    """DELTA outputs hold only what is new (text, ids, logprobs), and added up equal the
    last CUMULATIVE output, with n=2 samples, logprobs and a stop string (whose held-back
    text comes out later); FINAL_ONLY emits one output, the same. Seeded, so all kinds
    sample the same tokens."""
    base = SamplingParams(temperature=1.0, seed=3, max_tokens=20, n=2, logprobs=1,
                          ignore_eos=True)
    free = _run_kind(tiny_llm, prompts[:4], base)
    # a stop string: two characters from the middle of a sample's text
    text = next(iter(free.values()))[-1].outputs[0].text
    params = base.replace(stop=(text[len(text) // 2:len(text) // 2 + 2],))
    runs = {kind: list(_run_kind(tiny_llm, prompts[:4], params.replace(output_kind=kind))
                       .values())
            for kind in RequestOutputKind}
    for cumulative, deltas, final in zip(*runs.values(), strict=True):
        assert len(final) == 1 and final[0].finished
        assert len(deltas) == len(cumulative) > 1
        whole = deltas[0].copy()
        for delta in deltas[1:]:
            whole.add(delta)
        assert sum(len(c.token_ids) for c in deltas[-1].outputs) < \
            deltas[-1].metrics.num_generation_tokens
        for got in (whole, final[0]):
            assert got.outputs == cumulative[-1].outputs
            assert got.metrics.num_generation_tokens == \
                sum(len(c.token_ids) for c in got.outputs)
    stopped = [c for outs in runs[RequestOutputKind.CUMULATIVE] for c in outs[-1].outputs
               if c.stop_reason is not None]
    assert stopped, "no sample hit the stop string"
    kv_free(tiny_llm)


# --- per-request metrics --------------------------------------------------------------------

def _assert_metrics_ordered(output: RequestOutput) -> None:
    m = output.metrics
    assert output.finished
    assert m.first_scheduled_time is not None and m.first_token_time is not None
    assert m.finished_time is not None
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.last_token_time is not None and m.first_token_time <= m.last_token_time
    assert m.time_to_first_token is not None and m.time_to_first_token >= 0
    assert m.num_preemptions >= 0


def test_metrics_are_ordered(tiny_llm, prompts, kv_free) -> None:
    outputs = run_staggered(tiny_llm, prompts[:8], GREEDY, per_step=2)
    for output in outputs:
        _assert_metrics_ordered(output)
        assert output.metrics.num_preemptions == 0
    # Later arrivals arrive later.
    arrivals = [o.metrics.arrival_time for o in outputs]
    assert arrivals == sorted(arrivals)
    kv_free(tiny_llm)


def test_step_trace_shows_requests_a_stop_string_ended(tiny_llama_dir, kv_free) -> None:
    """A stop string ends a request after the scheduler's update: the step's trace still
    lists it as finished and counts its blocks as freed."""
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=TINY_KV_MEMORY,
              step_trace=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (free,) = llm.generate("one two three", params)
    text = free.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    first = len(llm.engine.step_trace or [])
    (out,) = llm.generate("one two three", params.replace(stop=[stop]))
    assert out.outputs[0].finish_reason == "stop"
    trace = (llm.engine.step_trace or [])[first:]
    assert [step.finished for step in trace if step.finished] == [(out.request_id,)]
    assert trace[-1].kv_blocks_used == 0
    kv_free(llm)


def test_generation_config_eos_ids_end_generation(tiny_llama_dir, tmp_path, kv_free) -> None:
    """EOS ids that only generation_config.json lists (Llama 3's <|eot_id|> beside the
    tokenizer's <|end_of_text|>) stop generation too, as in vLLM and transformers."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=TINY_KV_MEMORY)
    ids = llm.generate("the sea sky", params)[0].outputs[0].token_ids
    tokenizer_eos = llm.engine.tokenizer.eos_token_ids
    eos = next(t for t in ids[2:] if t not in ids[:2] and t not in tokenizer_eos)
    shutil.copytree(tiny_llama_dir, tmp_path / "model")
    config = tmp_path / "model" / "generation_config.json"
    base = json.loads(config.read_text()) if config.exists() else {}
    config.write_text(json.dumps({**base, "eos_token_id": [eos]}))
    llm = LLM(model=str(tmp_path / "model"), dtype="float32", kv_cache_memory=TINY_KV_MEMORY)
    (out,) = llm.generate("the sea sky", params.replace(ignore_eos=False))
    assert out.outputs[0].token_ids == ids[:ids.index(eos) + 1]
    assert out.outputs[0].finish_reason == "stop"
    kv_free(llm)


def test_samples_waiting_for_the_first_ones_prefill_count_as_waiting(tiny_llm,
                                                                     kv_free) -> None:
    """n > 1: samples 2..n join once sample 1 computed the prompt; until then they wait, and
    the stats (the server's back-pressure, its num_requests_waiting) count them."""
    engine = tiny_llm.engine
    engine.add_request("one two three", SamplingParams(n=4, max_tokens=2, seed=1))
    assert engine.stats().num_requests_waiting == 4
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_requests_waiting == 0
    kv_free(tiny_llm)


# --- bad input ------------------------------------------------------------------------------

def _still_serves(llm: LLM) -> None:
    (out,) = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=1))
    assert len(out.outputs[0].token_ids) == 1 and out.finished
    stats = llm.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    llm.engine.check_integrity()


@pytest.mark.parametrize("prompt", ["", {"prompt_token_ids": []}, []],
                         ids=["text", "dict", "list"])
def test_empty_prompt(default_llm, prompt) -> None:
    with pytest.raises(ValueError, match="empty"):
        default_llm.generate([prompt], SamplingParams(max_tokens=2))
    _still_serves(default_llm)


def test_prompt_longer_than_max_model_len(default_llm) -> None:
    too_long = {"prompt_token_ids": [42] * 1100}
    with pytest.raises(ValueError, match="1024") as info:
        default_llm.generate(too_long, SamplingParams(max_tokens=2))
    assert "context length" in str(info.value) and "1100" in str(info.value)
    _still_serves(default_llm)


def test_max_model_len_past_the_models_context_is_refused(tiny_llama_dir) -> None:
    """As vLLM: positions past the model's context have no rotary embedding, so a request
    that long would fail mid-generation (the tiny model's context is 1024)."""
    with pytest.raises(ValueError, match=r"max_model_len must be <= the model's context "
                                         r"length \(1024\), got 1025"):
        LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=1025)


def test_lone_surrogate_is_a_value_error_naming_the_field(default_llm) -> None:
    # A JSON "\ud800" escape decodes to a lone surrogate, which the Rust tokenizer refuses
    # with a TypeError; the engine must say which field holds it, as for any bad input.
    with pytest.raises(ValueError, match=r"^prompt is not valid Unicode"):
        default_llm.generate(["fine", "abc\ud800def"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"^messages.*not valid Unicode"):
        default_llm.chat([{"role": "user", "content": "abc\udc00"}],
                         SamplingParams(max_tokens=2))
    _still_serves(default_llm)


def test_prompt_too_long_to_fit_is_refused_before_tokenizing(default_llm) -> None:
    engine = default_llm.engine
    limit = 1024 * engine.tokenizer.max_token_chars  # max_model_len x the longest token
    # 64 spaces are one token of this vocabulary: a prompt near the limit can still fit.
    fits = " " * (64 * 1000)
    assert len(engine.tokenize_prompt(fits)[1]) < 1024 < len(fits) // 16
    with pytest.raises(ValueError, match=rf"^prompt has {limit + 1} characters"):
        default_llm.generate("x" * (limit + 1), SamplingParams(max_tokens=2))
    _still_serves(default_llm)


def test_bad_prompt_in_a_batch_queues_nothing(default_llm) -> None:
    good = "Hello there"
    with pytest.raises(ValueError):
        default_llm.generate([good, {"prompt_token_ids": [42] * 1100}, good],
                             SamplingParams(max_tokens=2))
    stats = default_llm.stats()
    assert stats.num_requests_waiting == 0 and stats.num_requests_running == 0
    _still_serves(default_llm)


@pytest.mark.parametrize("ids", [[49152], [-1], [1, 2, 10**9]], ids=["vocab", "neg", "huge"])
def test_token_ids_outside_vocabulary(default_llm, ids) -> None:
    with pytest.raises(ValueError, match="vocabulary") as info:
        default_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2))
    assert "prompt_token_ids" in str(info.value) and "49152" in str(info.value)
    _still_serves(default_llm)


def test_stop_token_ids_outside_vocabulary(default_llm) -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        default_llm.generate("Hello", SamplingParams(max_tokens=2, stop_token_ids=[10**6]))
    _still_serves(default_llm)


def test_a_request_id_may_not_take_a_samples_id(tiny_llm, kv_free) -> None:
    """n > 1 samples run as id#0, id#1: a request named like one of them is refused, in
    either order, and the request already there finishes as it would alone."""
    engine = tiny_llm.engine
    two, one = (SamplingParams(n=n, max_tokens=4, ignore_eos=True) for n in (2, 1))
    for first, second in ((("foo", two), ("foo#1", one)), (("foo#1", one), ("foo", two))):
        engine.add_request("Hello", first[1], request_id=first[0])
        with pytest.raises(ValueError, match=rf"request_id '{second[0]}' is already in use"):
            engine.add_request("Hello", second[1], request_id=second[0])
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        assert [o.request_id for o in outputs] == [first[0]]
        assert [len(c.token_ids) for c in outputs[0].outputs] == [4] * first[1].n
    kv_free(tiny_llm)


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"n": 0}, "n"),
    ({"logprobs": -1}, "logprobs"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"stop": [""]}, "stop"),
    ({"logit_bias": {1: 100.5}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1], "structured_outputs": StructuredOutputsParams(regex="a")},
     "allowed_token_ids"),
])
def test_sampling_params_validation(kwargs, field) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**kwargs)


def test_bad_sampling_params_then_serve(default_llm) -> None:
    for kwargs in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}):
        with pytest.raises(ValueError):
            default_llm.generate("Hello", SamplingParams(**kwargs))
    _still_serves(default_llm)


def test_unknown_model_path(tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(model=str(missing))


def test_unknown_architecture(tmp_path) -> None:
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 64,
        "hidden_size": 32, "n_embd": 32, "num_attention_heads": 2, "intermediate_size": 64,
        "num_hidden_layers": 1}))
    save_file({"wte.weight": torch.zeros(64, 32)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="gpt2") as info:
        LLM(model=str(folder))
    assert "llama" in str(info.value)  # says what is supported


def test_unknown_engine_argument() -> None:
    with pytest.raises(ValueError, match="max_num_seq\\b|max_num_seq'"):
        LLM(max_num_seq=4)


def test_a_vllm_script_runs(tiny_llama_dir, caplog, kv_free) -> None:
    """vLLM's constructor arguments that mean nothing here are taken with a warning, its
    names answer (llm_engine, clone, from_optional, the top-level imports), numpy token ids
    are ids, and what conveyor cannot do says so."""
    import numpy as np

    from conveyor import CompletionOutput, EngineArgs, TokensPrompt  # noqa: F401

    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=TINY_KV_MEMORY,
              trust_remote_code=True, gpu_memory_utilization=0.9, task="generate")
    assert llm.generate([5, 6], SamplingParams(max_tokens=2))[0].outputs[0].finished()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    text, ids_only = (llm.generate([5, 6], greedy.replace(detokenize=d, extra_args={"x": 1}))[0]
                      .outputs[0] for d in (True, False))
    assert ids_only.token_ids == text.token_ids and text.text and ids_only.text == ""
    with pytest.raises(ValueError, match="stop strings need detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    assert SamplingParams(repetition_penalty=3.0).repetition_penalty == 3.0  # (vLLM's: > 0)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        SamplingParams(repetition_penalty=0)
    assert "trust_remote_code" in caplog.text and "gpu_memory_utilization" in caplog.text
    assert llm.llm_engine is llm.engine
    params = SamplingParams.from_optional(temperature=0, top_p=None, max_tokens=4,
                                          ignore_eos=True)
    assert params.top_p == SamplingParams().top_p and params.clone() == params
    ids = [5, 17, 33, 8]
    expected = llm.generate(TokensPrompt(prompt_token_ids=ids), params)[0].outputs[0].token_ids
    for given in (np.array(ids), [np.int64(i) for i in ids]):
        out = llm.generate({"prompt_token_ids": given}, params)[0]
        assert out.outputs[0].token_ids == expected
    with pytest.raises(ValueError, match="must be integers"):
        llm.generate({"prompt_token_ids": [5, 1.5]}, params)
    with pytest.raises(NotImplementedError, match="embed"):
        llm.encode(["a"])
    with pytest.raises(ValueError, match="task"):
        LLM(model=str(tiny_llama_dir), task="classify")
    kv_free(llm)


def test_chat_template_replaces_the_models(tmp_path) -> None:
    """chat_template (vLLM's --chat-template): a template, or a file holding one, instead of
    the model's; a bad one refused at start, naming the setting."""
    from conveyor.cli import build_parser
    from conveyor.server.cli import server_engine_args

    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    for given in (template, str(path)):
        llm = LLM(chat_template=given, kv_cache_memory="16MiB", max_model_len=256)
        messages = [{"role": "user", "content": "Hi"}]
        assert llm.get_tokenizer().apply_chat_template(messages) == "[user]Hi"
    with pytest.raises(ValueError, match="chat_template: the chat template is not valid"):
        LLM(chat_template="{% for %}", kv_cache_memory="16MiB", max_model_len=256)
    args = build_parser().parse_args(["serve", "--chat-template", str(path)])
    assert server_engine_args(args).chat_template == str(path)


def test_chat_takes_vllms_keywords(default_llm, kv_free) -> None:
    """LLM.chat: OpenAI's text content parts (joined), chat_template_kwargs and tools to the
    template, lora_request only as None."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = [{"role": "user", "content": "Name a fruit.\nOne word."}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a fruit."},
                                          {"type": "text", "text": "One word."}]}]
    assert default_llm.chat(parts, params)[0].prompt_token_ids == \
        default_llm.chat(plain, params)[0].prompt_token_ids
    no_prompt = default_llm.chat(plain, params, chat_template_kwargs={
        "add_generation_prompt": False})
    assert len(no_prompt[0].prompt_token_ids) < \
        len(default_llm.chat(plain, params)[0].prompt_token_ids)
    with pytest.raises(ValueError, match="lora_request"):
        default_llm.chat(plain, params, lora_request=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="text content parts"):
        default_llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], params)
    kv_free(default_llm)


@pytest.mark.parametrize("value,want", [
    (4096, 4096), (0.5, 1 << 29), ("2GiB", 2 << 30), ("512MB", 512_000_000), ("1e9", 10**9),
    ("4", 4 << 30), ("2048", 2048)])
def test_memory_sizes(value, want) -> None:
    """An int is bytes, a float GiB; a string without a unit is GiB below 1024 (README)."""
    from conveyor.config import parse_memory

    assert parse_memory(value) == want


@pytest.mark.parametrize("value", ["lots", True, "-1GiB"])
def test_bad_memory_size_names_the_field(value) -> None:
    from conveyor.config import parse_memory

    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_memory(value)


def test_token_budget_defaults_depend_on_usage() -> None:
    """Offline favours throughput (2048-token steps), `conveyor serve` inter-token latency
    (512); an explicit budget wins everywhere; without chunking a prompt must fit one step."""
    from conveyor.cli import build_parser
    from conveyor.config import EngineArgs
    from conveyor.server.cli import server_engine_args

    assert EngineArgs().scheduler_config(4096).max_num_batched_tokens == 2048
    assert EngineArgs(enable_chunked_prefill=False).scheduler_config(4096) \
        .max_num_batched_tokens == 4096
    assert EngineArgs(max_num_batched_tokens=100).scheduler_config(4096) \
        .max_num_batched_tokens == 100
    # a derived budget leaves room for every running sequence's decode
    assert EngineArgs(max_num_seqs=4096).scheduler_config(4096).max_num_batched_tokens == 4096
    parser = build_parser()
    assert server_engine_args(parser.parse_args(["serve"])).max_num_batched_tokens == 512
    explicit = parser.parse_args(["serve", "--max-num-batched-tokens", "100"])
    assert server_engine_args(explicit).max_num_batched_tokens == 100
    many = parser.parse_args(["serve", "--max-num-seqs", "1024"])
    assert server_engine_args(many).max_num_batched_tokens == 1024
    # `serve --no-enable-chunked-prefill` keeps the derived budget (a 512 one refused to start)
    unchunked = server_engine_args(parser.parse_args(["serve", "--no-enable-chunked-prefill"]))
    assert unchunked.scheduler_config(4096).max_num_batched_tokens == 4096
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineArgs(max_num_batched_tokens=-1)


def _with_generation_config(tiny_model_factory, name: str, **sampling) -> str:
    """A tiny model whose generation_config.json also sets sampling defaults."""
    folder = tiny_model_factory(name, "llama")
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, **sampling}))
    return str(folder)


def test_generation_config_sampling_defaults_apply_where_nothing_is_set(
        tiny_model_factory, kv_free) -> None:
    """vLLM's `--generation-config auto`: the model's generation_config.json temperature
    (here 0: greedy) and top_k are the defaults of a `generate` call without parameters;
    `generation_config="vllm"` drops them (temperature 1: sampled)."""
    folder = _with_generation_config(tiny_model_factory, "gen-config", temperature=0.0,
                                     top_k=5, do_sample=False, max_new_tokens=7)
    prompts = [[5, 6, 7, 8], [40, 41, 42], [300, 2, 9, 17, 4]]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=TINY_KV_MEMORY)
    assert llm.engine.default_sampling == {"temperature": 0.0, "top_k": 5, "max_tokens": 7}
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 5, 7)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    unset = [o.outputs[0].token_ids for o in llm.generate(prompts)]
    assert [ids[:len(u)] for ids, u in zip(expected, unset, strict=True)] == unset
    assert max(len(u) for u in unset) == 7  # max_new_tokens (those shorter met EOS)
    kv_free(llm)
    plain = LLM(model=folder, dtype="float32", kv_cache_memory=TINY_KV_MEMORY,
                generation_config="vllm")
    assert plain.engine.default_sampling == {}
    assert plain.get_default_sampling_params().temperature == 1.0
    with pytest.raises(ValueError, match="generation_config"):
        LLM(model=folder, dtype="float32", kv_cache_memory=TINY_KV_MEMORY,
            generation_config="model")


def test_invalid_generation_config_defaults_are_dropped_with_a_warning(
        tiny_model_factory, caplog) -> None:
    folder = _with_generation_config(tiny_model_factory, "gen-config-bad", top_p=5.0)
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=TINY_KV_MEMORY)
    assert llm.engine.default_sampling == {}
    assert "are not used" in caplog.text and "top_p" in caplog.text

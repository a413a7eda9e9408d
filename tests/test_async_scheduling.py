"""Async scheduling: step N+1 is scheduled, and its forward pass started, before step N's
results are taken (``async_scheduling=True``, vLLM's name).

The scheduler, driven through the fake runner as the engine's pipeline drives it: the next
step decodes a placeholder, a request whose step in flight samples its last token is not
scheduled on, a stop found late costs one wasted step, and an id reused after an abort does
not receive the aborted request's token (the randomized stress tests of test_scheduler.py
and test_policies.py run with async scheduling too, preemption included). The engine on the
default model: the same outputs as synchronous scheduling for every sampling parameter, with
preemption, aborts in flight and a failing step, every KV block free afterwards; and a real
`conveyor serve --async-scheduling` behind the official client. And the OpenMP remedy an engine
applies after loading (``ops/openmp.py``).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from conveyor import LLM, SamplingParams, StructuredOutputsParams
from conveyor.request import RequestStatus
from core_helpers import OUTPUT_TOKEN_BASE, assert_no_leak, make_harness, make_request, scripted
from server_fixtures import metric_value, openai_client, start_server, wait_idle

EOS = 2


# ---------------------------------------------------------------- the scheduler
def _shape(out) -> list[tuple[int, int, bool]]:
    return [(s.num_computed_tokens, s.num_new_tokens, s.samples) for s in out.scheduled]


def test_the_next_step_decodes_a_placeholder_before_the_results_are_in() -> None:
    h = make_harness(async_scheduling=True)
    request = make_request("a", range(1, 6), max_tokens=3)
    h.add(request)
    assert _shape(h.step()) == [(0, 5, True)]  # the prompt; its token is in flight
    assert (request.num_output_tokens, request.num_output_placeholders) == (0, 1)
    # scheduled before the prompt step's results: it decodes their token, unknown yet
    assert _shape(h.step()) == [(5, 1, True)]
    assert request.output_token_ids == [OUTPUT_TOKEN_BASE]  # taken after that schedule
    assert _shape(h.step()) == [(6, 1, True)]
    # the step in flight samples the third and last token: nothing more is scheduled
    assert h.step().is_empty
    assert request.output_token_ids == [OUTPUT_TOKEN_BASE + i for i in range(3)]
    assert request.status == RequestStatus.FINISHED_LENGTH
    h.drain()
    assert_no_leak(h.sched)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_stop_found_late_costs_one_wasted_step(async_scheduling: bool) -> None:
    h = make_harness(async_scheduling=async_scheduling,
                     token_fn=scripted({"a": [OUTPUT_TOKEN_BASE, EOS]}))
    request = make_request("a", [1, 2, 3], max_tokens=10, eos=(EOS,))
    h.add(request)
    h.run()
    assert request.output_token_ids == [OUTPUT_TOKEN_BASE, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    # prompt, the decode that samples EOS, and (async) one decode scheduled past it
    assert sum(not o.is_empty for o in h.outputs) == (3 if async_scheduling else 2)


def test_an_id_reused_after_an_abort_does_not_take_the_old_requests_token() -> None:
    h = make_harness(async_scheduling=True)
    old = make_request("a", [1, 2, 3], max_tokens=10)
    h.add(old)
    h.step()
    h.step()  # old's first decode is in flight
    h.sched.abort_requests(["a"])
    new = make_request("a", [7, 8, 9, 10], max_tokens=4)
    h.add(new)
    h.run()  # the shadow KV checks every position the new request attends to
    assert old.status == RequestStatus.FINISHED_ABORTED
    assert new.output_token_ids == [OUTPUT_TOKEN_BASE + i for i in range(4)]


# ---------------------------------------------------------------- the engine
# Every sampling parameter whose state lives in the runner between steps (penalties and
# min_tokens see the tokens so far, a seeded request its generator, a grammar its matcher),
# bad words read them on the host), stop strings and n > 1 (the engine's), logprobs.
PARAMS = [
    SamplingParams(temperature=0, max_tokens=40),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40),
    SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=40),
    SamplingParams(temperature=0, logprobs=2, max_tokens=24),
    SamplingParams(temperature=1.0, top_k=20, seed=3, n=2, max_tokens=30),
    SamplingParams(temperature=0, stop=["."], bad_words=["the", "of colors"],
                   logit_bias={13: 2.0}, max_tokens=60),
    SamplingParams(temperature=0, min_tokens=12, max_tokens=16),
    SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]})),
]
PROMPTS = ["The capital of France is", "Write a haiku about the sea:",
           "List three colors:", "Once upon a time, a robot",
           "Explain what a cache is.", "1, 2, 3, 4,", "Say hello in French:",
           "Describe a person as JSON:"]


def _generate(llm: LLM) -> list[tuple]:
    outputs = llm.generate(PROMPTS, PARAMS)
    return [(c.token_ids, c.text, c.finish_reason,
             [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in c.logprobs or []])
            for o in outputs for c in o.outputs]


# The default model in float32 with room for few sequences: running requests get preempted
SMALL_CACHE: dict[str, Any] = dict(dtype="float32", max_model_len=256, kv_cache_memory="8MiB",
                                   max_num_seqs=6)


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    """The default model, float32, synchronous and async, with room for few sequences."""
    from conftest_models import default_gguf

    default_gguf()
    return {"sync": LLM(**SMALL_CACHE), "async": LLM(**SMALL_CACHE, async_scheduling=True)}


def test_async_scheduling_gives_the_synchronous_outputs(engines, kv_free) -> None:
    expected = _generate(engines["sync"])
    assert _generate(engines["async"]) == expected
    for llm in engines.values():
        kv_free(llm)
    # the small cache preempted running requests (their tokens in flight, with async)
    assert engines["async"].stats().num_preemptions > 0


def test_bad_words_see_the_token_still_on_the_device(engines, kv_free) -> None:
    """A two-token bad word's last token is banned right after its first: with async
    scheduling that first token is the one the launched step has not returned yet."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (free,) = engines["sync"].generate("The sky is", greedy)
    assert " of colors" in free.outputs[0].text  # the premise: greedy writes the word
    banned = greedy.replace(bad_words=["of colors"])
    outputs = {name: llm.generate("The sky is", banned)[0].outputs[0].text
               for name, llm in engines.items()}
    assert outputs["async"] == outputs["sync"] and "of colors" not in outputs["sync"]
    for llm in engines.values():
        kv_free(llm)


def test_swap_preemption_with_async_scheduling(engines, kv_free) -> None:
    """Swap: a victim's blocks go to host memory after the step in flight wrote them."""
    from conftest_models import default_gguf

    default_gguf()
    swapping = LLM(**SMALL_CACHE, preemption="swap", async_scheduling=True)
    assert _generate(swapping) == _generate(engines["sync"])
    assert swapping.stats().num_swapped_blocks > 0
    kv_free(swapping)


def test_min_tokens_counts_the_token_still_on_the_device(tiny_llama_dir, kv_free) -> None:
    """min_tokens bans the stop tokens while fewer outputs exist: with async scheduling the
    last token is still on the device when the next step samples, and must count. A stop
    token the greedy run produces first at index j, with min_tokens = j + 1: it is banned
    exactly there (one too few counted would let it stop the request at j, one too many
    would ban it at j + 1 too)."""
    from conftest import TINY_KV_MEMORY

    args = dict(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=TINY_KV_MEMORY)
    sync, lagged = LLM(**args), LLM(**args, async_scheduling=True)
    prompt = {"prompt_token_ids": [5, 17, 33, 8, 90]}
    free = sync.generate(prompt, SamplingParams(temperature=0, max_tokens=24,
                                                ignore_eos=True))[0].outputs[0].token_ids
    j = next(i for i in range(3, 24) if free[i] not in free[:i])
    for stop_at, min_tokens in ((j, j + 1), (j, j)):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                stop_token_ids=[free[stop_at]], min_tokens=min_tokens)
        expected = sync.generate(prompt, params)[0].outputs[0].token_ids
        assert lagged.generate(prompt, params)[0].outputs[0].token_ids == expected
        assert (len(expected) == j + 1) == (min_tokens == j)  # stopped at j unless banned
    for llm in (sync, lagged):
        kv_free(llm)


def test_the_page_plan_from_the_host_is_the_devices(tiny_llama_dir, monkeypatch) -> None:
    """FlashInfer plans each step from page lists; built from the host's numbers
    (``AttentionMetadata.host``, set over FlashInfer: no wait for the step before) they
    equal those built from the device tensors, on the runner's own steps: decode rows beside
    chunked prompts, prefix-cache hits, n-gram verifies (a decode row per draft)."""
    from conftest import TINY_KV_MEMORY
    from conveyor.attention.paged_batch import device_page_plan, host_page_plan, paged_batch

    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=TINY_KV_MEMORY,
              max_num_batched_tokens=24, max_num_seqs=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    runner, block_size = llm.engine.runner, llm.engine.kv_layout.block_size
    runner.host_sequences = True
    metas, step = [], runner.model.step

    def capture(input_ids, positions, kv_caches, meta, keep=None):
        metas.append(meta)
        return step(input_ids, positions, kv_caches, meta, keep)

    monkeypatch.setattr(runner.model, "step", capture)
    shared = list(range(40, 80))
    prompts = [{"prompt_token_ids": shared[:n] + [7 + i] * (i + 1)}
               for i, n in enumerate((40, 9, 33, 40, 17, 2))]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert any(m.num_decodes and m.prefills for m in metas)  # mixed steps were planned
    assert any(c.num_computed_tokens for m in metas for c in m.prefills)  # prefixes too
    assert llm.stats().spec_decode_num_draft_tokens > 0
    for meta in metas:
        assert meta.host is not None
        host = host_page_plan(meta.host, block_size)
        device = device_page_plan(paged_batch(meta, block_size), block_size)
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "last_page_len"):
            assert torch.equal(getattr(host, name), getattr(device, name).to(torch.int32)), name


def test_an_abort_with_a_step_in_flight_leaks_nothing(engines, kv_free) -> None:
    engine = engines["async"].engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(prompt, params, request_id=f"abort-{i}")
    finished = {}
    for step in range(200):
        if step == 5:  # abort-1's next step is running: its token comes after the abort
            assert engine.abort_request("abort-1")[0].outputs[0].finish_reason == "abort"
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if not engine.has_unfinished_requests():
            break
    assert sorted(finished) == ["abort-0", "abort-2", "abort-3"]
    assert all(len(o.outputs[0].token_ids) == 30 for o in finished.values())
    kv_free(engines["async"])


def test_a_failing_step_ends_its_requests_and_the_next_step_runs_the_others(
        engines, kv_free, monkeypatch) -> None:
    llm = engines["async"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 17, 33 + 3 * i, 8, 90 + i]} for i in range(8)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    step, calls = llm.engine.runner.model.step, iter(range(1, 1000))

    def failing(*args, **kwargs):  # the third step raises: the six first requests decode
        if next(calls) == 3:
            raise RuntimeError("injected step failure")
        return step(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner.model, "step", failing)
    outputs = llm.generate(prompts, params)
    reasons = [o.outputs[0].finish_reason for o in outputs]
    assert reasons == ["error"] * 6 + ["length"] * 2
    assert [o.outputs[0].token_ids for o in outputs[6:]] == expected[6:]
    kv_free(llm)


def test_release_openmp_threads_ends_the_calling_threads_workers() -> None:
    """The engine's remedy, after loading, for two OpenMP pools on few cores: the calling
    thread's worker threads end, and a later parallel op starts them again. In a fresh
    process, where no other thread comes and goes."""
    code = """
import os, time, torch
from conveyor.ops.openmp import release_openmp_threads
def tasks():
    return len(os.listdir("/proc/self/task"))
torch.set_num_threads(2)
before = tasks()
torch.ones(1 << 22).exp_().sum()  # a parallel region: the pool's second thread starts
during = tasks()
assert release_openmp_threads()
deadline = time.monotonic() + 10
while tasks() > before and time.monotonic() < deadline:
    time.sleep(0.01)
after = tasks()
torch.ones(1 << 22).exp_().sum()
print(before, during, after, tasks())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    before, during, after, again = map(int, done.stdout.split())
    assert (during, after, again) == (before + 1, before, before + 1)


def test_async_scheduling_is_refused_with_drafts_and_tensor_parallelism() -> None:
    from conveyor.config import EngineArgs

    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="async_scheduling must be off with speculative"):
        EngineArgs(async_scheduling=True, speculative_config=spec)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1 with async"):
        EngineArgs(async_scheduling=True, tensor_parallel_size=2)


def test_the_server_serves_with_async_scheduling(engines) -> None:
    """`conveyor serve --async-scheduling`: streamed and whole completions give the text the
    synchronous engine gives, and the server ends idle with its KV cache empty."""
    server = start_server("--async-scheduling", "--dtype", "float32", "--max-model-len", "256",
                          "--kv-cache-memory", "16MiB")
    try:
        client = openai_client(server)
        params = SamplingParams(temperature=0, max_tokens=24)
        expected = [o.outputs[0].text for o in engines["sync"].generate(PROMPTS[:2], params)]
        for prompt, text in zip(PROMPTS[:2], expected, strict=True):
            stream = client.completions.create(model=server.model, prompt=prompt,
                                               max_tokens=24, temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in stream) == text
        whole = client.completions.create(model=server.model, prompt=PROMPTS[0],
                                          max_tokens=24, temperature=0)
        assert whole.choices[0].text == expected[0]
        metrics = wait_idle(server)
        assert metric_value(metrics, "conveyor:kv_cache_usage_perc") == 0
        assert metric_value(metrics, "conveyor:num_requests_running") == 0
    finally:
        assert server.stop() == 0, server.log_tail()
        server.remove_log()

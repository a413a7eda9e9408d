"""Speculative decoding behind `conveyor serve --speculative-config '{...}'`: the tiny random
Llama, a real server on 127.0.0.1, the official openai client.

Greedy text streamed equals the text answered whole, which equals speculation off (the same
model offline); a stream carries several tokens in one chunk when drafts were accepted; the
spec_decode_* counters in /metrics follow the engine's stats and hold together (drafted >=
accepted > 0 on a prompt the model copies). A repetition penalty below 1 makes the random
model copy its prompt, so n-gram drafts are proposed and many accepted.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import httpx
import openai
import pytest

from conftest import TINY_KV_MEMORY
from conveyor import LLM, SamplingParams
from server_fixtures import ServerProcess, metric_value, openai_client, serving, wait_idle

# Not adaptive: which steps draft must not depend on how long steps took on a loaded machine.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2, "adaptive": False}
MAX_TOKENS = 40
COPYING = {"ignore_eos": True, "repetition_penalty": 0.2}  # vLLM's extra fields
MAX_MODEL_LEN = 512
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Iterator[ServerProcess]:
    yield from serving("--model", str(tiny_llama_dir), "--dtype", "float32",
                       "--kv-cache-memory", str(TINY_KV_MEMORY),
                       "--max-model-len", str(MAX_MODEL_LEN),
                       "--speculative-config", json.dumps(NGRAM))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def off(tiny_llama_dir) -> LLM:
    """The same model offline, speculation off, the server's token budget."""
    return LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=TINY_KV_MEMORY,
               max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=512)


def _clean_ids(llm: LLM) -> list[int]:
    """Tokens that decode alone to whole characters (no U+FFFD, not special, not empty): a
    stream chunk holding two of them holds two tokens of one step, not a token held back
    for its incomplete character."""
    tokenizer = llm.get_tokenizer()
    texts = {i: tokenizer.decode([i]) for i in range(2, 400)}
    return [i for i, t in texts.items() if t.strip() and "\ufffd" not in t]


def _prompts(clean: list[int]) -> list[list[int]]:
    """Phrases repeated three times, then a few more tokens: the model copies them."""
    rng = random.Random(5)
    out = []
    for i in range(3):
        phrase = [rng.choice(clean) for _ in range(6 + i)]
        out.append(phrase * 3 + [rng.choice(clean) for _ in range(i)])
    return out


def _spec_metrics(server: ServerProcess) -> dict[str, float]:
    text = wait_idle(server)
    values = {name: metric_value(text, f"conveyor:spec_decode_{name}_total")
              for name in SPEC_COUNTERS}
    values["per_pos"] = sum(
        metric_value(text, "conveyor:spec_decode_num_accepted_tokens_per_pos_total",
                     position=str(pos)) for pos in range(NGRAM["num_speculative_tokens"]))
    return values


def test_stream_equals_whole_equals_speculation_off(server: ServerProcess,
                                                    client: openai.OpenAI, off: LLM,
                                                    kv_free) -> None:
    clean = _clean_ids(off)
    prompts = _prompts(clean)
    expect = [o.outputs[0].text for o in off.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **COPYING))]
    kv_free(off)
    clean_texts = {off.get_tokenizer().decode([i]) for i in clean}
    several = 0  # chunks of two or more whole-character tokens
    for prompt, text in zip(prompts, expect, strict=True):
        body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "extra_body": COPYING}
        whole = client.completions.create(**body).choices[0]
        assert (whole.text, whole.finish_reason) == (text, "length")
        chunks = [c.choices[0] for c in client.completions.create(**body, stream=True,
                                                                  logprobs=0)]
        assert "".join(c.text for c in chunks) == text
        assert sum(len(c.logprobs.tokens) for c in chunks) == MAX_TOKENS
        several += sum(len(c.logprobs.tokens) > 1 and set(c.logprobs.tokens) <= clean_texts
                       for c in chunks)
    assert several > 0
    wait_idle(server)
    stats = httpx.get(server.base_url + "/stats").json()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_spec_decode_metrics_follow_the_engine(server: ServerProcess,
                                               client: openai.OpenAI, off: LLM) -> None:
    before = _spec_metrics(server)
    prompt = _prompts(_clean_ids(off))[0]
    out = client.completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                    temperature=0, extra_body=COPYING)
    assert out.usage.completion_tokens == MAX_TOKENS
    after = _spec_metrics(server)
    drafts, drafted, accepted, per_pos = (after[k] - before[k] for k in (*SPEC_COUNTERS,
                                                                          "per_pos"))
    assert accepted > 0 and drafted >= accepted and drafted >= drafts > 0
    assert per_pos == accepted  # each accepted token at its draft position
    # a request's tokens: one sampled per step it ran in (drafted or not) plus the accepted
    assert accepted <= MAX_TOKENS - 1
    stats = httpx.get(server.base_url + "/stats").json()
    for name in SPEC_COUNTERS:
        assert stats[f"spec_decode_{name}"] == after[name], name
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == after["per_pos"]
    assert stats["spec_decode_acceptance_rate"] == pytest.approx(
        after["num_accepted_tokens"] / after["num_draft_tokens"])

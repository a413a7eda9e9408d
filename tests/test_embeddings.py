"""Embeddings (last-token pooling, L2-normalized): ``LLM.embed`` against transformers'
last hidden state on the same weights, alone and batched with generation; and
``POST /v1/embeddings`` through a real `conveyor serve` with the official openai client."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch

from conveyor import LLM, SamplingParams
from server_fixtures import (
    ServerProcess,
    metric_value,
    openai_client,
    start_server,
    wait_idle,
)

PROMPTS = ["one two three", "the cat sat on the mat and the dog", "東京 日本語 Привет", "a"]


def _reference(hf_model, ids: list[int]) -> np.ndarray:
    """transformers' final hidden state of the last token, normalized."""
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    return torch.nn.functional.normalize(out.hidden_states[-1][0, -1], dim=-1).numpy()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_embeddings_are_transformers_last_hidden_state(tiny_model_factory, hf_tiny_model,
                                                       kv_free, arch) -> None:
    folder = tiny_model_factory(arch, arch, **({"num_key_value_heads": 2}
                                               if arch == "qwen3" else {}))
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=1 << 20, max_model_len=256,
              max_num_batched_tokens=16)  # prompts in chunks too
    hf = hf_tiny_model(folder)
    alone = [llm.embed(p)[0] for p in PROMPTS]
    # batched, beside requests that generate (their outputs unchanged)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    together = llm.embed(PROMPTS)
    generated = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert generated == expected
    for one, batched in zip(alone, together, strict=True):
        vector = np.array(one.outputs.embedding)
        assert one.outputs.hidden_size == hf.config.hidden_size
        assert abs(np.linalg.norm(vector) - 1) < 1e-5
        np.testing.assert_allclose(vector, _reference(hf, one.prompt_token_ids), atol=2e-5)
        np.testing.assert_allclose(batched.outputs.embedding, vector, atol=2e-5)
    full = [7 + i % 50 for i in range(256)]  # the whole context (max_model_len)
    np.testing.assert_allclose(llm.embed({"prompt_token_ids": full})[0].outputs.embedding,
                               _reference(hf, full), atol=2e-5)
    kv_free(llm)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    server = start_server("--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                          "--dtype", "float32")
    yield server
    assert server.stop() == 0, server.log_tail()
    server.remove_log()


def _counts(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics").text
    return {"generated": metric_value(text, "conveyor:generation_tokens_total"),
            "prompt": metric_value(text, "conveyor:prompt_tokens_total"),
            "stop": metric_value(text, "conveyor:request_success_total", finished_reason="stop"),
            "length": metric_value(text, "conveyor:request_success_total",
                                   finished_reason="length"),
            "ttft": metric_value(text, "conveyor:time_to_first_token_seconds_count")}


def test_the_embeddings_endpoint(server: ServerProcess, hf_default_model) -> None:
    client = openai_client(server)
    texts = ["The capital of France is Paris.", "Paris is in France.", "I like turtles."]
    before = _counts(server)
    answer = client.embeddings.create(model=server.model, input=texts)  # base64 by default
    after = _counts(server)
    # In /metrics an embedding is a request that processed its prompt and generated nothing
    # (its one sampled token is dropped), ended as stopped (as vLLM's pooling requests).
    assert {k: after[k] - before[k] for k in after} == {
        "generated": 0, "prompt": answer.usage.prompt_tokens, "stop": 3, "length": 0, "ttft": 0}
    assert [d.index for d in answer.data] == [0, 1, 2]
    vectors = np.array([d.embedding for d in answer.data])
    ids = [httpx.post(server.base_url + "/tokenize",
                      json={"prompt": t}).json()["tokens"] for t in texts]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    for vector, prompt_ids in zip(vectors, ids, strict=True):
        assert np.dot(vector, _reference(hf_default_model, prompt_ids)) > 0.999
    floats = client.embeddings.create(model=server.model, input=texts[0],
                                      encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, vectors[0], atol=1e-6)
    raw = httpx.post(server.base_url + "/v1/embeddings", json={
        "input": [ids[1]], "encoding_format": "base64", "dimensions": 64}).json()
    short = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert short.shape == (64,) and abs(np.linalg.norm(short) - 1) < 1e-5
    np.testing.assert_allclose(short, vectors[1][:64] / np.linalg.norm(vectors[1][:64]),
                               atol=1e-5)
    for body, param in (({"input": []}, "input"), ({"input": ""}, "input"),
                        ({"input": "x", "dimensions": 0}, "dimensions"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": [[10**9]]}, "input")):
        bad = httpx.post(server.base_url + "/v1/embeddings", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    # A prompt may fill the context (the token generated with it is dropped), not more
    full = client.embeddings.create(model=server.model, input=[[5] * 1024],
                                    encoding_format="float")
    assert full.usage.prompt_tokens == 1024 and len(full.data[0].embedding) == 576
    with pytest.raises(openai.BadRequestError, match="1025 input tokens"):
        client.embeddings.create(model=server.model, input=[[5] * 1025])
    # Many inputs, as clients send them (LangChain: up to 1000), in one request
    many = client.embeddings.create(model=server.model, input=[f"item {i}" for i in range(100)])
    assert [d.index for d in many.data] == list(range(100))
    np.testing.assert_allclose(many.data[7].embedding, client.embeddings.create(
        model=server.model, input="item 7").data[0].embedding, atol=1e-5)
    wait_idle(server)


def test_embeddings_under_async_scheduling(tiny_llama_dir, kv_free) -> None:
    """Async scheduling (a step launched before the last one's tokens are known): the same
    vectors."""
    plain = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=1 << 20,
                max_model_len=256)
    expected = [o.outputs.embedding for o in plain.embed(PROMPTS)]
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=1 << 20,
              max_model_len=256, async_scheduling=True)
    for got, want in zip(llm.embed(PROMPTS), expected, strict=True):
        np.testing.assert_allclose(got.outputs.embedding, want, atol=2e-5)
    kv_free(llm)

"""prompt_logprobs (vLLM's): each prompt token's logprob, rank and the top N, as transformers
scores the prompt; computed in chunks, and never skipped by the prefix cache."""

from __future__ import annotations

import torch

from conveyor import LLM, RequestOutputKind, SamplingParams
from conveyor.runner import model_runner

PROMPT = [(i * 53) % 397 + 3 for i in range(45)]  # three chunks of 16 and a prefix to cache


def test_prompt_logprobs_match_transformers(tiny_llama_dir, hf_tiny_model, kv_free,
                                            monkeypatch) -> None:
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", 5)  # chunks scored in slices
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256,
              max_num_batched_tokens=16, kv_cache_memory=64 * 16 * 1024)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    first = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
    with torch.inference_mode():
        logits = hf_tiny_model(tiny_llama_dir)(torch.tensor([PROMPT])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    got = first.prompt_logprobs
    assert got is not None and len(got) == len(PROMPT) and got[0] is None
    for p in range(1, len(PROMPT)):
        row, token = reference[p - 1], PROMPT[p]
        entry = got[p]
        assert entry is not None and abs(entry[token].logprob - float(row[token])) < 1e-4
        assert entry[token].rank == 1 + int((row > row[token]).sum())
        top = set(row.topk(3).indices.tolist())
        assert top <= set(entry) <= top | {token}
    # Again: its prompt is in the prefix cache now, and still scored whole; the same bits.
    again = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
    assert again.prompt_logprobs == got and again.num_cached_tokens == 0
    plain = llm.generate({"prompt_token_ids": PROMPT}, params.replace(prompt_logprobs=None))[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == first.outputs[0].token_ids
    kv_free(llm)


def test_chat_logprob_bytes_join_to_the_text(default_llm, kv_free) -> None:
    """OpenAI's chat logprob `bytes` of tokens that split a character (an emoji's bytes,
    shown as "\ufffd") are their own bytes: joined, the text's UTF-8 (the engine names each
    entry, the server shapes them)."""
    from conveyor.server.logprobs import chat_logprobs

    text = "Birds: 🐦🐦 and 東京 🙂"
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = default_llm.generate(text, params)[0]
    ids, entries = out.prompt_token_ids[1:], out.prompt_logprobs[1:]
    assert any("\ufffd" in e[i].decoded_token for i, e in zip(ids, entries, strict=True))
    content = chat_logprobs(ids, entries, 0).content
    assert content is not None
    joined = bytes(b for token in content for b in token.bytes or [])
    first = default_llm.get_tokenizer().decode(out.prompt_token_ids[:1])
    assert (first.encode() + joined).decode() == text
    kv_free(default_llm)


def test_prompt_logprobs_in_the_first_delta_of_n_samples(tiny_llama_dir, kv_free) -> None:
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256,
              max_num_batched_tokens=16, kv_cache_memory=64 * 16 * 1024)
    params = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=4, ignore_eos=True,
                            prompt_logprobs=0, output_kind=RequestOutputKind.DELTA)
    engine = llm.engine
    request_id = engine.add_request({"prompt_token_ids": PROMPT}, params)
    carrying = []
    while engine.has_unfinished_requests():
        carrying += [o.prompt_logprobs for o in engine.step()
                     if o.request_id == request_id and o.prompt_logprobs is not None]
    (whole,) = carrying  # one output carries them, complete: one entry (the token) each
    assert len(whole) == len(PROMPT) and all(len(e) == 1 for e in whole[1:])
    # scored once, by sample 1: the other's prompt came from the prefix cache
    assert llm.stats().prefix_cache_hits > 0
    kv_free(llm)

"""Reasoning models' thinking read out of their text (server/reasoning.py).

The split itself (a stream cut anywhere adds up to the whole), where the section starts (the
rendered prompt), when the parser turns itself on; a constraint applied after the thinking
(the grammar wrapper on real llguidance matchers, then offline on a tiny random model whose
vocabulary has <think> tokens); and the three APIs through a real `conveyor serve` on the
default model, its output forced into a thinking-then-answer shape by a regex
(--structured-outputs-in-reasoning), read with the official clients.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from conveyor import LLM, SamplingParams, StructuredOutputsParams
from conveyor.sampling_params import ANY_ANSWER, ReasoningSection
from conveyor.server.reasoning import (
    THINK,
    ReasoningStream,
    for_prompt,
    reasoning_section,
    split,
)
from conveyor.server.tool_parsers import HermesToolParser
from conveyor.structured.compiler import lark_literal
from conveyor.tokenizer.tokenizer import Tokenizer
from server_fixtures import ServerProcess, start_server, wait_idle

OPEN = ReasoningSection("<think>", "</think>", opened=True)

# (text, the prompt opened the section, thinking, answer)
CASES = [
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "Let me see.", "Paris."),
    ("  <think>a < b </thin k></think>x", False, "a < b </thin k>", "x"),
    ("<think></think>\n\nHi", False, None, "Hi"),  # empty: none (a stream sends nothing)
    ("Paris, no thinking <think>here</think>", False, None,
     "Paris, no thinking <think>here</think>"),
    ("<thi", False, None, "<thi"),
    ("<think>\ncut short by max_tokens  ", False, "cut short by max_tokens  ", ""),
    ("I think so.\n</think>\n\nYes.", True, "I think so.", "Yes."),
    ("still thinking", True, "still thinking", ""),
    ("", True, None, ""),
    ("\n\n", False, None, "\n\n"),
]


@pytest.mark.parametrize(("text", "opened", "thinking", "answer"), CASES)
def test_a_stream_cut_anywhere_adds_up_to_the_whole(text, opened, thinking, answer) -> None:
    section = ReasoningSection("<think>", "</think>", opened)
    assert split(section, text) == (thinking, answer)
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = ReasoningStream(section)
        parts = [stream.update(p, finished=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert "".join(t for t, _ in parts) == (thinking or "")
        assert "".join(a for _, a in parts) == answer


def test_the_prompt_says_where_the_output_begins() -> None:
    def opened(prompt: str, prefill: str | None = None) -> bool | None:
        section = for_prompt(THINK, prompt, prefill)
        return None if section is None else section.opened

    assert opened("<|user|>hi<|assistant|>\n<think>\n")  # DeepSeek-R1's
    assert opened("<|assistant|>\n") is False  # Qwen3's: the model may open it
    # Qwen3 with enable_thinking false: an empty section, closed in the prompt: none to read
    assert opened("<|assistant|>\n<think>\n\n</think>\n\n") is None
    # A user's words that mention the tag open nothing
    assert opened("<|user|>What is <think> for?<|assistant|>\n") is False
    # Continuing an assistant message: its own words say
    prompt = "<|user|>hi<|assistant|>\n<think>\nI should"
    assert opened(prompt, prefill="<think>\nI should")
    assert opened(prompt + "</think>\nSo", prefill="<think>a</think>\nSo") is None
    assert opened(prompt, prefill="Sure") is False


def _thinking_tokenizer(folder: Path, tiny_tokenizer: tuple[Path, int], template: str,
                        special: bool = False) -> int:
    """The tiny tokenizer with Qwen3's added tokens (not special, unless ``special``):
    <think>, </think>, <tool_call>, </tool_call>; and a chat template; its vocabulary size."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    source, _ = tiny_tokenizer
    tok = HFTokenizer.from_file(str(source / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=special, normalized=False)
                    for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((source / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                              "chat_template": template}))
    return int(tok.get_vocab_size())


TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: <think>\n"
            "{% if enable_thinking is defined and not enable_thinking %}\n</think>\n\n"
            "{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, tiny_tokenizer) -> Path:
    from conftest import build_tiny_model

    tokenizer_dir = tmp_path_factory.mktemp("thinking-tokenizer")
    vocab = _thinking_tokenizer(tokenizer_dir, tiny_tokenizer, TEMPLATE)
    return build_tiny_model(tmp_path_factory.mktemp("tiny-thinking"), tokenizer_dir, vocab,
                            "qwen3", num_key_value_heads=2)


def test_auto_turns_on_where_the_model_has_the_tags(thinking_model, tiny_llama_dir) -> None:
    thinking = Tokenizer.from_hf(str(thinking_model))
    assert reasoning_section("auto", thinking) == THINK
    assert reasoning_section("none", thinking) is None
    plain = Tokenizer.from_hf(str(tiny_llama_dir))  # no such tokens, no template
    assert reasoning_section("auto", plain) is None
    assert reasoning_section("deepseek_r1", plain) == THINK  # asked for: the tags as text


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["n"], "additionalProperties": False}


@pytest.mark.parametrize("tags", ["tokens", "text"])
def test_the_constraint_applies_after_the_thinking(thinking_model, tiny_llama_dir, tags):
    """The wrapped grammar on real matchers: free thinking up to the end tag, then the
    schema; with the section not opened by the prompt, the thinking may be skipped."""
    llm = LLM(model=str(thinking_model if tags == "tokens" else tiny_llama_dir),
              dtype="float32", kv_cache_memory=1 << 20, max_model_len=256)
    tokenizer = llm.get_tokenizer()
    assert (tokenizer.token_to_id("</think>") is not None) == (tags == "tokens")
    answer = '{"n": 7}'

    def accepts(section: ReasoningSection, text: str) -> bool:
        spec = StructuredOutputsParams(json=SCHEMA, after_reasoning=section)
        matcher = llm.engine.grammars.compile(spec, count=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) \
            and matcher.is_accepting()

    closed = ReasoningSection("<think>", "</think>")
    free = "any text {not json} at all </x>\n"
    assert accepts(OPEN, f"{free}</think>\n\n{answer}")
    assert accepts(OPEN, f"</think>{answer}")
    assert not accepts(OPEN, answer)  # the prompt opened it: it must be closed first
    assert not accepts(OPEN, f"{free}</think>\n\nnot json")
    assert accepts(closed, f"<think>{free}</think>\n{answer}")
    assert accepts(closed, answer)
    assert not accepts(closed, f"{free}</think>{answer}")  # thinking needs its start tag
    # At most a few whitespace characters between: a small model offered more can write
    # newlines forever (the JSON itself has no free whitespace)
    assert accepts(OPEN, f"</think>\n\n{answer}")
    assert not accepts(OPEN, f"</think>{chr(10) * 12}{answer}")
    # Thinking may mention other added tokens (Qwen3 thinks about its <tool_call>s)
    assert accepts(OPEN, f"I will write <tool_call> next</think>{answer}")


def test_a_budget_bounds_the_thinking_offline(thinking_model, kv_free) -> None:
    """thinking_token_budget as a grammar: at most that many thinking tokens, then the end
    tag is the only token allowed; the answer after it is free."""
    llm = LLM(model=str(thinking_model), dtype="float32", kv_cache_memory=1 << 20,
              max_model_len=256)
    end = llm.get_tokenizer().token_to_id("</think>")
    for budget in (0, 3, 7):
        section = dataclasses.replace(OPEN, budget=budget)
        spec = StructuredOutputsParams(grammar=ANY_ANSWER, after_reasoning=section)
        params = [SamplingParams(max_tokens=20, seed=seed, temperature=1.0,
                                 structured_outputs=spec) for seed in range(4)]
        ends = [out.outputs[0].token_ids.index(end)
                for out in llm.generate(["user: one two\nassistant: <think>\n"] * 4, params)]
        assert all(i <= budget for i in ends), (budget, ends)
        assert budget in ends  # (a random model rarely closes it sooner: the budget did)
    kv_free(llm)


def test_a_budget_leaves_the_answer_free(thinking_model, kv_free) -> None:
    """Past the thinking a budget enforces nothing: an EOS in the answer under ignore_eos
    is followed by more answer (a grammar that ended would allow only EOS); a model that
    opens the section itself thinks within the budget too; min_tokens is taken."""
    llm = LLM(model=str(thinking_model), dtype="float32", kv_cache_memory=1 << 20,
              max_model_len=256)
    tokenizer = llm.get_tokenizer()
    start, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    eos = tokenizer.eos_token_ids[0]
    opened = StructuredOutputsParams(grammar=ANY_ANSWER,
                                     after_reasoning=dataclasses.replace(OPEN, budget=2))
    params = SamplingParams(max_tokens=30, seed=7, temperature=1.0, ignore_eos=True,
                            logit_bias={eos: 4.0}, structured_outputs=opened, min_tokens=3)
    tokens = llm.generate("user: one two\nassistant: <think>\n", params)[0].outputs[0].token_ids
    answer = tokens[tokens.index(end) + 1:]
    assert eos in answer and set(answer[answer.index(eos):]) != {eos}, tokens
    closed = StructuredOutputsParams(grammar=ANY_ANSWER, after_reasoning=ReasoningSection(
        "<think>", "</think>", budget=3))
    for seed in range(4):  # the model opens it (a bias makes it), then thinks 3 tokens
        params = SamplingParams(max_tokens=12, seed=seed, temperature=1.0,
                                logit_bias={start: 30.0}, structured_outputs=closed)
        tokens = llm.generate("user: one two\nassistant: ", params)[0].outputs[0].token_ids
        assert tokens[0] == start and tokens.index(end) <= 4, tokens
    kv_free(llm)


def test_a_model_thinks_freely_then_answers_in_the_schema(thinking_model, kv_free) -> None:
    """Offline, the tiny model (random outputs): a bias makes </think> come within a few
    tokens; whatever came before it, the rest is JSON of the schema."""
    llm = LLM(model=str(thinking_model), dtype="float32", kv_cache_memory=1 << 20,
              max_model_len=256)
    end = llm.get_tokenizer().token_to_id("</think>")
    spec = StructuredOutputsParams(json=SCHEMA, after_reasoning=OPEN)
    params = [SamplingParams(max_tokens=60, seed=seed, temperature=1.0, logit_bias={end: 4.0},
                             structured_outputs=spec) for seed in range(8)]
    outputs = llm.generate(["user: one two three\nassistant: <think>\n"] * 8, params)
    thought = 0
    for out in outputs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c
        assert c.token_ids.count(end) == 1
        thinking, answer = split(OPEN, c.text)
        jsonschema.validate(json.loads(answer), SCHEMA)
        thought += c.token_ids.index(end) > 0
    assert thought > 0  # some thought before closing: the grammar did not force the tag
    kv_free(llm)


def test_a_forced_tool_call_on_a_vocabulary_with_tag_tokens(thinking_model, kv_free) -> None:
    """Qwen's <tool_call> and </tool_call> are tokens: the call's grammar writes them as
    tokens (llguidance never spells a token out of text: the call could not end)."""
    llm = LLM(model=str(thinking_model), dtype="float32", kv_cache_memory=1 << 20,
              max_model_len=256)
    tokenizer = llm.get_tokenizer()
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
    parser = HermesToolParser(forced=True)
    grammar = parser.grammar(tools, parallel=False,
                             literal=functools.partial(lark_literal, tokenizer))
    params = [SamplingParams(max_tokens=40, seed=seed, temperature=1.0,
                             structured_outputs=StructuredOutputsParams(grammar=grammar))
              for seed in range(4)]
    for out in llm.generate(["user: call f\nassistant: "] * 4, params):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c
        content, (call,) = parser.parse(c.text)
        assert not content and call.name == "f"
        jsonschema.validate(json.loads(call.arguments), SCHEMA)
    kv_free(llm)


# The default model's output forced into a thinking-then-answer shape (the tags as text:
# its vocabulary has no such tokens).
SHAPE = r"<think>\n[a-z ]{10,40}\n</think>\n\n[A-Z][a-z ]{5,40}\."
FORCED = {"structured_outputs": {"regex": SHAPE}}
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    server = start_server("--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                          "--reasoning-parser", "qwen3", "--structured-outputs-in-reasoning")
    yield server
    assert server.stop() == 0, server.log_tail()
    server.remove_log()


@pytest.fixture(scope="module")
def forced(server: ServerProcess) -> tuple[str, str, int]:
    """(thinking, answer, tokens up to the end tag) of the forced output, read from
    /v1/completions' raw text."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    ids = httpx.post(server.base_url + "/tokenize", json={"messages": ASK}).json()["tokens"]
    choice = client.completions.create(model=server.model, prompt=ids, max_tokens=80,
                                       temperature=0, logprobs=0, extra_body=FORCED).choices[0]
    found = re.fullmatch(r"<think>\n(.*)\n</think>\n\n(.*)", choice.text, re.S)
    assert found and choice.logprobs and choice.logprobs.tokens, choice
    pieces = choice.logprobs.tokens
    thought = next(i for i in range(len(pieces)) if "</think>" in "".join(pieces[:i + 1]))
    return found.group(1).strip(), found.group(2), thought + 1


def test_chat_returns_the_thinking_apart(server, forced) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    kwargs = {"model": server.model, "messages": ASK, "max_tokens": 80, "temperature": 0}
    message = client.chat.completions.create(**kwargs, extra_body=FORCED).choices[0].message
    assert (message.content, message.reasoning, message.reasoning_content) == \
        (forced[1], forced[0], forced[0])  # type: ignore[attr-defined]
    chunks = list(client.chat.completions.create(**kwargs, stream=True, extra_body=FORCED))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == forced[0]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == forced[0]
    assert "".join(d.content or "" for d in deltas) == forced[1]
    hidden = client.chat.completions.create(**kwargs, extra_body={**FORCED,
                                                                  "include_reasoning": False})
    assert hidden.choices[0].message.content == forced[1]
    assert getattr(hidden.choices[0].message, "reasoning", None) is None
    # The thinking sent back (either name) is taken: the template gets reasoning_content
    turn = [*ASK, {"role": "assistant", "content": forced[1], "reasoning": forced[0]},
            {"role": "user", "content": "And of Spain?"}]
    again = client.chat.completions.create(**{**kwargs, "messages": turn}, extra_body=FORCED)
    assert again.choices[0].message.content
    wait_idle(server)


def test_messages_return_a_thinking_block(server, forced) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    kwargs = {"model": server.model, "max_tokens": 80, "messages": ASK,
              "extra_body": {"temperature": 0, **FORCED}}
    message = client.messages.create(**kwargs)  # type: ignore[arg-type]
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == forced[0]  # type: ignore[union-attr]
    assert message.content[1].text == forced[1]  # type: ignore[union-attr]
    with client.messages.stream(**kwargs) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_message()
    assert final.model_dump()["content"] == message.model_dump()["content"]
    kinds = [e.type for e in events if e.type.startswith("content_block")]
    assert kinds[0] == "content_block_start" and kinds[-1] == "content_block_stop"
    assert sum(k == "content_block_start" for k in kinds) == 2


def test_responses_return_a_reasoning_item(server, forced) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    kwargs = {"model": server.model, "input": ASK[0]["content"], "max_output_tokens": 80,
              "temperature": 0, "extra_body": FORCED}
    response = client.responses.create(**kwargs)  # type: ignore[call-overload]
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == forced[0]
    assert response.output_text == forced[1]
    with client.responses.stream(**kwargs) as stream:  # type: ignore[call-overload]
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == forced[0] and len(deltas) >= 2
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == forced[0] and final.output_text == forced[1]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # Cut in the answer: the thinking was done, the message was not (the same streamed)
    cut = {**kwargs, "max_output_tokens": forced[2] + 3}
    whole = client.responses.create(**cut)
    with client.responses.stream(**cut) as stream:
        last = list(stream)[-1]
    assert whole.status == last.response.status == "incomplete"  # type: ignore[union-attr]
    assert [i.status for i in whole.output] == ["completed", "incomplete"]
    assert [i.status for i in last.response.output] == ["completed", "incomplete"]  # type: ignore[union-attr]
    # The reasoning item as the next turn's input is taken
    turn = [{"role": "user", "content": ASK[0]["content"]}, response.output[0].model_dump(),
            {"role": "assistant", "content": forced[1]}, {"role": "user", "content": "Spain?"}]
    assert client.responses.create(**{**kwargs, "input": turn}).output_text
    wait_idle(server)


@pytest.fixture(scope="module")
def thinking_server(thinking_model) -> Iterator[ServerProcess]:
    """The tiny thinking model (random outputs) served; its parser on by itself (auto)."""
    server = start_server("--model", str(thinking_model), "--dtype", "float32",
                          "--max-model-len", "256", "--kv-cache-memory", "1MiB")
    yield server
    assert server.stop() == 0, server.log_tail()
    server.remove_log()


def test_a_thinking_budget_over_http(thinking_server, server) -> None:
    """thinking_token_budget (vLLM's) on chat, Anthropic's thinking.budget_tokens on
    /v1/messages; thinking disabled there reaches the template; a 400 where the thinking
    cannot be bounded (its end tag is text)."""
    client = openai.OpenAI(base_url=thinking_server.base_url + "/v1", api_key="x",
                           max_retries=0)
    for seed in range(3):
        answer = client.chat.completions.create(
            model=thinking_server.model, messages=ASK, max_tokens=12, temperature=1.0,
            seed=seed, logprobs=True, extra_body={"thinking_token_budget": 2})
        tokens = [t.token for t in answer.choices[0].logprobs.content]  # type: ignore[union-attr]
        assert "</think>" in tokens[:3], tokens
        assert answer.choices[0].message.reasoning is not None  # type: ignore[attr-defined]
        thought = tokens.index("</think>") + 1  # counted in the usage, its tag too
        assert answer.usage.completion_tokens_details.reasoning_tokens == thought  # type: ignore[union-attr]
    streamed = list(client.chat.completions.create(
        model=thinking_server.model, messages=ASK, max_tokens=12, temperature=1.0, seed=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"thinking_token_budget": 2}))
    assert 1 <= streamed[-1].usage.completion_tokens_details.reasoning_tokens <= 3  # type: ignore[union-attr]
    response = client.responses.create(model=thinking_server.model, input="hi",
                                       max_output_tokens=12, temperature=1.0,
                                       extra_body={"thinking_token_budget": 2})
    assert 1 <= response.usage.output_tokens_details.reasoning_tokens <= 3  # type: ignore[union-attr]
    messages = anthropic.Anthropic(base_url=thinking_server.base_url, api_key="x",
                                   max_retries=0).messages
    budgeted = messages.create(model="any", max_tokens=12, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 1},
                               extra_body={"seed": 1})
    assert budgeted.content[0].type == "thinking"
    assert 1 <= budgeted.usage.output_tokens <= 12
    with pytest.raises(anthropic.BadRequestError) as bad:
        messages.create(model="any", max_tokens=5, messages=ASK,
                        thinking={"type": "enabled", "budget_tokens": -1})
    assert "budget" in str(bad.value)
    # Any budget past the context is none (llguidance's counts stop at 2**31)
    huge = client.chat.completions.create(model=thinking_server.model, messages=ASK,
                                          max_tokens=3, extra_body={
                                              "thinking_token_budget": 2**40})
    assert huge.choices[0].finish_reason == "length"
    # OpenAI's reasoning_effort reaches the template; "none" turns the thinking off too
    for effort in ("none", "high"):
        chat = client.chat.completions.create(model=thinking_server.model, messages=ASK,
                                              max_tokens=5, reasoning_effort=effort)
        thought = getattr(chat.choices[0].message, "reasoning", None)
        assert (thought is None) == (effort == "none"), (effort, chat)
    # /tokenize counts what the chat renders, reasoning_effort included
    counted_prompt = httpx.post(thinking_server.base_url + "/tokenize", json={
        "messages": ASK, "reasoning_effort": "none"}).json()["count"]
    none_chat = client.chat.completions.create(model=thinking_server.model, messages=ASK,
                                               max_tokens=1, reasoning_effort="none")
    assert counted_prompt == none_chat.usage.prompt_tokens  # type: ignore[union-attr]
    plain_response = client.responses.create(model=thinking_server.model, input="hi",
                                             max_output_tokens=5, reasoning={"effort": "none"})
    assert [item.type for item in plain_response.output] == ["message"]
    with pytest.raises(openai.BadRequestError) as bad_effort:
        client.responses.create(model=thinking_server.model, input="hi",
                                reasoning={"effort": "enormous"})  # type: ignore[typeddict-item]
    assert bad_effort.value.body["param"] == "reasoning.effort"  # type: ignore[index]
    off = messages.create(model="any", max_tokens=5, messages=ASK,
                          thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]  # the prompt closed the thinking
    counted = messages.count_tokens(model="any", messages=ASK, thinking={"type": "disabled"})
    assert counted.input_tokens == off.usage.input_tokens + \
        (off.usage.cache_read_input_tokens or 0)
    assert counted.input_tokens > messages.count_tokens(model="any", messages=ASK).input_tokens
    text_tags = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    plain = text_tags.chat.completions.create(model=server.model, messages=ASK, max_tokens=3)
    assert plain.usage.completion_tokens_details is None  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        text_tags.chat.completions.create(model=server.model, messages=ASK, max_tokens=5,
                                          extra_body={"thinking_token_budget": 8})


def test_thinking_tags_marked_special_are_read(tmp_path_factory, tiny_tokenizer) -> None:
    """A vocabulary (a GGUF conversion, say) that marks <think> special: decoding would
    drop the tags, so such requests keep special tokens and the thinking is still read."""
    from conftest import build_tiny_model

    tokenizer_dir = tmp_path_factory.mktemp("special-thinking-tokenizer")
    vocab = _thinking_tokenizer(tokenizer_dir, tiny_tokenizer, TEMPLATE, special=True)
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny-special-thinking"),
                              tokenizer_dir, vocab, "qwen3", num_key_value_heads=2)
    server = start_server("--model", str(folder), "--dtype", "float32",
                          "--max-model-len", "256", "--kv-cache-memory", "1MiB")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        message = client.chat.completions.create(
            model=server.model, messages=ASK, max_tokens=12, temperature=1.0, seed=1,
            extra_body={"thinking_token_budget": 2}).choices[0].message
        assert message.reasoning is not None and message.content  # type: ignore[attr-defined]
        assert "think>" not in message.content
    finally:
        assert server.stop() == 0, server.log_tail()
        server.remove_log()


def test_a_streams_usage_counts_the_thinking_of_its_whole_output() -> None:
    """A stream's outputs are deltas: the thinking tokens are counted on what the choice
    streamed in all (they were counted on the last delta alone)."""
    from conveyor.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from conveyor.server.output_plan import OutputPlan

    end = 9
    plan = OutputPlan(None, None, None, reasoning=OPEN, reasoning_end_id=end)
    deltas = [CompletionOutput(0, "a b", [5, 6]), CompletionOutput(0, " c", [7]),
              CompletionOutput(0, "</think>Hi", [end, 8], finish_reason="stop")]
    stream = plan.choice_stream()
    for delta in deltas:
        stream.next_chunk(delta, 0)
    last = RequestOutput("r", None, [1, 2], [deltas[-1]], True,
                         RequestMetrics(0.0, num_generation_tokens=5))
    counted = plan.usage(last, [(stream.token_ids, stream.output_text)])
    assert counted.completion_tokens_details is not None
    assert counted.completion_tokens_details.reasoning_tokens == 4  # a, b, c and </think>
    assert plan.reasoning_tokens([5, 6, 7, end, 8], "a b c</think>Hi") == 4

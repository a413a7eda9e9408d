"""Constrained decoding offline, on the tiny random model (its outputs are random, so only
the grammar makes them valid): every output that stops parses and validates, greedy and
sampled, n > 1, under recompute preemption, next to free requests whose outputs do not
change; bad constraints are ValueErrors naming the field. And the Hermes tool-call parser:
a stream, cut anywhere, reassembles to the whole answer.
"""

from __future__ import annotations

import json
import os
import random
import re

import jsonschema
import pytest

from conveyor import LLM, SamplingParams, StructuredOutputsParams
from conveyor.bench.datasets import sample_json_schema_requests
from conveyor.server.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ToolParser,
)
from conveyor.server.tools import ToolCallStream

PROMPTS = ["one two three", "the cat sat on", "東京 日本語 Привет", "def return print"]


def _schema(rng: random.Random, depth: int = 0) -> dict:
    """A random schema from the features real ones use, small enough to finish."""
    kinds = ["string", "integer", "number", "enum", "boolean"]
    if depth < 2:
        kinds += ["object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 1}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, None], rng.randint(1, 3))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": _schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}
    if kind == "anyOf":
        return {"anyOf": [_schema(rng, depth + 1), _schema(rng, depth + 1)]}
    names = rng.sample(["a", "b", "c", "d"], rng.randint(1, 3))
    return {"type": "object", "properties": {n: _schema(rng, depth + 1) for n in names},
            "required": names, "additionalProperties": False}


SCHEMAS = [_schema(random.Random(seed)) for seed in range(6)] + [
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{3}$"},
                                      "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["zip", "tags"], "additionalProperties": False}]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=1 << 20,
               max_model_len=1024)


def _json(schema: dict, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(json=schema),
                          **kwargs)


def test_every_output_validates_greedy_sampled_and_n(llm, kv_free) -> None:
    params = [_json(s, temperature=t, seed=i, n=2 if t else 1)
              for i, s in enumerate(SCHEMAS) for t in (0.0, 1.0)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outputs = llm.generate(prompts, params)
    schemas = [s for s in SCHEMAS for _ in (0, 1)]
    num_checked = 0
    for out, schema in zip(outputs, schemas, strict=True):
        for c in out.outputs:
            assert c.finish_reason == "stop", (schema, c.text)
            jsonschema.validate(json.loads(c.text), schema)
            num_checked += 1
    assert num_checked == len(SCHEMAS) * 3
    kv_free(llm)


def test_free_requests_unchanged_next_to_constrained(llm, kv_free) -> None:
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS, free)
    mixed = llm.generate(PROMPTS * 2, [free] * len(PROMPTS) + [_json(s) for s in SCHEMAS[:4]])
    for a, b in zip(alone, mixed[:len(PROMPTS)], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for out, schema in zip(mixed[len(PROMPTS):], SCHEMAS[:4], strict=True):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    kv_free(llm)


def test_regex_choice_grammar_and_preemption(tiny_llama_dir, kv_free) -> None:
    # 12 blocks of 16 tokens for 16 requests of ~40 tokens each: preemptions are certain.
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=12 * 16 * 1024,
              max_model_len=1024)
    kinds = [StructuredOutputsParams(regex=r"[a-z]{20,30}\.[0-9]{3}"),
             StructuredOutputsParams(choice=["apple", "banana split"]),
             StructuredOutputsParams(grammar='root ::= "x" ("ab" | "cd"){10,20} "!"'),
             StructuredOutputsParams(json=SCHEMAS[-1])]
    checks = [lambda t: re.fullmatch(r"[a-z]{20,30}\.[0-9]{3}", t),
              lambda t: t in ("apple", "banana split"),
              lambda t: re.fullmatch(r"x((ab)|(cd)){10,20}!", t),
              lambda t: jsonschema.validate(json.loads(t), SCHEMAS[-1]) is None]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=k)
              for i, k in enumerate(kinds * 4)]
    outputs = llm.generate([PROMPTS[i % 4] * 3 for i in range(16)], params)
    assert llm.stats().num_preemptions > 0
    for out, check in zip(outputs, checks * 4, strict=True):
        assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out
    kv_free(llm)


@pytest.mark.parametrize("max_tokens", [None, "all"])
def test_a_stop_string_among_forced_drafts_ends_the_text(llm, kv_free, max_tokens) -> None:
    """One choice: after its first token the grammar forces the rest, verified in one step.
    A stop string that an early draft completes ends the output there, as "stop", also when
    the step's last token reached max_tokens (the scheduler has finished the request)."""
    text = "hello world and the sea and the sky"
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=0, stop=["world"], ignore_eos=True,
                            max_tokens=len(ids) if max_tokens else 64,
                            structured_outputs=StructuredOutputsParams(choice=[text]))
    before = llm.stats().grammar_forced_accepted_tokens
    (out,) = llm.generate(PROMPTS[0], params)
    completion = out.outputs[0]
    # all but the first token (sampled) and the step's own last one came as drafts
    assert llm.stats().grammar_forced_accepted_tokens - before >= len(ids) - 2
    assert (completion.text, completion.finish_reason, completion.stop_reason) == \
        ("hello ", "stop", "world")
    assert llm.get_tokenizer().decode(completion.token_ids).rstrip() == "hello world"
    kv_free(llm)


def test_max_tokens_mid_structure_is_length(llm) -> None:
    out = llm.generate(PROMPTS[0], _json(SCHEMAS[-1]).replace(max_tokens=3))[0].outputs[0]
    assert out.finish_reason == "length"


def test_forced_drafts_change_no_output(tiny_llama_dir, kv_free) -> None:
    """The tokens a grammar forces are verified as drafts (grammar_forced_drafts, on by
    default): the same tokens and logprobs as without, greedy, seeded-sampled and n > 1,
    next to a free request, under recompute preemption (12 blocks of 16 tokens)."""
    kinds = [StructuredOutputsParams(json=s) for s in SCHEMAS] + [
        StructuredOutputsParams(grammar='root ::= "x" ("abc" | "cd"){10,20} "!"'),
        StructuredOutputsParams(choice=["apple", "banana split"])]
    params = [SamplingParams(temperature=t, seed=i, n=2 if t else 1, max_tokens=60,
                             logprobs=2 if t else None, structured_outputs=k)
              for i, k in enumerate(kinds) for t in (0.0, 1.0)]
    params.append(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    prompts = [PROMPTS[i % len(PROMPTS)] * 2 for i in range(len(params))]
    runs = {}
    for forced in (False, True):
        llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=12 * 16 * 1024,
                  max_model_len=1024, grammar_forced_drafts=forced)
        runs[forced] = [[(c.token_ids, c.logprobs) for c in o.outputs]
                        for o in llm.generate(prompts, params)]
        stats = llm.stats()
        assert stats.num_preemptions > 0
        kv_free(llm)
    assert runs[True] == runs[False]
    assert stats.grammar_forced_accepted_tokens > 50
    assert stats.grammar_forced_accepted_tokens <= stats.grammar_forced_draft_tokens


def test_forced_drafts_change_no_output_of_the_default_model(default_llm, kv_free) -> None:
    """The json-schema benchmark's requests on the default model (float32), greedy, with a
    free request beside them: the same tokens with forced drafts (default_llm) as without,
    and a third of the tokens or so came as forced drafts."""
    requests = sample_json_schema_requests(8, 48, seed=0)
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=
                             StructuredOutputsParams(json=r.response_format["json_schema"]
                                                     ["schema"]))
              for r in requests]
    prompts = [[{"role": "user", "content": r.prompt}] for r in requests]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts.append([{"role": "user", "content": "Name three rivers."}])
    params.append(free)
    before = default_llm.stats().grammar_forced_accepted_tokens
    on = [o.outputs[0] for o in default_llm.chat(prompts, params)]
    off_llm = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=1024,
                  grammar_forced_drafts=False)
    off = [o.outputs[0] for o in off_llm.chat(prompts, params)]
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    accepted = default_llm.stats().grammar_forced_accepted_tokens - before
    assert accepted > 0.2 * sum(len(c.token_ids) for c in on[:-1])
    for c, r in zip(on[:-1], requests, strict=True):
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), r.response_format["json_schema"]["schema"])
    kv_free(default_llm)
    kv_free(off_llm)


# Ambiguous (every split of a run of "a"s and "#"s parses, through 10 rules): it compiles
# at once, but its first mask, over tokens such as "#####...", needs more Earley items than
# llguidance's per-step limit (50,000), so llguidance gives up on it while generating.
FUEL_GRAMMAR = "start: r0\n" + "".join(f'r{i}: r{i} r{i} | r{i + 1} | "a" | "#"\n'
                                       for i in range(10)) + 'r10: "b"'


def test_filling_masks_starts_no_second_openmp_team(default_llm, kv_free) -> None:
    """The masks are filled on a thread of their own: a torch op there large enough to run
    in parallel (32 rows x 1,536 words of the default model's vocabulary) started a second
    OpenMP team beside the step loop's, one more thread than cores, and libgomp then stops
    spinning between parallel regions: every later step ran ~1.7x slower on 2 cores, free
    requests included. Filling 32 rows must start no thread the first fill did not."""
    threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    params = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no", "maybe"]))
    default_llm.generate(PROMPTS[:1], params)  # the mask thread and llguidance's pool
    before = threads()
    outputs = default_llm.generate(PROMPTS[:1] * 32, params)
    assert {o.outputs[0].text for o in outputs} <= {"yes", "no", "maybe"}
    assert threads() <= before
    kv_free(default_llm)


def test_grammar_out_of_fuel_ends_with_error_alone(default_llm, kv_free) -> None:
    """llguidance gives up on a grammar while generating: each sample ends on its own with
    finish_reason "error" and the reason (not "stop"); a free request beside them gives
    what it gives alone. The default model: the tiny one's vocabulary has no long runs of
    "#" to exhaust the limit with."""
    llm = default_llm
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], free)[0].outputs[0].token_ids
    errors = llm.stats().finished_by_reason["error"]
    hostile = SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(grammar=FUEL_GRAMMAR))
    mixed = llm.generate(PROMPTS[:2], [free, hostile])
    assert mixed[0].outputs[0].token_ids == alone
    for c in mixed[1].outputs:
        assert c.finish_reason == "error" and c.error.startswith("structured output failed: ")
        assert "Too many items" in c.error and set(c.text) <= {"a", "b", "#"}
    assert llm.stats().finished_by_reason["error"] == errors + 2
    kv_free(llm)


@pytest.mark.parametrize(("spec", "words"), [
    ({"json": {"type": "strin"}}, ["structured_outputs.json", "strin"]),
    ({"json": '{"type": '}, ["structured_outputs.json", "not valid JSON"]),
    ({"json": {"type": "object", "if": {}}}, ["Unimplemented", "if"]),
    ({"regex": "a(b"}, ["structured_outputs.regex"]),
    ({"grammar": "root ::= undefined_rule"}, ["structured_outputs.grammar"]),
])
def test_bad_constraints_name_the_field(llm, kv_free, spec: dict, words: list[str]) -> None:
    errors = llm.stats().grammar_compile_errors
    with pytest.raises(ValueError) as e:
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    for word in words:
        assert word in str(e.value)
    assert llm.stats().grammar_compile_errors == errors + 1
    kv_free(llm)


def test_structured_outputs_params_validate() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]
    # a grammar that has ended allows only EOS, which min_tokens would ban: refused
    with pytest.raises(ValueError, match="^min_tokens must be 0 with structured_outputs"):
        SamplingParams(min_tokens=1, structured_outputs=StructuredOutputsParams(regex="a+"))


# ---------------------------------------------------------------------- tool-call parser
TEXTS = [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    'Let me check. <tool_call>\n{"name": "f", "arguments": {"a": "<tool_call>"}}\n</tool_call>'
    '\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
    "no call here, just text with a < sign and <tool_ca",
    'broken <tool_call>{"name": "f", "arguments": </tool_call> then text',
    'ok <tool_call>{"name": "f", "arguments": {}}</tool_call> <tool_call>{"name": ',
    '<tool_call>{"arguments": {"b": [1, 2]}, "name": "h"}</tool_call>',  # name last
    '<tool_call>{"name": "f", "parameters": 12} </tool_call>',
    '<tool_call> {"name": "f", "arguments": {"s": "x}</tool"}} </tool_call>',
    '<tool_call>\n{"name": "f"}\n</tool_call><tool_call>{"name": "g", "arguments": {"a": "é',
    '<tool_call>{"name": "f", "arguments": {"a": true,\n  "b": nul',  # cut by max_tokens
]
# Llama 3's (llama3_json): the output is the calls, or content
LLAMA3_TEXTS = [
    '{"name": "f", "parameters": {"a": 1}}',
    '<|python_tag|>{"name": "f", "parameters": {"a": "}; {"}}; {"name": "g", "parameters": {}}',
    "  Paris is the capital; {\"name\": \"f\"} is not a call here",
    '{"answer": 42, "name": 7}',  # JSON, but no call: content
    '{"name": "Bob", "age": 31}',  # a name, but no parameters: an answer, not a call
    ' {"parameters": {"b": [1, 2]}, "name": "h"}  ;{"name": "i", "parameters": {"s": "é',
    '<|python_tag|>{"name": "f", "parameters": {"a": true,\n  "b": nul',  # cut by max_tokens
    "<|python_ta",  # cut inside the tag: content (it is not a call)
]
# Mistral's: the array after [TOOL_CALLS] (v3, v7), or name[ARGS]{...} per call (v11 on)
MISTRAL_TEXTS = [
    '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
    'Let me look. [TOOL_CALLS][{"name": "f", "arguments": {"s": "[TOOL_CALL"}}]',
    '[TOOL_CALLS]f[ARGS]{"a": [1, 2]}[TOOL_CALLS]g[ARGS]{"s": "é"}',
    "no call, [TOOL but not the tag",
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',  # cut by max_tokens
]


def _reassemble(parser: ToolParser, text: str, ends: list[int]
                ) -> tuple[str | None, list[tuple[str, str, str]], list[int]]:
    """(content, [(id, name, arguments)], argument deltas per call) of a stream cut at
    ``ends``; each call's id and name come once, in its first delta."""
    stream = ToolCallStream(parser)
    content, calls, pieces = "", [], []
    for end in ends:
        delta, news = stream.update(text[:end], finished=end == len(text))
        content += delta
        for news_item in news:
            if news_item.index == len(calls):
                assert news_item.id is not None and news_item.name is not None
                calls.append([news_item.id, news_item.name, ""])
                pieces.append(0)
            else:
                assert news_item.id is None and news_item.name is None and news_item.arguments
            calls[news_item.index][2] += news_item.arguments
            pieces[news_item.index] += bool(news_item.arguments)
    return content or None, [tuple(c) for c in calls], pieces


@pytest.mark.parametrize(("parser", "text"), [(HermesToolParser(), t) for t in TEXTS] +
                         [(Llama3JsonToolParser(), t) for t in LLAMA3_TEXTS] +
                         [(MistralToolParser(), t) for t in MISTRAL_TEXTS])
def test_streamed_tool_calls_reassemble_to_the_whole(parser: ToolParser, text: str) -> None:
    content, calls = parser.parse(text)
    whole = [(c.name, c.arguments) for c in calls]
    rng = random.Random(len(text))
    for _ in range(20):  # random cuts, and every single character as its own delta
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 8)))
        for ends in (cuts + [len(text)], list(range(1, len(text) + 1))):
            streamed, streamed_calls, _ = _reassemble(parser, text, ends)
            assert streamed == content
            assert [(name, arguments) for _, name, arguments in streamed_calls] == whole
            assert len({call_id for call_id, _, _ in streamed_calls}) == len(calls)


def test_tool_call_arguments_are_the_models_text_streamed_as_written() -> None:
    parser = HermesToolParser()
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city":"Zürich",  "days": [1, 2]}}'
            '\n</tool_call>')
    content, calls = parser.parse(text)
    assert content is None and [(c.name, c.arguments) for c in calls] == \
        [("get_weather", '{"city":"Zürich",  "days": [1, 2]}')]
    _, streamed, pieces = _reassemble(parser, text, list(range(1, len(text) + 1)))
    assert streamed[0][1:] == ("get_weather", calls[0].arguments)
    # a delta per character written (whitespace goes with the character after it)
    assert pieces == [sum(not ch.isspace() for ch in calls[0].arguments)]
    # broken or cut short: the call and what was written of its arguments, nothing else
    assert [(c.name, c.arguments) for c in parser.parse(TEXTS[3])[1]] == [("f", "")]
    assert [(c.name, c.arguments) for c in parser.parse(TEXTS[-1])[1]] == \
        [("f", '{"a": true,\n  "b": nul')]
    assert [(c.name, c.arguments) for c in parser.parse(TEXTS[6])[1]] == [("f", "12")]
    assert parser.parse(TEXTS[2]) == (TEXTS[2], [])


def test_llama3_json_calls_are_the_models_json() -> None:
    parser = Llama3JsonToolParser()
    assert [(c.name, c.arguments) for c in parser.parse(LLAMA3_TEXTS[1])[1]] == \
        [("f", '{"a": "}; {"}'), ("g", "{}")]
    assert parser.parse(LLAMA3_TEXTS[1])[0] is None  # no content beside calls
    assert parser.parse(LLAMA3_TEXTS[2]) == (LLAMA3_TEXTS[2], [])
    assert parser.parse(LLAMA3_TEXTS[3]) == (LLAMA3_TEXTS[3], [])
    assert parser.parse(LLAMA3_TEXTS[4]) == (LLAMA3_TEXTS[4], [])
    assert [(c.name, c.arguments) for c in parser.parse(LLAMA3_TEXTS[5])[1]] == \
        [("h", '{"b": [1, 2]}'), ("i", '{"s": "é')]
    assert [c.name for c in Llama3JsonToolParser(parallel=False).parse(LLAMA3_TEXTS[1])[1]] \
        == ["f"]
    # Forced: the grammar's calls, and an earlier turn's calls written back as the model's
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}} for n in ("f", "g")]
    written = parser.render_calls([{"function": {"name": "f", "arguments": '{"x": 1}'}},
                                   {"function": {"name": "g", "arguments": {"x": 2}}}])
    assert written == '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"x": 2}}'
    assert [(c.name, c.arguments) for c in parser.parse(written)[1]] == \
        [("f", '{"x": 1}'), ("g", '{"x": 2}')]
    assert "start: call" in parser.grammar(tools, parallel=True)


def test_mistral_calls_in_both_forms() -> None:
    parser = MistralToolParser()
    content, calls = parser.parse(MISTRAL_TEXTS[1])
    assert content == "Let me look. " and [(c.name, c.arguments) for c in calls] == \
        [("f", '{"s": "[TOOL_CALL"}')]
    assert [(c.name, c.arguments) for c in parser.parse(MISTRAL_TEXTS[2])[1]] == \
        [("f", '{"a": [1, 2]}'), ("g", '{"s": "é"}')]
    assert [(c.name, c.arguments) for c in parser.parse(MISTRAL_TEXTS[4])[1]] == \
        [("get_weather", '{"city": "Par')]
    assert parser.parse(MISTRAL_TEXTS[3]) == (MISTRAL_TEXTS[3], [])
    # Mistral's templates refuse other ids: 9 letters and digits
    assert all(len(c.id) == 9 and c.id.isalnum() for c in parser.parse(MISTRAL_TEXTS[0])[1])
    written = parser.render_calls([{"function": {"name": "f", "arguments": '{"a": 1}'}}])
    assert [(c.name, c.arguments) for c in parser.parse(written)[1]] == [("f", '{"a": 1}')]


def test_without_parallel_tool_calls_only_the_first_call_counts() -> None:
    """parallel_tool_calls=false with tool_choice "auto" (no grammar holds the model to one
    call): the first call, whole and streamed, as OpenAI makes at most one."""
    two = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n' \
          '<tool_call>\n{"name": "g", "arguments": {"x": 2}}\n</tool_call>'
    assert [c.name for c in HermesToolParser().parse(two)[1]] == ["f", "g"]
    single = HermesToolParser(parallel=False)
    assert [(c.name, c.arguments) for c in single.parse(two)[1]] == [("f", '{"x": 1}')]
    _, streamed, _ = _reassemble(single, two, list(range(1, len(two) + 1)))
    assert [(name, arguments) for _, name, arguments in streamed] == [("f", '{"x": 1}')]


def test_required_grammar_takes_parallel_calls_only_when_asked(llm) -> None:
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
        "additionalProperties": False}}} for n in ("f", "g")]
    parser = HermesToolParser()
    two = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n' \
          '<tool_call>\n{"name": "g", "arguments": {"x": 2}}\n</tool_call>'
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(two, add_special_tokens=False)
    one = len(tokenizer.encode(two[:two.index("\n<tool_call>", 1)], add_special_tokens=False))
    for parallel, accepted in ((True, len(ids)), (False, one)):
        grammar = parser.grammar(tools, parallel=parallel)
        matcher = llm.engine.grammars.compile(StructuredOutputsParams(grammar=grammar),
                                              count=False)
        assert matcher.validate_tokens(ids) == accepted, parallel
        assert matcher.consume_tokens(ids[:accepted]) and matcher.is_accepting()


def test_grammar_cache_counts_each_request_once(llm) -> None:
    before = llm.stats()
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    llm.generate(PROMPTS[:3], _json(schema, temperature=0))
    after = llm.stats()
    assert after.grammar_compiles - before.grammar_compiles == 1
    assert after.grammar_cache_hits - before.grammar_cache_hits == 2
    assert after.grammar_compile_seconds > before.grammar_compile_seconds


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_mask_kernel_bans_what_the_numpy_path_bans(monkeypatch, dtype) -> None:
    """``apply_token_bitmask`` on the host: the C++ kernel where the kernels load, numpy
    otherwise; both give -inf to every token whose bit is clear (the tokens past the mask's
    words too) in the rows named, and leave every other logit as it was."""
    import numpy as np
    import torch

    from conveyor.ops import cpu_kernels
    from conveyor.structured import bitmask as bitmask_module

    rng = np.random.default_rng(0)
    vocab, words, rows = 1000, 30, [4, 0, 2]  # 960 tokens masked, 40 past the words
    mask = rng.integers(-2**31, 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
    mask[0, :] = -1  # one row all allowed (but its tokens past the words)
    logits = torch.randn(6, vocab).to(getattr(torch, dtype))
    expected = logits.clone()
    allowed = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little").astype(bool)
    for i, row in enumerate(rows):
        banned = np.ones(vocab, dtype=bool)
        banned[:words * 32] = ~allowed[i]
        expected[row, torch.from_numpy(banned)] = float("-inf")
    assert cpu_kernels.load_cpu_kernels()
    kernel = logits.clone()
    bitmask_module.apply_token_bitmask(kernel, torch.from_numpy(mask), rows)
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: False)
    plain = logits.clone()
    bitmask_module.apply_token_bitmask(plain, torch.from_numpy(mask), rows)
    assert torch.equal(kernel, expected) and torch.equal(plain, expected)

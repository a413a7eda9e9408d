"""Tool-call parsers: how each model family writes tool calls, read back into OpenAI's
`tool_calls` (whole or growing), forced by a grammar (tool_choice "required" or a named
function), described to a template that ignores `tools`, and written back for an earlier
turn.

Chosen by `--tool-call-parser` with vLLM's names: "hermes" reads
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2/2.5/3, SmolLM3);
"llama3_json" `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3); "mistral" what follows
`[TOOL_CALLS]` (Mistral's models).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conveyor.structured.compiler import JSON_OPTIONS

_LLAMA3_SYSTEM = (  # Llama 3.1's own words, for templates that ignore `tools`
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\nRespond in the format "
    '{{"name": function name, "parameters": dictionary of argument name and its value}}. '
    "Do not use variables.\n\n{tools}")
_MISTRAL_SYSTEM = (  # for templates that ignore `tools` (Mistral's own render them)
    "You may call these functions:\n{tools}\n\nTo call them, answer with [TOOL_CALLS] and "
    'a JSON list of calls: [TOOL_CALLS][{{"name": <function-name>, "arguments": '
    "<args-json-object>}}]")
# Hermes's instructions, as Qwen2.5's chat template writes them: used for templates that
# ignore `tools` (SmolLM2's, the default model's), so the model still sees its tools.
_HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass(frozen=True)
class ParsedToolCall:
    """One call the model made: the function's name and its arguments as the model wrote
    them (JSON text; cut short where the output or the block ended first)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}", compare=False)


def tool_function(tool: dict[str, Any]) -> dict[str, Any]:
    """The `function` of a tool (the request's validation guarantees its shape)."""
    function: dict[str, Any] = tool["function"]
    return function


_DECODER = json.JSONDecoder()
_ARGUMENT_KEYS = ("arguments", "parameters")


def _skip_space(text: str, i: int) -> int:
    """The index of the first character at or after ``i`` that is not JSON whitespace."""
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def _read(text: str, i: int) -> tuple[Any, int | None]:
    """The JSON value at ``text[i:]`` and where it ends; (None, None) when it is not
    complete there (or not JSON)."""
    try:
        return _DECODER.raw_decode(text, i)
    except json.JSONDecodeError:
        return None, None


def scan_call(body: str, require_arguments: bool = False) -> tuple[str | None, str]:
    """(name, arguments text) of a tool call's JSON object, as far as ``body`` goes.

    Python's JSON decoder reads each key and value in turn; the arguments are the raw text
    of the "arguments" (or "parameters") value: all of it once the decoder reads it whole,
    else what is written of it so far (trailing whitespace held back); ``{}`` when the
    object closed without one. No name: not a call. A grown ``body`` never changes a name
    once read, and its arguments text starts with the shorter one's: streaming relies on
    that. ``require_arguments``: an object without the arguments key (yet) is no call."""
    i = _skip_space(body, 0)
    if not body.startswith("{", i):
        return None, ""
    name: str | None = None
    arguments: str | None = None
    i += 1
    while True:
        i = _skip_space(body, i)
        if body.startswith("}", i):
            if arguments is None and require_arguments:
                return None, ""
            return name, "{}" if arguments is None else arguments
        if body.startswith(",", i):
            i = _skip_space(body, i + 1)
        key, end = _read(body, i)
        if end is None or not isinstance(key, str):
            break
        i = _skip_space(body, end)
        if not body.startswith(":", i):
            break
        i = _skip_space(body, i + 1)
        wanted = key in _ARGUMENT_KEYS and arguments is None
        value, end = _read(body, i)
        if end is None:  # not complete yet (or never: not JSON)
            arguments = body[i:].rstrip() if wanted else arguments
            break
        if key == "name" and name is None and isinstance(value, str):
            name = value
        elif wanted:
            arguments = body[i:end]
        i = end
    if arguments is None and require_arguments:
        return None, ""
    return name, arguments or ""


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that could be the start of ``tag``."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


def _hoisted_definitions(tools: list[dict[str, Any]]
                         ) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Each tool's parameters without their `$defs` / `definitions`, and those gathered for
    the grammar's root schema: a `$ref` such as "#/$defs/Address" (pydantic writes them for
    nested models) points at the root, which the parameters are no longer (as vLLM does).
    ValueError when two tools define one name differently."""
    gathered: dict[str, dict[str, Any]] = {}
    parameters = []
    for tool in tools:
        schema = dict(tool_function(tool).get("parameters") or {"type": "object"})
        for key in ("$defs", "definitions"):
            found = schema.pop(key, None)
            if not isinstance(found, dict):
                continue
            for name, definition in found.items():
                if gathered.setdefault(key, {}).setdefault(name, definition) != definition:
                    raise ValueError(f"tools define {key}/{name} differently (their parameters "
                                     "share one root schema in the tool-call grammar)")
        parameters.append(schema)
    return parameters, gathered


class ToolParser:
    """How one model family writes tool calls: parsed whole (``parse``) or growing
    (``calls``, ``streamable_content``), forced by a grammar, described to a template that
    ignores tools, and written back for an earlier turn."""

    arguments_key = "arguments"  # the key of a call's arguments, as the family writes it
    # Its tags are special tokens, which a request's text keeps only when asked
    keeps_special_tokens = False
    # A JSON object is a call only with its arguments key (no tag sets calls apart)
    requires_arguments = False
    call_separator = "\n"  # between calls (grammar, calls written back)
    tools_separator = "\n"  # between the tools described in the system prompt
    system_template = "{tools}"

    def __init__(self, parallel: bool = True, forced: bool = False) -> None:
        # False (the request's parallel_tool_calls): only the first call counts, as OpenAI
        # makes at most one (the text after it is neither content nor calls)
        self.parallel = parallel
        # True: a grammar forces calls (tool_choice "required" or a named function), so the
        # text is never content, even cut by max_tokens before a call's name is written
        self.forced = forced

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls) of a finished output: each call whose JSON names a function
        (one the output ended in too: its arguments are cut short, as OpenAI's are on
        "length"); with no call at all the whole text is content."""
        calls = self.calls(text, finished=True)
        content = self.content_before_calls(text) if calls else None if self.forced else text
        return content or None, calls

    def calls(self, text: str, finished: bool) -> list[ParsedToolCall]:
        """The calls in the text so far (an open one at the end as far as it goes)."""
        scanned = (scan_call(body, self.requires_arguments)
                   for body in self.call_bodies(text, finished))
        calls = [ParsedToolCall(name, arguments) for name, arguments in scanned
                 if name is not None]
        return calls if self.parallel else calls[:1]

    def call_bodies(self, text: str, finished: bool) -> list[str]:
        raise NotImplementedError

    def content_before_calls(self, text: str) -> str:
        raise NotImplementedError

    def streamable_content(self, text: str) -> str:
        """The prefix of a growing text that is content whatever comes next."""
        raise NotImplementedError

    def calls_schema(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        """The JSON Schema of one call of any of ``tools``, arguments valid against their
        parameters."""
        parameters, definitions = _hoisted_definitions(tools)
        key = self.arguments_key
        options = [{"type": "object",
                    "properties": {"name": {"const": tool_function(t)["name"]}, key: arguments},
                    "required": ["name", key], "additionalProperties": False}
                   for t, arguments in zip(tools, parameters, strict=True)]
        return {"anyOf": options, **definitions, "x-guidance": JSON_OPTIONS}

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                literal: Callable[[str], str] = json.dumps) -> str:
        """A Lark grammar (llguidance's, `%json` embeds a schema) for one or more calls of
        these tools, in this parser's syntax, with arguments valid against their schemas.
        ``literal``: a tag as the grammar writes it (``compiler.lark_literal``: the token
        where the vocabulary has one)."""
        call = self.call_grammar(f"%json {json.dumps(self.calls_schema(tools))}", literal)
        if not parallel:
            return f"start: {call}"
        return f"start: call ({json.dumps(self.call_separator)} call)*\ncall: {call}"

    def call_grammar(self, json_rule: str, literal: Callable[[str], str]) -> str:
        """One call in the grammar, around the rule of its JSON object."""
        return json_rule

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """The tools described for a template that ignores `tools`."""
        listed = self.tools_separator.join(
            json.dumps({"type": "function", "function": tool_function(t)}, ensure_ascii=False)
            for t in tools)
        return self.system_template.format(tools=listed)

    def call_json(self, call: dict[str, Any]) -> str:
        """An earlier turn's call as the JSON object the model writes."""
        function = call.get("function") or {}
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        return json.dumps({"name": function.get("name"), self.arguments_key: arguments},
                          ensure_ascii=False)

    def render_call(self, call: dict[str, Any]) -> str:
        """An assistant turn's earlier tool call, as the model writes one."""
        return self.call_json(call)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return self.call_separator.join(self.render_call(c) for c in calls)


class TaggedToolParser(ToolParser):
    """Calls that begin with a tag (``start``): the text before the first is content."""

    start = ""

    def content_before_calls(self, text: str) -> str:
        return text[:text.find(self.start)]

    def streamable_content(self, text: str) -> str:
        """Up to the first tag, holding back a tail that could be the start of one."""
        first = text.find(self.start)
        if first != -1:
            return text[:first]
        return text[:len(text) - partial_tag(text, self.start)]


class HermesToolParser(TaggedToolParser):
    """`<tool_call>{json}</tool_call>` blocks, any text before the first one is content."""

    start, end = "<tool_call>", "</tool_call>"
    system_template = _HERMES_SYSTEM
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


    def call_bodies(self, text: str, finished: bool) -> list[str]:
        """Closed blocks, then an open one at the end (while the text grows, without a tail
        that could start its `</tool_call>`)."""
        bodies: list[str] = []
        pos = 0
        for match in self._block.finditer(text):
            bodies.append(match.group(1))
            pos = match.end()
        open_at = text.find(self.start, pos)
        if open_at != -1:
            body = text[open_at + len(self.start):]
            bodies.append(body if finished else body[:len(body) - partial_tag(body, self.end)])
        return bodies


    def call_grammar(self, json_rule: str, literal: Callable[[str], str]) -> str:
        return f'{literal(self.start)} "\\n" {json_rule} "\\n" {literal(self.end)}'

    def render_call(self, call: dict[str, Any]) -> str:
        return f"{self.start}\n{self.call_json(call)}\n{self.end}"


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-3.3's JSON calls (vLLM's llama3_json): the output is the call,
    `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` at times), several joined
    by ";"; an output that does not begin with one is content (no content beside calls)."""

    arguments_key = "parameters"
    requires_arguments = True  # {"name": "Bob", "age": 31} is an answer, not a call
    call_separator = "; "
    tools_separator = "\n\n"
    system_template = _LLAMA3_SYSTEM
    tag = "<|python_tag|>"

    def _calls_text(self, text: str) -> str | None:
        """The text from the first call on; None when the output is not calls."""
        rest = text.lstrip()
        if rest.startswith(self.tag):
            rest = rest[len(self.tag):].lstrip()
        return rest if rest.startswith("{") else None

    def content_before_calls(self, text: str) -> str:
        return ""

    def call_bodies(self, text: str, finished: bool) -> list[str]:
        """Each JSON object in turn, ";" between them; the last one open while it grows."""
        rest = self._calls_text(text)
        return [] if rest is None else _json_objects(rest, 0, ";")

    def streamable_content(self, text: str) -> str:
        """Nothing while the output may still be calls (its beginning decides), else all."""
        rest = text.lstrip()
        undecided = not rest or self.tag.startswith(rest) or rest.startswith(self.tag) \
            or rest.startswith("{")
        return "" if undecided else text


class MistralToolParser(TaggedToolParser):
    """Mistral's calls, after its `[TOOL_CALLS]` token (vLLM's mistral): a JSON array of
    `{"name", "arguments"}` objects (Mistral 7B v0.3, Nemo, Small 2409-2501, Large 2407-2411),
    or `name[ARGS]{...}` after each call's own `[TOOL_CALLS]` (v11 on: Small 3.1+, Magistral,
    Devstral); text before the first is content. The tags are special tokens: requests keep
    special tokens in their text (``keeps_special_tokens``). Call ids are 9 letters and
    digits, as Mistral's chat templates insist."""

    start, args_tag = "[TOOL_CALLS]", "[ARGS]"
    keeps_special_tokens = True
    system_template = _MISTRAL_SYSTEM

    @staticmethod
    def new_id() -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))



    def calls(self, text: str, finished: bool) -> list[ParsedToolCall]:
        first = text.find(self.start)
        if first == -1:
            return []
        found: list[tuple[str | None, str]] = []
        for part in text[first + len(self.start):].split(self.start):
            rest = part.lstrip()
            if rest.startswith("["):  # [{...}, {...}]
                found += [scan_call(body) for body in _json_objects(rest, 1, ",")]
            elif self.args_tag in rest:  # name[ARGS]{...}
                name, _, arguments = rest.partition(self.args_tag)
                found.append((name.strip(), _json_text(arguments)))
            elif finished and rest.strip():  # cut before its arguments began
                found.append((rest.strip(), ""))
        calls = [ParsedToolCall(name, arguments, self.new_id())
                 for name, arguments in found if name]
        return calls if self.parallel else calls[:1]

    def grammar(self, tools: list[dict[str, Any]], parallel: bool,
                literal: Callable[[str], str] = json.dumps) -> str:
        """The form the vocabulary says: `name[ARGS]{...}` where `[ARGS]` is a token (v11
        on), else the array."""
        tag, args = literal(self.start), literal(self.args_tag)
        if not args.startswith("<["):
            more = ' (", " call)*' if parallel else ""
            return (f'start: {tag} " "? "[" call{more} "]"\n'
                    f"call: %json {json.dumps(self.calls_schema(tools))}")
        parameters, definitions = _hoisted_definitions(tools)
        rules = [f'call{i}: {tag} {json.dumps(tool_function(t)["name"])} {args} %json '
                 f'{json.dumps({**p, **definitions, "x-guidance": JSON_OPTIONS})}'
                 for i, (t, p) in enumerate(zip(tools, parameters, strict=True))]
        calls = " | ".join(f"call{i}" for i in range(len(rules)))
        return f"start: ({calls}){'+' if parallel else ''}\n" + "\n".join(rules)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return f"{self.start}[{', '.join(self.call_json(c) for c in calls)}]"


def _json_objects(text: str, i: int, separator: str) -> list[str]:
    """The JSON objects from ``text[i:]`` on, ``separator`` (and whitespace) between them;
    the last as far as written while it is open (or broken)."""
    objects: list[str] = []
    i = _skip_space(text, i)
    while text.startswith("{", i):
        _, end = _read(text, i)
        if end is None:
            objects.append(text[i:])
            break
        objects.append(text[i:end])
        i = _skip_space(text, end)
        i = _skip_space(text, i + 1) if text.startswith(separator, i) else len(text)
    return objects


def _json_text(text: str) -> str:
    """The JSON value at the start of ``text``: whole, else as far as written (trailing
    whitespace held back)."""
    i = _skip_space(text, 0)
    _, end = _read(text, i)
    return text[i:end] if end is not None else text[i:].rstrip()


_ALNUM = string.ascii_letters + string.digits

# --tool-call-parser's choices (ServerConfig checks the flag against these names).
TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser,
                                             "llama3_json": Llama3JsonToolParser,
                                             "mistral": MistralToolParser}


def get_tool_parser(name: str | None, parallel: bool = True,
                    forced: bool = False) -> ToolParser:
    """The parser named by --tool-call-parser (hermes when none is set: the format that
    required / named tool_choice grammars produce); ``parallel``: parallel_tool_calls;
    ``forced``: a grammar forces the calls."""
    return TOOL_PARSERS[name or "hermes"](parallel, forced)

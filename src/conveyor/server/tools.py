"""Tool calling: the tools' prompt (the template's own, else Hermes's), the grammar that
enforces `tool_choice` "required" or a named function, and the parsers that turn the model's
tool-call syntax back into OpenAI's `tool_calls`, whole or streamed.

Parsers are chosen by `--tool-call-parser` with vLLM's names; "hermes" reads
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2/2.5/3, SmolLM3).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from conveyor.structured.compiler import JSON_OPTIONS

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
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}", compare=False)


def tool_function(tool: dict[str, Any]) -> dict[str, Any]:
    """The `function` of a tool (the request's validation guarantees its shape)."""
    function: dict[str, Any] = tool["function"]
    return function


class HermesToolParser:
    """`<tool_call>{json}</tool_call>` blocks, any text before the first one is content."""

    start, end = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls) of a finished output. Blocks that are not a JSON call are
        dropped; with no call at all the whole text is content."""
        calls = self.complete_calls(text)
        content = text[:text.find(self.start)] if calls else text
        return content or None, calls

    def complete_calls(self, text: str) -> list[ParsedToolCall]:
        calls = []
        for match in self._block.finditer(text):
            try:
                call = json.loads(match.group(1))
            except json.JSONDecodeError:
                continue
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                continue
            arguments = call.get("arguments", call.get("parameters", {}))
            calls.append(ParsedToolCall(call["name"], json.dumps(arguments, ensure_ascii=False)))
        return calls

    def streamable_content(self, text: str) -> str:
        """The prefix of a growing text that is content whatever comes next: up to the
        first `<tool_call>`, holding back a tail that could be the start of one."""
        first = text.find(self.start)
        if first != -1:
            return text[:first]
        for keep in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-keep:]):
                return text[:-keep]
        return text

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance's, `%json` embeds a schema) for one or more calls of
        these tools, in this parser's syntax, with arguments valid against their schemas."""
        options = [{"type": "object",
                    "properties": {"name": {"const": tool_function(t)["name"]},
                                   "arguments": tool_function(t).get("parameters")
                                   or {"type": "object"}},
                    "required": ["name", "arguments"], "additionalProperties": False}
                   for t in tools]
        schema = {"anyOf": options, "x-guidance": JSON_OPTIONS}
        call = f'"{self.start}\\n" %json {json.dumps(schema)} "\\n{self.end}"'
        return f'start: call ("\\n" call)*\ncall: {call}' if parallel else f"start: {call}"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps({"type": "function", "function": tool_function(t)},
                                      ensure_ascii=False) for t in tools)
        return _HERMES_SYSTEM.format(tools=listed)

    def render_call(self, call: dict[str, Any]) -> str:
        """An assistant turn's earlier tool call, as the model writes one."""
        function = call.get("function") or {}
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        body = json.dumps({"name": function.get("name"), "arguments": arguments},
                          ensure_ascii=False)
        return f"{self.start}\n{body}\n{self.end}"


TOOL_PARSERS = {"hermes": HermesToolParser}


def get_tool_parser(name: str | None) -> HermesToolParser:
    """The parser named by --tool-call-parser (hermes when none is set: the format that
    required / named tool_choice grammars produce)."""
    return TOOL_PARSERS[name or "hermes"]()


def template_supports_tools(source: str | None) -> bool:
    """Whether a chat template renders `tools` itself (else conveyor adds Hermes's prompt)."""
    return bool(source) and re.search(r"\btools\b", source or "") is not None


def messages_for_template(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          parser: HermesToolParser, native: bool) -> list[dict[str, Any]]:
    """Messages with tool calls and tool results for a template.

    A template that knows tools gets them as they are (arguments as objects, as Hugging
    Face templates expect). One that does not gets plain text in the parser's syntax: the
    tools in the system message, calls as `<tool_call>` blocks, results as a user turn in
    `<tool_response>` (as Qwen2.5's template writes them).
    """
    if native:
        return [_native_message(m) for m in messages]
    result = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = "\n".join(parser.render_call(c) for c in m.pop("tool_calls"))
            m["content"] = f"{m.get('content') or ''}{calls}"
        elif m.get("role") == "tool":
            m = {"role": "user",
                 "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        m.setdefault("content", "")
        if m["content"] is None:
            m["content"] = ""
        result.append(m)
    if tools:
        prompt = parser.system_prompt(tools)
        if result and result[0].get("role") == "system":
            result[0] = {**result[0], "content": f"{result[0]['content']}\n\n{prompt}"}
        else:
            result.insert(0, {"role": "system", "content": prompt})
    return result


def _native_message(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


@dataclass
class ToolCallStream:
    """One streamed choice's tool calls: content as soon as it cannot start a call, each
    call once its block is complete. The stream's content and calls concatenate to exactly
    ``parser.parse(final_text)``: what the choice streamed is always a prefix of that."""

    parser: HermesToolParser
    sent_content: int = 0
    sent_calls: int = 0

    def update(self, text: str, finished: bool) -> tuple[str, list[tuple[int, ParsedToolCall]]]:
        """(new content, new calls with their index) for the text so far."""
        if finished:
            content, calls = self.parser.parse(text)
            content = content or ""
        else:
            content = self.parser.streamable_content(text)
            calls = self.parser.complete_calls(text)
        delta = content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(content))
        new = list(enumerate(calls))[self.sent_calls:]
        self.sent_calls = max(self.sent_calls, len(calls))
        return delta, new

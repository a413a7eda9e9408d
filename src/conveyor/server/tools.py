"""Tool calling around the parsers (server/tool_parsers.py): the messages a chat template
gets (tools, earlier calls and their results), and a streamed choice's tool calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from conveyor.server.tool_parsers import ToolParser


def template_supports_tools(source: str | None) -> bool:
    """Whether a chat template renders `tools` itself (else conveyor adds Hermes's prompt)."""
    return bool(source) and re.search(r"\btools\b", source or "") is not None


def messages_for_template(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          parser: ToolParser, native: bool) -> list[dict[str, Any]]:
    """Messages with tool calls and tool results for a template.

    A template that knows tools gets them as they are (arguments as objects, as Hugging
    Face templates expect). One that does not gets plain text in the parser's syntax: the
    tools in the system message (the parser's prompt), calls as the parser writes them,
    results as a user turn in `<tool_response>` (as Qwen2.5's template writes them; for every
    parser).
    """
    if native:
        return [_native_message(m) for m in messages]
    result = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["content"] = f"{m.get('content') or ''}{parser.render_calls(m.pop('tool_calls'))}"
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


@dataclass(frozen=True)
class ToolCallDelta:
    """What one streamed chunk says of call ``index``: its first carries the id and the
    name (and the arguments so far), later ones the arguments' next characters."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass
class ToolCallStream:
    """One streamed choice's tool calls: content as soon as it cannot start a call, a call
    once its name is read, then its arguments as the model writes them. Concatenated, the
    stream's content and each call's arguments equal ``parser.parse(final_text)``: what was
    streamed is always a prefix of that (``scan_call``)."""

    parser: ToolParser
    sent_content: int = 0
    sent_arguments: list[int] = field(default_factory=list)  # characters sent, per call

    def update(self, text: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        """(new content, the calls' news) for the text so far."""
        if finished:
            content, calls = self.parser.parse(text)
            content = content or ""
        else:
            content = self.parser.streamable_content(text)
            calls = self.parser.calls(text, finished=False)
        delta = content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(content))
        news = []
        for i, call in enumerate(calls):
            if i == len(self.sent_arguments):
                news.append(ToolCallDelta(i, call.id, call.name, call.arguments))
                self.sent_arguments.append(len(call.arguments))
            elif len(call.arguments) > self.sent_arguments[i]:
                news.append(ToolCallDelta(i, None, None,
                                          call.arguments[self.sent_arguments[i]:]))
                self.sent_arguments[i] = len(call.arguments)
        return delta, news

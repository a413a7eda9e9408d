"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, run as a chat
completion (as llama.cpp's server does it).

The request becomes a chat request (``system`` the system message; a user message's
``tool_result`` blocks ``tool`` messages before its text; an assistant message's ``tool_use``
blocks its ``tool_calls``; ``stop_sequences`` stop; ``tool_choice`` auto / any / tool / none
as auto / required / named / none) and goes through the chat endpoint's checks, template,
tool parser and constraints (``chat.prepare_chat_as``). The answer is a message of ``text``
and ``tool_use`` blocks with Anthropic's stop reasons, streamed as its events
(``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``). Errors on these paths use Anthropic's envelope (``errors.py``).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response

from conveyor.engine.async_engine import RequestStream
from conveyor.outputs import CompletionOutput, RequestOutput
from conveyor.server.chat import (
    can_budget_thinking,
    chat_request_of,
    prepare_chat_as,
    render_prompt,
    template_kwargs,
)
from conveyor.server.common import (
    EngineStreamingResponse,
    ServerState,
    collect,
    submit,
    unless_disconnected,
)
from conveyor.server.errors import (
    APIError,
    anthropic_error_body,
    bad_request,
    request_id_of,
    to_api_error,
)
from conveyor.server.output_plan import OutputPlan
from conveyor.server.protocol import (
    AnthropicBlock,
    AnthropicMessage,
    AnthropicTextBlock,
    AnthropicTextOut,
    AnthropicThinkingOut,
    AnthropicToolUseOut,
    AnthropicUsage,
    CountTokensRequest,
    CountTokensResponse,
    DeltaToolCall,
    MessagesRequest,
    MessagesResponse,
)

# A chat field's errors, named as the Messages request names what it came from.
_PARAMS = {"stop": "stop_sequences"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Claude Code's first system line, whose cch= value changes with every request
_BILLING_HEADER = "x-anthropic-billing-header:"
_BILLING_STAMP = re.compile(r"(\bcch=)[^;\s]*")
_INPUT_TOKENS = re.compile(r"has (\d+) input tokens")  # (check_context's message)
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


async def create_message(state: ServerState, req: MessagesRequest,
                         raw: Request) -> Response | MessagesResponse:
    chat_req = chat_request_of({**_chat_body(req), **_thinking(state, req)}, _PARAMS)
    try:
        chat = await prepare_chat_as(state, chat_req, _PARAMS)
    except APIError as e:
        if e.code == "context_length_exceeded":  # the wording Anthropic's clients parse
            found = _INPUT_TOKENS.search(e.message)
            tokens = f"{found.group(1)} tokens > " if found else ""
            raise bad_request(f"prompt is too long: {tokens}{state.engine.max_model_len} "
                              "maximum", "messages") from None
        raise
    # max_tokens past the context left is capped to it, as llama.cpp does (Claude Code asks
    # 32,000 whatever the model); under 1 is a 400
    params = chat.params.replace(max_tokens=req.max_tokens)
    message_id = f"msg_{request_id_of(raw)}"
    streams = await submit(state, [chat.ids], params, message_id, chat_req)
    if req.stream:
        events = _MessageEvents(message_id, state.model_name, chat.plan)
        return EngineStreamingResponse(events.sse(streams[0], request_id_of(raw)), streams)
    final = await unless_disconnected(raw, collect(streams[0]), streams)
    c = final.outputs[0]
    if c.finish_reason == "error":  # its grammar failed: Anthropic has no such stop reason
        raise bad_request(c.error or "the request failed while generating", "messages")
    thinking, content, calls = chat.plan.parse(c.text)
    blocks: list[AnthropicThinkingOut | AnthropicTextOut | AnthropicToolUseOut] = \
        [AnthropicThinkingOut(thinking=thinking)] if thinking is not None else []
    blocks += [AnthropicTextOut(text=content or "")] if content or not calls else []
    blocks += [AnthropicToolUseOut(id=call.id, name=call.name, input=_input(call.arguments))
               for call in calls]
    stop_reason, stop_sequence = _stop(c, bool(calls))
    return MessagesResponse(id=message_id, model=state.model_name, content=blocks,
                            stop_reason=stop_reason, stop_sequence=stop_sequence,
                            usage=_usage(final))


async def count_tokens(state: ServerState, req: CountTokensRequest) -> CountTokensResponse:
    """The prompt's tokens as /v1/messages would render it (its tools included)."""
    chat_req = chat_request_of({**_chat_body(req), **_thinking(state, req)}, _PARAMS)
    tools = [t.model_dump(exclude_none=True) for t in chat_req.tools] if chat_req.tools \
        else None
    ids = await asyncio.to_thread(render_prompt, state, chat_req.messages,
                                  chat_req.add_generation_prompt, template_kwargs(chat_req),
                                  tools, chat_req.continue_final_message)
    return CountTokensResponse(input_tokens=len(ids))


def _thinking(state: ServerState, req: CountTokensRequest) -> dict[str, Any]:
    """Anthropic's `thinking` in the chat's terms: "disabled" asks the template not to
    think (Qwen3's reads enable_thinking; others ignore it); "enabled" with budget_tokens
    bounds the thinking where the server can (thinking_token_budget); else ignored."""
    thinking = req.thinking or {}
    if thinking.get("type") == "disabled":
        kwargs = (req.model_extra or {}).get("chat_template_kwargs") or {}
        return {"chat_template_kwargs": {"enable_thinking": False, **kwargs}} \
            if isinstance(kwargs, dict) else {}  # (not a dict: the chat request's 400)
    budget = thinking.get("budget_tokens")
    if thinking.get("type") == "enabled" and isinstance(budget, int) and \
            not isinstance(budget, bool) and can_budget_thinking(state):
        return {"thinking_token_budget": budget}
    return {}


def _chat_body(req: CountTokensRequest) -> dict[str, Any]:
    """The chat request's body: Anthropic's fields in the chat endpoint's names."""
    messages = _messages(req)
    # Any model name: Claude Code sends its own (a second one for background work), and one
    # model is served (llama.cpp's server takes any too)
    body: dict[str, Any] = {**(req.model_extra or {}), "model": None, "messages": messages}
    last = messages[-1] if messages else {}
    if last.get("role") == "assistant" and last.get("content") and not last.get("tool_calls"):
        # a prefill: the model continues the assistant's words (Anthropic's rule)
        body.update(add_generation_prompt=False, continue_final_message=True)
    if req.tools:
        body["tools"] = [_chat_tool(i, t.model_dump(exclude_none=True))
                         for i, t in enumerate(req.tools)]
    choice = req.tool_choice
    if choice is not None:
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if choice.type == "tool":
            if not choice.name:
                raise bad_request('tool_choice of type "tool" needs a name', "tool_choice")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = _TOOL_CHOICES[choice.type]
    if isinstance(req, MessagesRequest):  # (max_tokens: see create_message)
        body.update(stop=req.stop_sequences, stream=req.stream,
                    temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    user=(req.metadata or {}).get("user_id"))
    return body


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom"):
        raise bad_request(f"tools[{i}]: only client tools (name, description, input_schema) "
                          f"are supported, got type {tool['type']!r}", "tools")
    return {"type": "function", "function": {
        "name": tool["name"], "description": tool.get("description"),
        "parameters": tool.get("input_schema") or {"type": "object"}}}


def _messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation in chat messages: the system prompt first, consecutive messages of
    one role as one turn (Anthropic's rule)."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _system(req.system)})
    for role, blocks in _turns(req.messages):
        texts, calls, results, thoughts = [], [], [], []
        for where, block in blocks:
            if block.type == "text":
                texts.append(block.text or "")
            elif block.type == "thinking" and role == "assistant" and block.thinking:
                thoughts.append(block.thinking)  # for templates that show earlier thinking
            elif block.type == "tool_use" and role == "assistant":
                calls.append(_tool_call(block, where))
            elif block.type == "tool_result" and role == "user":
                text = _joined(block.content or "", where)
                results.append({"role": "tool", "tool_call_id": _needs(block.tool_use_id, where,
                                                                       "tool_use_id"),
                                "content": f"Error: {text}" if block.is_error else text})
            elif block.type not in ("thinking", "redacted_thinking"):
                raise bad_request(f"{where}: a {role} message's {block.type!r} block is not "
                                  "supported (text, tool_use in assistant messages, "
                                  "tool_result in user messages)", "messages")
        messages += results  # a tool's answer comes before the user's words that follow it
        if texts or calls:  # (an empty text stays a text: the turn is rendered, empty)
            turn: dict[str, Any] = {"role": role, "content": "\n".join(texts) if texts else None}
            if thoughts:
                turn["reasoning_content"] = "\n".join(thoughts)
            messages.append({**turn, "tool_calls": calls} if calls else turn)
    return messages


def _turns(messages: list[AnthropicMessage]
           ) -> list[tuple[str, list[tuple[str, AnthropicBlock]]]]:
    """(role, [(where, block)]) per turn: consecutive messages of one role joined, a string
    content as one text block."""
    turns: list[tuple[str, list[tuple[str, AnthropicBlock]]]] = []
    for i, message in enumerate(messages):
        content = message.content
        blocks = [(f"messages[{i}]", AnthropicBlock(type="text", text=content))] \
            if isinstance(content, str) else \
            [(f"messages[{i}].content[{j}]", block) for j, block in enumerate(content)]
        if turns and turns[-1][0] == message.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((message.role, blocks))
    return turns


def _system(system: str | list[AnthropicTextBlock]) -> str:
    """The system prompt; Claude Code's billing line has its per-request stamp (`cch=`)
    made constant, so the prompt's KV stays in the prefix cache (as llama.cpp does)."""
    text = _joined(system, "system")
    return _BILLING_STAMP.sub(r"\1fffff", text) if text.startswith(_BILLING_HEADER) else text


def _tool_call(block: AnthropicBlock, where: str) -> dict[str, Any]:
    return {"id": _needs(block.id, where, "id"), "type": "function",
            "function": {"name": _needs(block.name, where, "name"),
                         "arguments": json.dumps(block.input or {}, ensure_ascii=False)}}


def _needs(value: str | None, where: str, name: str) -> str:
    if not value:
        raise bad_request(f"{where}.{name} is required", "messages")
    return value


def _joined(content: str | list[AnthropicTextBlock], where: str) -> str:
    if isinstance(content, str):
        return content
    for block in content:
        if block.type != "text" or block.text is None:
            raise bad_request(f"{where}: only text blocks are supported, got {block.type!r}",
                              "system" if where == "system" else "messages")
    return "\n".join(block.text or "" for block in content)  # (as chat joins its parts)


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object tool_use carries ({} when cut short or not JSON)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(c: CompletionOutput, made_calls: bool) -> tuple[StopReason, str | None]:
    """Anthropic's stop_reason (and the stop sequence met) for a finished output."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _usage(final: RequestOutput) -> AnthropicUsage:
    cached = final.num_cached_tokens
    return AnthropicUsage(input_tokens=len(final.prompt_token_ids) - cached,
                          output_tokens=final.metrics.num_generation_tokens,
                          cache_read_input_tokens=cached)


@dataclass
class _MessageEvents:
    """One streamed message: its events, each content block started and stopped."""

    message_id: str
    model: str
    plan: OutputPlan
    blocks: int = 0  # blocks started
    open_kind: str | None = None  # the last block's, "thinking" or "text", while it is open
    answered: bool = False  # a text or tool_use block was sent
    calls: dict[int, int] = field(default_factory=dict)  # a call's index -> its block
    made_calls: bool = False

    @staticmethod
    def event(kind: str, **payload: Any) -> str:
        data = json.dumps({"type": kind, **payload}, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"

    async def sse(self, stream: RequestStream, request_id: str) -> AsyncIterator[str]:
        """The stream's events; an error under way ends it with an `error` event."""
        final = None
        try:
            choice = self.plan.choice_stream()
            async for output in stream:
                if final is None:
                    yield self._start(output)
                final = output
                chunk = choice.next_chunk(output.outputs[0], 0)
                if chunk is not None:
                    delta = chunk.delta
                    for event in self._chunk(delta.reasoning, delta.content,
                                             delta.tool_calls or []):
                        yield event
        except Exception as e:
            error = to_api_error(e, request_id)
            yield self.event("error", error=anthropic_error_body(error)["error"])
            return
        assert final is not None
        c = final.outputs[0]
        if c.finish_reason == "error":  # its grammar failed (create_message's 400, streamed)
            yield self.event("error", error=anthropic_error_body(bad_request(
                c.error or "the request failed while generating"))["error"])
            return
        for event in self._close(final):
            yield event

    def _start(self, first: RequestOutput) -> str:
        usage = AnthropicUsage(input_tokens=len(first.prompt_token_ids) - first.num_cached_tokens,
                               output_tokens=0, cache_read_input_tokens=first.num_cached_tokens)
        return self.event("message_start", message={
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage.model_dump()})

    def _chunk(self, thinking: str | None, text: str | None, calls: list[DeltaToolCall]
               ) -> Iterator[str]:
        if thinking:
            yield from self._text("thinking", thinking)
        if text:
            yield from self._text("text", text)
        for delta in calls:
            if delta.index not in self.calls:
                yield from self._stop_open()
                name = delta.function.name if delta.function is not None else None
                yield from self._open({"type": "tool_use", "id": delta.id or "",
                                       "name": name or "", "input": {}})
                self.calls[delta.index] = self.blocks - 1
                self.made_calls = self.answered = True
            piece = (delta.function.arguments or "") if delta.function else ""
            if piece:
                yield self.event("content_block_delta", index=self.calls[delta.index],
                                 delta={"type": "input_json_delta", "partial_json": piece})

    def _text(self, kind: str, text: str) -> Iterator[str]:
        """``text`` in the open block of its ``kind`` ("thinking" or "text"), opened first
        if the last block is another."""
        if self.open_kind != kind:
            yield from self._stop_open()
            block = {"type": kind, kind: ""}
            yield from self._open({**block, "signature": ""} if kind == "thinking" else block)
            self.open_kind = kind
            self.answered = self.answered or kind == "text"
        yield self.event("content_block_delta", index=self.blocks - 1,
                         delta={"type": f"{kind}_delta", kind: text})

    def _open(self, block: dict[str, Any]) -> Iterator[str]:
        if self.calls and self.blocks - 1 in self.calls.values():  # the call before ends
            yield self.event("content_block_stop", index=self.blocks - 1)
        yield self.event("content_block_start", index=self.blocks, content_block=block)
        self.blocks += 1

    def _stop_open(self) -> Iterator[str]:
        if self.open_kind is not None:
            self.open_kind = None
            yield self.event("content_block_stop", index=self.blocks - 1)

    def _close(self, final: RequestOutput) -> Iterator[str]:
        """The last block stopped, then the message's stop reason, usage and end."""
        if not self.answered:  # no text at all: an empty text block, as a whole answer has
            yield from self._stop_open()
            yield from self._open({"type": "text", "text": ""})
            self.open_kind = "text"
        if self.open_kind is not None:
            yield from self._stop_open()
        else:
            yield self.event("content_block_stop", index=self.blocks - 1)
        stop_reason, stop_sequence = _stop(final.outputs[0], self.made_calls)
        yield self.event("message_delta",
                         delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                         usage={"output_tokens": final.metrics.num_generation_tokens})
        yield self.event("message_stop")

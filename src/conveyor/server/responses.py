"""POST /v1/responses: OpenAI's Responses API, stateless, run as a chat completion.

The request becomes a chat request (``instructions`` the system message, ``input`` the
conversation: messages, earlier function calls and their outputs; ``text.format`` the
response_format; ``tools`` the functions; ``max_output_tokens`` max_tokens; fields it does
not name, vLLM's sampling extras, passed on) and goes through the chat endpoint's checks,
template, tool parser and constraints (``chat.prepare_chat``). The answer is a response
object: a message item with the text, then a function_call item per call; streamed as the
API's typed events (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``). Nothing is stored: ``previous_response_id`` and ``background`` are
400s (send the whole conversation in ``input``), ``store`` is answered false.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from conveyor.engine.async_engine import RequestStream
from conveyor.outputs import RequestOutput
from conveyor.server.chat import PreparedChat, chat_request_of, prepare_chat_as
from conveyor.server.common import (
    EngineStreamingResponse,
    ServerState,
    collect,
    submit,
    unless_disconnected,
)
from conveyor.server.errors import bad_request, request_id_of, to_api_error
from conveyor.server.output_plan import ChoiceStream, OutputPlan
from conveyor.server.protocol import (
    ChatCompletionRequest,
    DeltaToolCall,
    ResponseError,
    ResponseFunctionCall,
    ResponseIncompleteDetails,
    ResponseInputTokensDetails,
    ResponseObject,
    ResponseOutputItem,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseOutputTokensDetails,
    ResponseReasoningItem,
    ResponseReasoningText,
    ResponsesContentPart,
    ResponsesRequest,
    ResponseUsage,
)

# A chat field's errors, named as the Responses request names what it came from.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "tools": "tools", "tool_choice": "tool_choice",
           "reasoning_effort": "reasoning.effort"}
_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text")
ItemStatus = Literal["in_progress", "completed", "incomplete"]


async def create_response(state: ServerState, req: ResponsesRequest,
                          raw: Request) -> Response | ResponseObject:
    _check_supported(req)
    chat_req = _chat_request(req)
    chat = await prepare_chat_as(state, chat_req, _PARAMS)
    response_id = f"resp_{request_id_of(raw)}"
    streams = await submit(state, [chat.ids], chat.params, response_id, chat_req)
    echo = _echo(req, response_id, state.model_name)
    if req.stream:
        events = _ResponseEvents(echo, chat.plan)
        return EngineStreamingResponse(events.sse(streams[0], request_id_of(raw)), streams)
    final = await unless_disconnected(raw, collect(streams[0]), streams)
    c = final.outputs[0]
    return _finished(echo, final, _output_items(final, chat),
                     chat.plan.reasoning_tokens(c.token_ids, c.text))


def _check_supported(req: ResponsesRequest) -> None:
    """400s for what a stateless server cannot do, naming the field."""
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: this server stores no "
                          "responses; send the whole conversation in input",
                          "previous_response_id")
    if req.background:
        raise bad_request("background responses are not supported", "background")
    if req.truncation == "auto":
        raise bad_request('truncation "auto" is not supported; a conversation too long for '
                          "the context is a 400", "truncation")
    if req.top_logprobs:
        raise bad_request("logprobs are not supported on /v1/responses (use "
                          "/v1/chat/completions)", "top_logprobs")
    if "message.output_text.logprobs" in (req.include or []):
        raise bad_request("logprobs are not supported on /v1/responses (use "
                          "/v1/chat/completions)", "include")
    for name in ("conversation", "prompt"):  # a stored conversation, a stored prompt
        if (req.model_extra or {}).get(name) is not None:
            raise bad_request(f"{name} is not supported: this server stores no "
                              "conversations or prompts; send the whole conversation in input",
                              name)


def _chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request the response runs as; 400 naming the Responses field."""
    body: dict[str, Any] = {
        **(req.model_extra or {}), "model": req.model, "messages": _messages(req),
        "max_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "stream": req.stream, "user": req.user,
        "parallel_tool_calls": req.parallel_tool_calls,
        "tools": [_chat_tool(i, t.model_dump(exclude_none=True))
                  for i, t in enumerate(req.tools)] if req.tools else None,
        "tool_choice": req.tool_choice if isinstance(req.tool_choice, str | None)
        else {"type": "function", "function": {"name": req.tool_choice.name}},
        "response_format": _response_format(req),
        "reasoning_effort": (req.reasoning or {}).get("effort"),
    }
    return chat_request_of(body, _PARAMS)


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool["type"] != "function" or not tool.get("name"):
        raise bad_request(f"tools[{i}]: only function tools (type \"function\" with a name) "
                          f"are supported, got type {tool['type']!r}", "tools")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    if fmt.schema_ is None:
        raise bad_request("text.format.schema is required with type json_schema", "text.format")
    return {"type": "json_schema", "json_schema": fmt.model_dump(by_alias=True,
                                                                 exclude={"type"})}


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation in chat messages: the instructions first, as the system message."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        kind = item.type or ("message" if item.role else None)
        last = messages[-1] if messages else None
        if kind == "message" and item.role is not None:
            text = _text(item.content, i, "content")
            if item.role == "assistant" and last is not None and last["role"] == "assistant" \
                    and last["content"] is None and not last.get("tool_calls"):
                last["content"] = text  # the answer after its thinking
            else:
                messages.append({"role": item.role, "content": text})
        elif kind == "function_call":
            call = {"id": _required(item.call_id, i, "call_id"), "type": "function",
                    "function": {"name": _required(item.name, i, "name"),
                                 "arguments": _required(item.arguments, i, "arguments")}}
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the same turn's
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _required(item.call_id, i,
                                                                       "call_id"),
                             "content": _text(item.output, i, "output")})
        elif kind == "reasoning":  # an earlier answer's thinking, for templates that show it
            if thought := _text(item.content, i, "content"):
                messages.append({"role": "assistant", "content": None,
                                 "reasoning_content": thought})
        else:
            raise bad_request(f"input[{i}]: type {kind!r} is not supported (message, "
                              "function_call, function_call_output; a message needs a role)",
                              "input")
    return messages


def _required(value: str | None, i: int, name: str) -> str:
    if value is None:
        raise bad_request(f"input[{i}].{name} is required", "input")
    return value


def _text(content: str | list[ResponsesContentPart] | None, i: int, name: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type not in _TEXT_PARTS or part.text is None:
            raise bad_request(f"input[{i}].{name}: only text parts are supported, got type "
                              f"{part.type!r}", "input")
    return "\n".join(part.text or "" for part in content)  # (as chat joins its parts)


def _echo(req: ResponsesRequest, response_id: str, model: str) -> ResponseObject:
    """The response in progress: the request's settings, no output yet."""
    return ResponseObject(
        id=response_id, status="in_progress", model=model, instructions=req.instructions,
        max_output_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
        tool_choice=req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel)
        else req.tool_choice or "auto",
        parallel_tool_calls=req.parallel_tool_calls, text={"format": _format_echo(req)},
        metadata=req.metadata or {}, user=req.user, reasoning=req.reasoning)


def _format_echo(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return {"type": fmt.type if fmt is not None else "text"}
    return fmt.model_dump(by_alias=True, exclude_none=True)


def _output_items(final: RequestOutput, chat: PreparedChat
                  ) -> list[ResponseOutputItem]:
    """A non-streamed answer's items: its thinking, its text as a message, its calls."""
    c = final.outputs[0]
    plan = chat.plan
    thinking, content, calls = plan.parse(c.text)
    status: ItemStatus = "completed" if c.finish_reason in ("stop", None) else "incomplete"
    items: list[ResponseOutputItem] = []
    if thinking is not None:  # done once the answer began (the stream closes it then)
        items.append(ResponseReasoningItem(id=_item_id("rs"),
                                           status="completed" if content or calls else status,
                                           content=[ResponseReasoningText(text=thinking)]))
    if content or not calls:
        items.append(ResponseOutputMessage(id=_item_id("msg"), status=status,
                                           content=[ResponseOutputText(text=content or "")]))
    items += [ResponseFunctionCall(id=_item_id("fc"), call_id=call.id, name=call.name,
                                   arguments=call.arguments, status=status) for call in calls]
    return items


_TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


def _text_part(item: ResponseReasoningItem | ResponseOutputMessage, text: str
               ) -> ResponseOutputText | ResponseReasoningText:
    return ResponseOutputText(text=text) if isinstance(item, ResponseOutputMessage) else \
        ResponseReasoningText(text=text)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _finished(echo: ResponseObject, final: RequestOutput, output: list[ResponseOutputItem],
              reasoning_tokens: int) -> ResponseObject:
    """The response once its request ended: status, usage, why it is incomplete or failed."""
    c = final.outputs[0]
    prompt, generated = len(final.prompt_token_ids), final.metrics.num_generation_tokens
    usage = ResponseUsage(input_tokens=prompt, output_tokens=generated,
                          total_tokens=prompt + generated,
                          input_tokens_details=ResponseInputTokensDetails(
                              cached_tokens=final.num_cached_tokens),
                          output_tokens_details=ResponseOutputTokensDetails(
                              reasoning_tokens=reasoning_tokens))
    update: dict[str, Any] = {"status": "completed", "output": output, "usage": usage}
    if c.finish_reason == "length":
        update.update(status="incomplete",
                      incomplete_details=ResponseIncompleteDetails(reason="max_output_tokens"))
    elif c.finish_reason == "error":
        update.update(status="failed", error=ResponseError(
            code="server_error", message=c.error or "the request failed"))
    return echo.model_copy(update=update)


@dataclass
class _ResponseEvents:
    """One streamed response: its typed events, numbered, each item opened and closed."""

    echo: ResponseObject
    plan: OutputPlan
    sequence: int = 0
    items: list[ResponseOutputItem] = field(default_factory=list)
    writing: ResponseReasoningItem | ResponseOutputMessage | None = None  # its text open
    text: str = ""  # its text so far
    calls: dict[int, ResponseFunctionCall] = field(default_factory=dict)  # by the call's index
    open_call: ResponseFunctionCall | None = None  # the call being written
    choice: ChoiceStream | None = None  # what the output has streamed (its whole text)

    def event(self, kind: str, **payload: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence,  # (the keys of a whole body)
                **{k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v
                   for k, v in payload.items()}}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    async def sse(self, stream: RequestStream, request_id: str) -> AsyncIterator[str]:
        """The stream's events; an error under way ends it with an `error` event."""
        yield self.event("response.created", response=self.echo)
        yield self.event("response.in_progress", response=self.echo)
        try:
            final = None
            choice = self.choice = self.plan.choice_stream()
            async for output in stream:
                final = output
                for c in output.outputs:
                    chunk = choice.next_chunk(c, 0)
                    if chunk is not None:
                        for event in self._chunk(chunk.delta.reasoning, chunk.delta.content,
                                                 chunk.delta.tool_calls or []):
                            yield event
        except Exception as e:
            error = to_api_error(e, request_id)
            yield self.event("error", code=error.code or error.type, message=error.message,
                             param=error.param)
            for event in self._fail(error.message):
                yield event
            return
        assert final is not None
        for event in self._close(final):
            yield event

    def _fail(self, message: str) -> Iterator[str]:
        """The items under way done as incomplete, then the response failed (every stream
        ends with completed, incomplete or failed: clients wait for one)."""
        yield from self._close_items("incomplete")
        yield self.event("response.failed", response=self.echo.model_copy(update={
            "status": "failed", "output": self.items,
            "error": ResponseError(code="server_error", message=message)}))

    def _chunk(self, thinking: str | None, text: str | None, calls: list[DeltaToolCall]
               ) -> Iterator[str]:
        for kind, piece in (("reasoning", thinking), ("message", text)):
            if not piece:
                continue
            if self.writing is None or self.writing.type != kind:
                yield from self._close_items("completed")
                yield from self._open_text(kind)
            item = self.writing
            assert item is not None
            self.text += piece
            extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
            yield self.event(_TEXT_EVENTS[kind] + ".delta", item_id=item.id,
                             output_index=self.items.index(item), content_index=0,
                             delta=piece, **extra)
        for delta in calls:
            call = self.calls.get(delta.index)
            if call is None:  # the items before it are whole: each is done before the next
                yield from self._close_items("completed")
                name = delta.function.name if delta.function is not None else None
                call = ResponseFunctionCall(id=_item_id("fc"), call_id=delta.id or "",
                                            name=name or "", arguments="",
                                            status="in_progress")
                self.calls[delta.index] = self.open_call = call
                yield from self._open(call)
            piece = (delta.function.arguments or "") if delta.function else ""
            if piece:
                call.arguments += piece
                yield self.event("response.function_call_arguments.delta", item_id=call.id,
                                 output_index=self.items.index(call), delta=piece)

    def _open_text(self, kind: str) -> Iterator[str]:
        """Opens a text item (``self.writing``), a message or the thinking, and its part."""
        self.writing = item = ResponseOutputMessage(
            id=_item_id("msg"), status="in_progress", content=[]) if kind == "message" else \
            ResponseReasoningItem(id=_item_id("rs"), status="in_progress", content=[])
        self.text = ""
        yield from self._open(item)
        yield self._part(item, "response.content_part.added")

    def _part(self, item: ResponseReasoningItem | ResponseOutputMessage, kind: str) -> str:
        return self.event(kind, item_id=item.id, output_index=self.items.index(item),
                          content_index=0, part=_text_part(item, self.text))

    def _open(self, item: ResponseOutputItem) -> Iterator[str]:
        self.items.append(item)
        yield self.event("response.output_item.added", output_index=len(self.items) - 1,
                         item=item.model_copy(deep=True))

    def _close_items(self, status: ItemStatus) -> Iterator[str]:
        """The open text item, or the call being written, done with ``status``."""
        yield from self._close_text(status)
        call, self.open_call = self.open_call, None
        if call is not None:
            index = self.items.index(call)
            yield self.event("response.function_call_arguments.done", item_id=call.id,
                             output_index=index, arguments=call.arguments)
            call.status = status
            yield self.event("response.output_item.done", output_index=index, item=call)

    def _close_text(self, status: ItemStatus) -> Iterator[str]:
        item, self.writing = self.writing, None
        if item is None:
            return
        index = self.items.index(item)
        extra: dict[str, Any] = {"logprobs": []} if item.type == "message" else {}
        yield self.event(_TEXT_EVENTS[item.type] + ".done", item_id=item.id, output_index=index,
                         content_index=0, text=self.text, **extra)
        yield self._part(item, "response.content_part.done")
        if isinstance(item, ResponseOutputMessage):
            item.content = [ResponseOutputText(text=self.text)]
        else:
            item.content = [ResponseReasoningText(text=self.text)]
        item.status = status
        yield self.event("response.output_item.done", output_index=index, item=item)

    def _close(self, final: RequestOutput) -> Iterator[str]:
        """Every open item closed, then the response's last event."""
        status: ItemStatus = "completed" if final.outputs[0].finish_reason in ("stop", None) \
            else "incomplete"
        if not self.calls and not any(isinstance(i, ResponseOutputMessage) for i in self.items):
            yield from self._close_items(status)  # no answer at all (thinking, perhaps): an
            yield from self._open_text("message")  # empty message, as a whole answer has
        yield from self._close_items(status)
        streamed = self.choice
        response = _finished(self.echo, final, self.items, self.plan.reasoning_tokens(
            streamed.token_ids, streamed.output_text) if streamed is not None else 0)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed"}[response.status]
        yield self.event(kind, response=response)


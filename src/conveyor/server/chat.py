"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from conveyor.engine.async_engine import RequestStream
from conveyor.outputs import CompletionOutput
from conveyor.sampling_params import MAX_LOGPROBS
from conveyor.server.common import (
    EngineStreamingResponse,
    ServerState,
    bad_request,
    check_context,
    check_model,
    collect,
    on_stream_error,
    sampling_params,
    sse,
    stream_usage,
    submit,
    unless_disconnected,
    usage,
)
from conveyor.server.errors import request_id_of
from conveyor.server.logprobs import chat_logprobs
from conveyor.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaMessage,
)

# Names render_chat_template binds itself: chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "bos_token",
                                       "eos_token", "source"})

# How errors about the rendered conversation name it (positions count in the rendered text).
_RENDERED = "messages, rendered by the chat template,"


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text content parts joined into a string."""
    result = []
    for i, message in enumerate(messages):
        data = message.model_dump(exclude_none=True)
        if data.get("tool_calls"):  # the request's `tools` are refused too (a later issue)
            raise bad_request(f"messages[{i}]: assistant turns with tool_calls are not "
                              "supported yet", "messages")
        if isinstance(message.content, list):
            texts = []
            for part in message.content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content: only text parts are supported, "
                                      f"got type {part.type!r}", "messages")
                texts.append(part.text)
            data["content"] = "\n".join(texts)
        result.append(data)
    return result


def render_prompt(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                  template_kwargs: dict[str, Any] | None) -> list[int]:
    """Token ids of the rendered conversation (the template adds any special tokens).

    Whatever is wrong with the messages (the template refuses them, the text is not valid
    Unicode or too long to fit) is a 400 on `messages`.
    """
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so no chat template", "messages")
    kwargs = {k: v for k, v in (template_kwargs or {}).items()
              if k not in _RESERVED_TEMPLATE_KWARGS}
    try:
        text = tokenizer.apply_chat_template(template_messages(messages),
                                             add_generation_prompt, **kwargs)
        state.engine.check_prompt_chars(text, _RENDERED)
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False, field=_RENDERED)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    return ids


def _check_request(req: ChatCompletionRequest) -> int | None:
    """The engine's logprobs count (None: no logprobs); 400 for what is not supported."""
    if req.tools:
        raise bad_request("tools are not supported", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request("only response_format {\"type\": \"text\"} is supported",
                          "response_format")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                              f"{req.top_logprobs}", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest,
                                 raw: Request) -> Response | ChatCompletionResponse:
    check_model(state, req.model)
    num_logprobs = _check_request(req)
    include_usage = stream_usage(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    params = sampling_params(req, max_tokens, num_logprobs)
    ids = await asyncio.to_thread(render_prompt, state, req.messages, req.add_generation_prompt,
                                  req.chat_template_kwargs)
    check_context(state, len(ids), max_tokens, "messages")
    request_id = f"chatcmpl-{request_id_of(raw)}"
    streams = await submit(state, [ids], params, request_id, req)
    num_top = req.top_logprobs or 0
    if req.stream:
        return EngineStreamingResponse(
            on_stream_error(lambda: _stream(state, request_id, streams[0], num_top,
                                            include_usage), request_id_of(raw)), streams)
    final = await unless_disconnected(raw, collect(streams[0]), streams)
    choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                          logprobs=_logprobs(c, 0, num_top), finish_reason=c.finish_reason,
                          stop_reason=c.stop_reason)
               for c in final.outputs]
    return ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices,
                                  usage=usage([final]))


def _logprobs(c: CompletionOutput, first_token: int, num_top: int) -> ChatLogprobs | None:
    if c.logprobs is None:
        return None
    return chat_logprobs(c.token_ids[first_token:], c.logprobs[first_token:], num_top)


async def _stream(state: ServerState, request_id: str, stream: RequestStream, num_top: int,
                  include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())
    sent_chars: dict[int, int] = {}  # choice index -> text already streamed
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()

    def chunk(choice: ChatChunkChoice) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=state.model_name,
                                       choices=[choice]).model_dump_json())

    final = None
    async for output in stream:
        final = output
        for c in output.outputs:
            if c.index not in sent_chars:  # the role comes first, alone (as OpenAI does)
                sent_chars[c.index] = sent_tokens[c.index] = 0
                yield chunk(ChatChunkChoice(index=c.index,
                                            delta=DeltaMessage(role="assistant", content="")))
            delta = c.text[sent_chars[c.index]:]
            if c.index in done or (not delta and c.finish_reason is None):
                continue
            choice = ChatChunkChoice(index=c.index,
                                     delta=DeltaMessage(content=delta) if delta else DeltaMessage(),
                                     logprobs=_logprobs(c, sent_tokens[c.index], num_top),
                                     finish_reason=c.finish_reason)
            sent_chars[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
            if c.finish_reason is not None:
                done.add(c.index)
            yield chunk(choice)
    if include_usage and final is not None:
        yield sse(ChatCompletionChunk(id=request_id, created=created, model=state.model_name,
                                      choices=[], usage=usage([final])).model_dump_json())

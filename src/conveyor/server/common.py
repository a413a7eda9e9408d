"""What the completion and chat endpoints share: request checks, sampling params, submission,
streaming plumbing and cancellation on disconnect."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from conveyor.engine.async_engine import AsyncEngine, RequestStream
from conveyor.outputs import RequestOutput
from conveyor.sampling_params import (
    ReasoningSection,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from conveyor.server.config import ServerConfig
from conveyor.server.errors import APIError, bad_request, error_body, to_api_error
from conveyor.server.metrics import ServerMetrics
from conveyor.server.protocol import (
    EmbeddingRequest,
    PromptTokensDetails,
    Usage,
    _SamplingFields,
)

T = TypeVar("T")

logger = logging.getLogger(__name__)

# Limits on what one request may ask for (n and logprobs are bounded by SamplingParams; the
# number of messages by protocol.MAX_MESSAGES_PER_REQUEST).
MAX_PROMPTS_PER_REQUEST = 64
# Sequences (prompts x n) one request may ask for: as many as prompts alone, so that `n` does
# not multiply a request past the bound on prompts (64 x MAX_N = 1,024 sequences from one
# request would hold the whole queue; vLLM bounds only n).
MAX_SEQUENCES_PER_REQUEST = MAX_PROMPTS_PER_REQUEST
MAX_STOP_STRINGS = 16


@dataclass
class ServerState:
    """What the endpoints need; one per app (``app.state.server``)."""

    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    config: ServerConfig = ServerConfig()
    # The thinking section the reasoning parser reads (None: none; server/reasoning.py)
    reasoning: ReasoningSection | None = None


def check_model(state: ServerState, model: str | None) -> None:
    names = state.engine.model_names
    if model is not None and model not in names:
        raise APIError(HTTPStatus.NOT_FOUND,
                       f"The model `{model}` does not exist. This server serves "
                       f"{', '.join(f'`{n}`' for n in names)}.", "invalid_request_error",
                       param="model", code="model_not_found")


def sampling_params(req: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                    structured_outputs: StructuredOutputsParams | None = None,
                    defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """SamplingParams from a request; ValueError (-> 400) names the bad field. ``defaults``
    (the model's, ``LLMEngine.default_sampling``) fill what the request does not set (a
    default max_tokens, as any, is capped by the context left, not refused)."""
    check_extra_fields(req)
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs is not supported in a stream", "prompt_logprobs")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    for name, strings in (("stop", stop), ("bad_words", req.bad_words or [])):
        if len(strings) > MAX_STOP_STRINGS:
            raise bad_request(f"{name} may hold at most {MAX_STOP_STRINGS} strings, got "
                              f"{len(strings)}", name)
    values: dict[str, Any] = {
        "n": req.n, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "min_p": req.min_p, "seed": req.seed, "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty, "min_tokens": req.min_tokens,
        "stop_token_ids": req.stop_token_ids, "logit_bias": _token_bias(req.logit_bias),
        "allowed_token_ids": req.allowed_token_ids, "bad_words": req.bad_words,
        "prompt_logprobs": req.prompt_logprobs, "max_tokens": max_tokens,
    }
    values = {"max_tokens": None, **(defaults or {}),
              **{k: v for k, v in values.items() if v is not None}}
    return SamplingParams(**values, stop=tuple(stop),
                          ignore_eos=req.ignore_eos, logprobs=logprobs,
                          skip_special_tokens=req.skip_special_tokens,
                          include_stop_str_in_output=req.include_stop_str_in_output,
                          structured_outputs=structured_outputs,
                          output_kind=RequestOutputKind.DELTA)


def _token_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, keyed by token ids written as strings; None when empty."""
    if not logit_bias:
        return None
    try:
        return {int(token): bias for token, bias in logit_bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers, as strings), got "
                          f"{list(logit_bias)!r:.80}", "logit_bias") from None


def check_extra_fields(req: _SamplingFields) -> None:
    """A 400 naming a field of ``req.unsupported`` that asks for something; the other fields
    this server does not know are ignored with a warning in the log, as vLLM does."""
    extra = req.model_extra or {}
    for name, value in extra.items():
        if name in req.unsupported and value not in (None, req.unsupported[name], [], {}):
            raise bad_request(f"{name} is not supported by this server", name)
    if ignored := sorted(name for name in extra if name not in req.unsupported):
        shown = ", ".join(repr(name[:40]) for name in ignored[:8])  # a client's text: escaped
        logger.warning("request fields ignored (unknown to this server): %s%s", shown,
                       f" and {len(ignored) - 8} more" if len(ignored) > 8 else "")


def continuous_usage(req: _SamplingFields) -> bool:
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries
    the request's usage so far."""
    return stream_usage(req) and req.stream_options is not None \
        and req.stream_options.continuous_usage_stats


def stream_usage(req: _SamplingFields) -> bool:
    """Whether a stream ends with a usage chunk; stream_options without stream is a 400, as
    in vLLM (the client asked for something it will not get)."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true",
                          "stream_options")
    return req.stream and req.stream_options is not None and req.stream_options.include_usage


PromptInput = str | list[int]


def prompt_list(value: str | list[str] | list[int] | list[list[int]], param: str,
                limit: int, noun: str) -> list[PromptInput]:
    """One prompt or several, text or token ids, as OpenAI's `prompt` and `input` take
    them; a 400 naming ``param`` for none, or more than ``limit`` (``noun``: what they are)."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request(f"{param} must not be empty", param)
    if isinstance(value[0], int):
        return [list(value)]  # type: ignore[arg-type]
    prompts: list[PromptInput] = list(value)  # type: ignore[arg-type]
    if len(prompts) > limit:
        raise bad_request(f"{param} may hold at most {limit} {noun}, got {len(prompts)}",
                          param)
    return prompts


async def tokenize_prompts(state: ServerState, prompts: list[PromptInput], field: str
                           ) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) of each prompt, off the event loop; all are checked before any is
    tokenized (see check_prompt_chars). ValueError naming ``field``."""
    engine = state.engine
    for p in prompts:
        if isinstance(p, str):
            engine.check_prompt_chars(p, field)
        else:  # (the engine would name its own argument, prompt_token_ids)
            engine.check_token_ids(p, field)
    return await asyncio.to_thread(lambda: [engine.tokenize_prompt(p) for p in prompts])


def check_context(state: ServerState, num_input_tokens: int, max_tokens: int | None,
                  prompt_param: str, max_tokens_param: str = "max_tokens",
                  whole_context: bool = False) -> None:
    """OpenAI's (and vLLM's) context-length errors, in the wording clients parse; the
    `param` names the fields the request sent. ``whole_context``: the input may fill the
    context (an embedding's)."""
    limit = state.engine.max_model_len
    if num_input_tokens + (0 if whole_context else 1) > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your request "
            f"has {num_input_tokens} input tokens. Please reduce the length of the input "
            "messages.", prompt_param, "context_length_exceeded")
    if max_tokens is not None and max_tokens > limit - num_input_tokens:
        raise bad_request(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
            f"maximum context length is {limit} tokens and your request has "
            f"{num_input_tokens} input tokens ({max_tokens} > {limit} - {num_input_tokens}).",
            max_tokens_param, "context_length_exceeded")


async def submit(state: ServerState, prompts: list[list[int]], params: SamplingParams,
                 request_id: str, req: _SamplingFields | EmbeddingRequest
                 ) -> list[RequestStream]:
    """Add one engine request per prompt; all or none (a failure aborts the ones added).

    The engine's ids are ``request_id`` (the response's id, from the client's X-Request-Id
    when it sent one), the prompt's index when there are several, and a random suffix, as
    vLLM's are: a client may reuse its id (a retry while the first try is still ending, two
    gateways' ids colliding) without either request failing.
    """
    adds: list[asyncio.Task[RequestStream]] = []
    for i, ids in enumerate(prompts):  # all at once: the engine takes them in one step
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        adds.append(asyncio.create_task(state.engine.add_request(
            ids, params, f"{rid}-{uuid.uuid4().hex[:8]}", req.priority, req.user)))
    try:
        await asyncio.gather(*adds, return_exceptions=True)
    except BaseException:  # cancelled (the adds with it): close what was added
        _close_added(adds)
        raise
    failure = next((e for a in adds if (e := a.exception()) is not None), None)
    if failure is not None:
        _close_added(adds)
        raise failure
    return [a.result() for a in adds]


def _close_added(adds: list[asyncio.Task[RequestStream]]) -> None:
    for add in adds:
        if add.done() and not add.cancelled() and add.exception() is None:
            add.result().close()


def usage(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(o.metrics.num_generation_tokens for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


# ---------------------------------------------------------------------- streaming
def sse(payload: Any) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: BaseException, request_id: str) -> str:
    error = to_api_error(exc, request_id)
    return sse(error_body(error.message, error.type, error.param, error.code))


def sse_failures(finals: list[RequestOutput]) -> str:
    """The error event that ends a stream some of whose choices failed alone (finish_reason
    "error" with a reason: their grammar ran out of fuel), after their last chunks: the
    stream's one place for the reason (a non-streamed answer has only the finish_reason).
    Empty when none did."""
    reasons = [c.error for final in finals for c in final.outputs if c.error is not None]
    if not reasons:
        return ""
    return sse(error_body("; ".join(reasons), "invalid_request_error", None,
                          "structured_output_failed"))


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; errors propagate."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
            queue.put_nowait((i, None))
        except BaseException as e:  # noqa: B036 - handed to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that aborts its engine requests however it ends (even unstarted)."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._engine_streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._engine_streams:
                stream.close()


async def unless_disconnected(request: Request, work: Awaitable[T],
                              streams: list[RequestStream]) -> T:
    """Await `work`; if the client disconnects first, abort its engine requests."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        raise APIError(499, "the client disconnected", code="client_disconnected")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        for stream in streams:
            stream.close()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(stream: RequestStream) -> RequestOutput:
    """The request's whole output: its deltas appended."""
    final: RequestOutput | None = None
    async for output in stream:
        if final is None:
            final = output.copy()
        else:
            final.add(output)
    assert final is not None and final.finished
    return final


def on_stream_error(make_chunks: Callable[[], AsyncIterator[str]],
                    request_id: str) -> AsyncIterator[str]:
    """Chunks from make_chunks(); an error mid-stream becomes an error event, then [DONE]."""

    async def chunks() -> AsyncIterator[str]:
        try:
            async for chunk in make_chunks():
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:
            yield sse_error(e, request_id)
        yield SSE_DONE

    return chunks()

"""POST /v1/completions: one or many prompts, streamed or not, with echo and logprobs."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from conveyor.engine.async_engine import RequestStream
from conveyor.outputs import CompletionOutput, RequestOutput, joined
from conveyor.sampling_params import SamplingParams
from conveyor.server.common import (
    MAX_PROMPTS_PER_REQUEST,
    MAX_SEQUENCES_PER_REQUEST,
    EngineStreamingResponse,
    ServerState,
    bad_request,
    check_context,
    check_model,
    collect,
    continuous_usage,
    merged,
    on_stream_error,
    prompt_list,
    sampling_params,
    sse,
    sse_failures,
    stream_usage,
    submit,
    tokenize_prompts,
    unless_disconnected,
    usage,
)
from conveyor.server.errors import request_id_of
from conveyor.server.logprobs import TextOffsets, completion_logprobs, prompt_logprobs
from conveyor.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from conveyor.server.structured import check_constraint, request_constraint


def _check_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (only best_of == n)", "best_of")
    if req.echo and req.logprobs is not None and req.stream:
        raise bad_request("echo with logprobs is not supported in a stream", "echo")
    if req.max_tokens == 0 and (not req.echo or req.stream):
        raise bad_request("max_tokens must be at least 1 (0 only with echo, not streamed: "
                          "the prompt alone)", "max_tokens")


@dataclass
class _Prepared:
    request_id: str
    params: SamplingParams
    prompt_ids: list[list[int]]
    echo_texts: list[str] = field(default_factory=list)  # per prompt; "" without echo
    include_usage: bool = False  # a stream ends with a usage chunk
    echo_only: bool = False  # echo with max_tokens 0: one token is generated, then dropped
    prompt_logprobs: bool = False  # vLLM's field asked: each choice carries them
    continuous_usage: bool = False  # every chunk carries its prompt's usage so far


async def _prepare(state: ServerState, req: CompletionRequest, request_id: str) -> _Prepared:
    check_model(state, req.model)
    _check_unsupported(req)
    include_usage = stream_usage(req)
    prompts = prompt_list(req.prompt, "prompt", MAX_PROMPTS_PER_REQUEST, "prompts")
    constraint = request_constraint(req)
    echo_only = req.echo and req.max_tokens == 0
    params = sampling_params(req, 1 if echo_only else req.max_tokens, req.logprobs,
                             constraint.params if constraint else None,
                             state.engine.default_sampling)
    if req.echo and req.logprobs is not None:  # the prompt's tokens are scored too
        params = params.replace(prompt_logprobs=max(req.logprobs, req.prompt_logprobs or 0))
    if constraint is not None:
        await check_constraint(state.engine, params, constraint)
    if len(prompts) * params.n > MAX_SEQUENCES_PER_REQUEST:
        raise bad_request(f"a request may ask for at most {MAX_SEQUENCES_PER_REQUEST} "
                          f"sequences (prompts x n), got {len(prompts)} x {params.n}", "n")
    engine = state.engine
    encoded = await tokenize_prompts(state, prompts, "prompt")
    for _, ids in encoded:
        check_context(state, len(ids), req.max_tokens, "prompt")
    echo = [""] * len(encoded)
    if req.echo:
        tokenizer = engine.tokenizer
        echo = [text if text is not None else
                (tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else "")
                for text, ids in encoded]
    return _Prepared(f"cmpl-{request_id}", params, [ids for _, ids in encoded], echo,
                     include_usage, echo_only, req.prompt_logprobs is not None,
                     continuous_usage(req))


async def create_completion(state: ServerState, req: CompletionRequest,
                            raw: Request) -> Response | CompletionResponse:
    prep = await _prepare(state, req, request_id_of(raw))
    streams = await submit(state, prep.prompt_ids, prep.params, prep.request_id, req)
    if req.stream:
        return EngineStreamingResponse(
            on_stream_error(lambda: _stream(state, prep, streams), request_id_of(raw)),
            streams)
    finals = await unless_disconnected(raw, asyncio.gather(*(collect(s) for s in streams)),
                                       streams)
    choices = [_whole_choice(state, prep, i, final, c)
               for i, final in enumerate(finals) for c in final.outputs]
    counted = usage(finals)
    if prep.echo_only:  # the token generated to score the prompt was dropped
        counted.completion_tokens, counted.total_tokens = 0, counted.prompt_tokens
    return CompletionResponse(id=prep.request_id, model=state.model_name, choices=choices,
                              usage=counted)


def _whole_choice(state: ServerState, prep: _Prepared, i: int, final: RequestOutput,
                  c: CompletionOutput) -> CompletionChoice:
    """Choice c of prompt i, not streamed: the echoed prompt (scored, when logprobs are
    asked), then the output."""
    echo = prep.echo_texts[i]
    if prep.echo_only:  # the token generated to score the prompt is not part of the answer
        c = dataclasses.replace(c, text="", token_ids=[], logprobs=c.logprobs and [],
                                finish_reason="length")
    choice = _choice(i * prep.params.n + c.index, c, echo + c.text, len(echo))
    if c.logprobs is not None and final.prompt_logprobs is not None and echo:
        choice.logprobs = echo_logprobs(state, final, c)
    if prep.prompt_logprobs:
        choice.prompt_logprobs = prompt_logprobs(final.prompt_logprobs)
    return choice


def _choice(index: int, c: CompletionOutput, text: str, offset: int) -> CompletionChoice:
    logprobs = None
    if c.logprobs is not None:
        logprobs = completion_logprobs(c.token_ids, c.logprobs, TextOffsets(offset))
    return CompletionChoice(index=index, text=text, logprobs=logprobs,
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason)


def echo_logprobs(state: ServerState, final: RequestOutput,
                  c: CompletionOutput) -> CompletionLogprobs:
    """The prompt's tokens, then choice c's, as OpenAI's legacy API gives them with echo: the
    first token unscored (null), offsets one running total from the prompt's start (over
    the tokens' texts, which may hold a BOS the echoed prompt text does not), as vLLM's."""
    tokenizer = state.engine.tokenizer
    ids = final.prompt_token_ids
    first = tokenizer.decode(ids[:1], skip_special_tokens=False) if tokenizer else ""
    scored = [e for e in (final.prompt_logprobs or [])[1:] if e is not None]
    offsets = TextOffsets(len(first))  # one running count, the prompt's then the answer's
    prompt = completion_logprobs(ids[1:], scored, offsets)
    generated = completion_logprobs(c.token_ids, c.logprobs or [], offsets)
    return CompletionLogprobs(
        text_offset=[0, *prompt.text_offset, *generated.text_offset],
        token_logprobs=[None, *prompt.token_logprobs, *generated.token_logprobs],
        tokens=[first, *prompt.tokens, *generated.tokens],
        top_logprobs=[None, *prompt.top_logprobs, *generated.top_logprobs])


async def _stream(state: ServerState, prep: _Prepared,
                  streams: list[RequestStream]) -> AsyncIterator[str]:
    n = prep.params.n
    num_choices = len(streams) * n
    created = int(time.time())
    offsets = [len(prep.echo_texts[i // n]) for i in range(num_choices)]
    done = [False] * num_choices
    held: dict[int, CompletionOutput] = {}  # deltas with no text yet (a stop string's prefix)
    finals: dict[int, RequestOutput] = {}

    def chunk(choice: CompletionChoice, output: RequestOutput | None = None) -> str:
        so_far = usage([output]) if prep.continuous_usage and output is not None else None
        return sse(CompletionResponse(id=prep.request_id, created=created,
                                      model=state.model_name, choices=[choice],
                                      usage=so_far).model_dump_json())

    for index in range(num_choices):
        echo = prep.echo_texts[index // n]
        if echo:
            yield chunk(CompletionChoice(index=index, text=echo))
    async for i, output in merged(streams):
        if output.finished:
            finals[i] = output
        for c in output.outputs:  # deltas: what is new since the last output
            index = i * n + c.index
            if done[index]:
                continue
            c = joined(held.pop(index, None), c)
            if not c.text and c.finish_reason is None:  # no text to show yet: its tokens'
                held[index] = c  # logprobs wait
                continue
            choice = _choice(index, c, c.text, offsets[index])
            if choice.logprobs is not None:
                offsets[index] += sum(len(t) for t in choice.logprobs.tokens)
            done[index] = c.finish_reason is not None
            yield chunk(choice, output)
    if prep.include_usage:
        yield sse(CompletionResponse(id=prep.request_id, created=created,
                                     model=state.model_name, choices=[],
                                     usage=usage([finals[i] for i in sorted(finals)]))
                  .model_dump_json())
    if failures := sse_failures(list(finals.values())):
        yield failures

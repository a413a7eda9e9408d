"""POST /v1/embeddings: each input's embedding (the last token's final hidden state,
L2-normalized: ``SamplingParams.return_embedding``), as OpenAI's API answers."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from http import HTTPStatus

from fastapi import Request

from conveyor.outputs import RequestOutput
from conveyor.sampling_params import EMBEDDING_PARAMS
from conveyor.server.common import (
    PromptInput,
    ServerState,
    bad_request,
    check_context,
    check_model,
    collect,
    prompt_list,
    submit,
    tokenize_prompts,
    unless_disconnected,
)
from conveyor.server.errors import APIError, request_id_of
from conveyor.server.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)

# As OpenAI's API: inputs per request.
MAX_INPUTS = 2048


async def create_embeddings(state: ServerState, req: EmbeddingRequest,
                            raw: Request) -> EmbeddingResponse:
    check_model(state, req.model)
    inputs = _inputs(req.input)
    if req.dimensions is not None and not 1 <= req.dimensions <= state.engine.hidden_size:
        raise bad_request(f"dimensions must be in [1, {state.engine.hidden_size}] (this "
                          f"model's embedding size), got {req.dimensions}", "dimensions")
    try:
        encoded = await tokenize_prompts(state, inputs, "input")
    except ValueError as e:
        raise bad_request(str(e), "input") from None
    prompts = [ids for _, ids in encoded]
    for ids in prompts:
        check_context(state, len(ids), None, "input", whole_context=True)
    streams = await submit(state, prompts, EMBEDDING_PARAMS, f"embd-{request_id_of(raw)}",
                           req)
    finals = await unless_disconnected(
        raw, asyncio.gather(*(collect(s) for s in streams)), streams)
    data = [EmbeddingData(index=i, embedding=_encoded(_embedding(final), req))
            for i, final in enumerate(finals)]
    tokens = sum(len(ids) for ids in prompts)
    return EmbeddingResponse(data=data, model=state.model_name,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _embedding(final: RequestOutput) -> list[float]:
    """The request's embedding; a 500 when it ended without one (its step failed)."""
    if final.embedding is None:
        why = final.outputs[0].error if final.outputs else None
        raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR,
                       f"the request ended without its embedding: {why or 'it failed'}",
                       "server_error")
    return final.embedding


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[PromptInput]:
    """The inputs one by one (400 when none, or one is empty, as OpenAI's)."""
    items = prompt_list(value, "input", MAX_INPUTS, "inputs")
    for i, item in enumerate(items):
        if len(item) == 0:
            raise bad_request(f"input[{i}] must not be empty", "input")
    return items


def _encoded(vector: list[float], req: EmbeddingRequest) -> list[float] | str:
    """The vector as asked: its first ``dimensions`` components normalized again (a
    Matryoshka-trained model's smaller embedding), as floats or base64."""
    if req.dimensions is not None:
        vector = vector[:req.dimensions]
        norm = math.sqrt(sum(x * x for x in vector)) or 1.0
        vector = [x / norm for x in vector]
    if req.encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector

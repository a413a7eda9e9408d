"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Whatever a client sends maps to a 4xx with a message it can act on, naming the field
(`param`); a 5xx means the server itself is broken (engine dead: 503) or a bug: a 500 whose
body says only "internal error" and the request id (never the exception's text, which may
carry paths or data), its traceback logged once under that id.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.engine.async_engine import (
    EngineDeadError,
    EngineStoppedError,
    QueueFullError,
    RequestFailedError,
)

logger = logging.getLogger(__name__)

# Request fields a ValueError message may start with ("temperature must be ..."): its `param`.
_PARAM_NAMES = frozenset({
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens",
    "logprobs", "top_logprobs", "prompt", "messages", "prompt_token_ids", "tokens", "model",
    "structured_outputs", "response_format", "tools", "tool_choice", "logit_bias",
    "allowed_token_ids", "bad_words", "prompt_logprobs",
})


# The `param` of an error in the body as a whole (not JSON, not UTF-8, not an object).
BODY_PARAM = "body"
_LEADING_NAME = re.compile(r"['\"]?([a-z_]+)")


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# Paths of Anthropic's Messages API (server/messages.py): their errors use its envelope.
ANTHROPIC_PATH_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    """Anthropic's error envelope (its `type` by status; the field named in the message)."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(error.status, "api_error"),
                                       "message": error.message}}


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """The error's response: OpenAI's body, or Anthropic's on its API's paths."""
    body = anthropic_error_body(error) if path.startswith(ANTHROPIC_PATH_PREFIX) else \
        error_body(error.message, error.type, error.param, error.code)
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def internal_error(exc: BaseException, request_id: str) -> APIError:
    """The opaque 500 for an unexpected exception; logs its traceback (the one log of it)."""
    logger.error("internal error (request id %s)", request_id, exc_info=exc)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR,
                    f"internal error (request id {request_id})", "InternalServerError")


def to_api_error(exc: BaseException, request_id: str) -> APIError:
    """The APIError for an exception the engine or the request handling raised."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        match = _LEADING_NAME.match(str(exc))
        name = match.group(1) if match else None
        return bad_request(str(exc), name if name in _PARAM_NAMES else None)
    if isinstance(exc, QueueFullError):
        return APIError(HTTPStatus.TOO_MANY_REQUESTS, str(exc), "rate_limit_error",
                        code="rate_limit_exceeded",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, EngineDeadError):
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "server_error",
                        code="engine_dead")
    if isinstance(exc, EngineStoppedError):
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "server_error",
                        code="shutting_down")
    if isinstance(exc, RequestFailedError):  # the engine logged the step's traceback
        return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, str(exc), "server_error",
                        code="internal_error")
    return internal_error(exc, request_id)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {err.get('msg')}", BODY_PARAM
        where = ".".join(loc) if loc else BODY_PARAM
        param = param or (loc[0] if loc else BODY_PARAM)
        parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(parts[:5]) or "invalid request", param


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = _validation_message(exc)
    return error_response(bad_request(message, param), request.url.path)


def _body_error_message(exc: StarletteHTTPException) -> str:
    """What was wrong with a body FastAPI could not parse (it says only that it could not)."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8: {cause.reason} at byte {cause.start}"
    if isinstance(cause, RecursionError):
        return "the request body nests JSON arrays or objects too deeply"
    return f"the request body could not be read: {exc.detail}"


async def _on_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message, param = str(exc.detail), None
    if exc.status_code == HTTPStatus.BAD_REQUEST:  # only FastAPI's body parsing raises these
        message, param = _body_error_message(exc), BODY_PARAM
    return error_response(APIError(exc.status_code, message, kind, param,
                                   headers=getattr(exc, "headers", None)), request.url.path)


async def _on_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(to_api_error(exc, request_id_of(request)), request.url.path)


# The header that carries a request's id both ways (conveyor.server.app.RequestIds).
REQUEST_ID_HEADER = b"x-request-id"


def request_id_of(request: Request) -> str:
    """The id RequestIds gave this request (its X-Request-Id header)."""
    request_id: str = request.state.request_id
    return request_id


def install_error_handlers(app: FastAPI) -> None:
    """Every expected failure answers in OpenAI's shape; validation failures are 400, not 422.

    `Exception` gets no handler here: Starlette answers one from its outermost middleware and
    then re-raises it, so uvicorn would log the traceback a second time; `RequestIds` answers
    unexpected exceptions instead.
    """
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    for kind in (APIError, ValueError, QueueFullError, EngineDeadError, EngineStoppedError,
                 RequestFailedError):
        app.add_exception_handler(kind, _on_error)

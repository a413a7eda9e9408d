"""The FastAPI app: OpenAI-compatible endpoints plus health, version, tokenizer and metrics."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import conveyor
from conveyor.engine.async_engine import AsyncEngine
from conveyor.server.chat import create_chat_completion, render_prompt
from conveyor.server.common import DEFAULT_MAX_BODY_BYTES, ServerState, check_model
from conveyor.server.completions import create_completion
from conveyor.server.errors import APIError, error_body, install_error_handlers, to_api_error
from conveyor.server.metrics import ServerMetrics
from conveyor.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

# Paths that need the API key when one is set (health, version and metrics stay open).
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/stats")
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


class _BodyTooLarge(StarletteHTTPException):
    """Raised from the body reader; FastAPI re-raises HTTPExceptions, the handler makes a 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                         f"the request body is larger than {limit} bytes")


class LimitsAndAuth:
    """ASGI middleware: the bearer token (--api-key) and the request body size limit."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"].startswith(_PROTECTED_PREFIXES):
            token = headers.get("authorization", "")
            if not hmac.compare_digest(token.encode(), f"Bearer {self.api_key}".encode()):
                await self._reject(send, APIError(
                    HTTPStatus.UNAUTHORIZED, "Incorrect or missing API key: send "
                    "'Authorization: Bearer <key>'.", code="invalid_api_key"))
                return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await self._reject(send, self._too_large())
            return
        if scope["method"] == "POST" and "json" not in headers.get("content-type", ""):
            scope = _as_json(scope)
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge(self.max_body_bytes)
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> APIError:
        return APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                        f"the request body is larger than {self.max_body_bytes} bytes",
                        code="request_too_large")

    async def _reject(self, send: Send, error: APIError) -> None:
        response = JSONResponse(error_body(error.message, error.type, error.param, error.code),
                                status_code=error.status)
        await response({"type": "http"}, _no_receive, send)


def _as_json(scope: Scope) -> Scope:
    """Every POST body here is JSON, whatever the client says (`curl -d` sends form type)."""
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def build_app(engine: AsyncEngine, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              shutdown_timeout_s: float = 30.0) -> FastAPI:
    """The app for one engine; its metrics registry is its own (several apps per process)."""
    metrics = ServerMetrics(engine.model_name, engine.max_model_len)
    engine.listener = metrics.on_step
    state = ServerState(engine, metrics, engine.model_name, api_key, max_body_bytes,
                        shutdown_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown(shutdown_timeout_s)

    app = FastAPI(title="conveyor", version=conveyor.__version__, lifespan=lifespan,
                  responses=_ERRORS)
    app.state.server = state
    install_error_handlers(app)

    app.add_middleware(LimitsAndAuth, api_key=api_key, max_body_bytes=max_body_bytes)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        return await create_completion(state, req, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        return await create_chat_completion(state, req, raw)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.model_name,
                                         max_model_len=engine.max_model_len)])

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return JSONResponse({"status": "ok"})
        error = to_api_error(engine.dead_error or RuntimeError("the engine is not running"))
        return JSONResponse(error_body(error.message, "server_error", None, "engine_dead"),
                            status_code=HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": conveyor.__version__}

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        check_model(state, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(HTTPStatus.BAD_REQUEST, "send exactly one of 'prompt' or 'messages'",
                           param="prompt")
        if req.messages is not None:
            ids = await asyncio.to_thread(render_prompt, state, req.messages,
                                          req.add_generation_prompt, None)
        else:
            if engine.tokenizer is None:
                raise APIError(HTTPStatus.BAD_REQUEST, "this model has no tokenizer")
            ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt,
                                          req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        check_model(state, req.model)
        engine.check_token_ids(req.tokens, "tokens")
        if engine.tokenizer is None:
            raise APIError(HTTPStatus.BAD_REQUEST, "this model has no tokenizer")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """The engine's counters after its latest step (debugging; not part of OpenAI's API)."""
        return {**engine.stats.to_dict(), "num_unfinished_requests": engine.num_unfinished}

"""The FastAPI app: OpenAI-compatible endpoints plus health, version, tokenizer and metrics."""

from __future__ import annotations

import asyncio
import hmac
import re
import uuid
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
from conveyor.engine.async_engine import AsyncEngine, StepListener
from conveyor.engine.stats import EngineStats
from conveyor.outputs import RequestOutput
from conveyor.server.chat import (
    create_chat_completion,
    render_prompt,
    template_flags,
    template_kwargs,
)
from conveyor.server.common import ServerState, check_model
from conveyor.server.completions import create_completion
from conveyor.server.config import ServerConfig
from conveyor.server.embeddings import create_embeddings
from conveyor.server.errors import (
    BODY_PARAM,
    REQUEST_ID_HEADER,
    APIError,
    bad_request,
    error_body,
    error_response,
    install_error_handlers,
    internal_error,
)
from conveyor.server.events import EngineEvents
from conveyor.server.logs import AccessLog
from conveyor.server.messages import count_tokens, create_message
from conveyor.server.metrics import ServerMetrics
from conveyor.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    CountTokensRequest,
    CountTokensResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    MessagesRequest,
    MessagesResponse,
    ModelCard,
    ModelList,
    ResponseObject,
    ResponsesRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from conveyor.server.reasoning import reasoning_section
from conveyor.server.responses import create_response
from conveyor.server.webui import add_web_ui

# Paths that need the API key when one is set (health, version and metrics stay open).
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/stats")
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


class _BodyTooLarge(StarletteHTTPException):
    """Raised from the body reader; FastAPI re-raises HTTPExceptions, the handler makes a 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                         f"the request body is larger than {limit} bytes")


# A client's (or a proxy's) X-Request-Id is used when it is 1-128 visible ASCII characters:
# it then names the request in logs, the response ids and errors, as Ray Serve's proxy and
# vLLM take it; anything else is a 400 naming the header.
_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")


class RequestIds:
    """ASGI middleware, the outermost: a request id on every response (``X-Request-Id``: the
    request's own, else a new one), and any exception the app lets through answered as an
    opaque 500 naming that id.

    The traceback is logged here, once, under the same id; the exception does not go on to
    Starlette's error middleware and uvicorn, which would log it again.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", []) if k.lower() == REQUEST_ID_HEADER),
                     None)
        bad_id = given is not None and not _REQUEST_ID.fullmatch(given)
        request_id = uuid.uuid4().hex if given is None or bad_id else given.decode("ascii")
        scope = {**scope, "state": {**scope.get("state", {}), "request_id": request_id}}
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [*message.get("headers", []),
                           (REQUEST_ID_HEADER, request_id.encode("ascii"))]
                message = {**message, "headers": headers}
            await send(message)

        try:
            if bad_id:
                await error_response(bad_request(
                    "the X-Request-Id header must be 1 to 128 visible ASCII characters "
                    "(no spaces)", "x-request-id"), scope["path"])(scope, receive, send_with_id)
                return
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            error = internal_error(exc, request_id)
            if not started:  # else the client sees the connection close mid-body
                await error_response(error, scope["path"])(scope, _no_receive, send_with_id)


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
        raw_headers = scope.get("headers", [])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw_headers}
        if self.api_key is not None and scope["path"].startswith(_PROTECTED_PREFIXES):
            # Two credentials are refused, not resolved: proxies and frameworks disagree on
            # which one counts, so accepting either lets a wrong key through. (Anthropic's
            # clients send theirs as X-Api-Key.)
            tokens = [v if k.lower() == b"authorization" else b"Bearer " + v
                      for k, v in raw_headers if k.lower() in (b"authorization", b"x-api-key")]
            expected = f"Bearer {self.api_key}".encode()
            if len(tokens) != 1 or not hmac.compare_digest(tokens[0], expected):
                await self._reject(send, scope, APIError(
                    HTTPStatus.UNAUTHORIZED, "Incorrect or missing API key: send one "
                    "'Authorization: Bearer <key>' (or 'X-Api-Key: <key>') header.",
                    code="invalid_api_key"))
                return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await self._reject(send, scope, self._too_large())
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
                        param=BODY_PARAM, code="request_too_large")

    async def _reject(self, send: Send, scope: Scope, error: APIError) -> None:
        await error_response(error, scope["path"])({"type": "http"}, _no_receive, send)


def _as_json(scope: Scope) -> Scope:
    """Every POST body here is JSON, whatever the client says (`curl -d` sends form type)."""
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def build_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    """The app for one engine; its metrics registry is its own (several apps per process)."""
    config = config or ServerConfig()
    metrics = ServerMetrics(engine.model_name, engine.max_model_len)
    engine.listener = metrics.on_step
    state = ServerState(engine, metrics, engine.model_name, config,
                        reasoning_section(config.reasoning_parser, engine.tokenizer))
    events = EngineEvents(engine) if config.web_ui else None
    if events is not None:
        engine.listener = _both(metrics.on_step, events.on_step)
        engine.engine.trace_listener = events.on_trace

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        publisher = asyncio.create_task(events.run()) if events is not None else None
        yield
        await engine.shutdown(config.shutdown_timeout)
        if publisher is not None:
            publisher.cancel()

    app = FastAPI(title="conveyor", version=conveyor.__version__, lifespan=lifespan,
                  responses=_ERRORS)
    app.state.server = state
    install_error_handlers(app)

    app.add_middleware(LimitsAndAuth, api_key=config.api_key,
                       max_body_bytes=config.max_request_body_bytes)
    if not config.disable_log_requests:
        app.add_middleware(AccessLog)  # it times the whole request
    app.add_middleware(RequestIds)  # added last: the outermost
    _add_routes(app, state)
    if events is not None:
        add_web_ui(app, engine, events)
    return app


def _both(first: StepListener, second: StepListener) -> StepListener:
    def listener(outputs: list[RequestOutput], stats: EngineStats, now: float) -> None:
        first(outputs, stats, now)
        second(outputs, stats, now)

    return listener


async def _tokenize(state: ServerState, req: TokenizeRequest) -> TokenizeResponse:
    """POST /tokenize: a prompt's token ids, or chat messages' through the template."""
    engine = state.engine
    check_model(state, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(HTTPStatus.BAD_REQUEST, "send exactly one of 'prompt' or 'messages'",
                       param="prompt")
    if req.messages is not None:
        add_generation_prompt, continue_final_message = template_flags(
            req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        ids = await asyncio.to_thread(render_prompt, state, req.messages,
                                      add_generation_prompt, template_kwargs(req), tools,
                                      continue_final_message)
    elif engine.tokenizer is None:
        raise APIError(HTTPStatus.BAD_REQUEST, "this model has no tokenizer", param="prompt")
    elif req.prompt is not None:
        engine.check_prompt_chars(req.prompt, "prompt")  # before tokenizing megabytes
        ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt,
                                      req.add_special_tokens, field="prompt")
    token_strs = [engine.tokenizer.id_to_token(i) for i in ids] \
        if req.return_token_strs and engine.tokenizer is not None else None
    return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                            token_strs=token_strs)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    _add_api_routes(app, state)
    _add_service_routes(app, state)


def _add_api_routes(app: FastAPI, state: ServerState) -> None:
    """The APIs that generate: OpenAI's, Anthropic's Messages."""

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        return await create_completion(state, req, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        return await create_chat_completion(state, req, raw)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse)
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Any:
        return await create_embeddings(state, req, raw)

    @app.post("/v1/responses", response_model=ResponseObject)
    async def responses(req: ResponsesRequest, raw: Request) -> Any:
        return await create_response(state, req, raw)

    @app.post("/v1/messages", response_model=MessagesResponse)
    async def messages(req: MessagesRequest, raw: Request) -> Any:
        return await create_message(state, req, raw)

    @app.post("/v1/messages/count_tokens", response_model=CountTokensResponse)
    async def messages_count_tokens(req: CountTokensRequest) -> CountTokensResponse:
        return await count_tokens(state, req)


def _add_service_routes(app: FastAPI, state: ServerState) -> None:
    """The model list, health, version, the tokenizer, metrics and stats."""
    engine = state.engine

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, max_model_len=engine.max_model_len)
                               for name in engine.model_names])

    @app.get("/v1/models/{model:path}", response_model=ModelCard)
    async def model(model: str) -> ModelCard:
        """OpenAI's `models.retrieve`: the served model's card, else a 404."""
        check_model(state, model)
        return ModelCard(id=model, max_model_len=engine.max_model_len)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return JSONResponse({"status": "ok"})
        # The cause is in the server log (the engine logged it when it failed), not here.
        return JSONResponse(error_body("the engine is not running", "server_error", None,
                                       "engine_dead"),
                            status_code=HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": conveyor.__version__}

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        return await _tokenize(state, req)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        check_model(state, req.model)
        engine.check_token_ids(req.tokens, "tokens")
        if engine.tokenizer is None:
            raise APIError(HTTPStatus.BAD_REQUEST, "this model has no tokenizer")
        # special tokens kept (as vLLM's): /tokenize's ids come back as the text they were
        return DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens,
                                                                 skip_special_tokens=False))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """The engine's counters after its latest step (debugging; not part of OpenAI's API)."""
        return {**engine.stats.to_dict(), "num_unfinished_requests": engine.num_unfinished}

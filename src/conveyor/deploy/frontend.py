"""The front door of a Ray Serve deployment: every HTTP request goes whole to one engine
replica (chosen by the deployment's request router) and its response comes back as the
replica's app wrote it, streams chunk by chunk. Only /metrics is answered here: every
replica's metrics, labelled `replica`, and the routing counters.

A replica that dies with requests in flight: those not yet answered get 503 with
Retry-After (code `replica_died`), streams already under way end with an SSE error event
and `[DONE]`, as when `conveyor serve` shuts down; the other replicas' requests go on, and
Ray Serve starts a new replica.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from conveyor.deploy.bridge import (
    ForwardedRequest,
    ResponseStart,
    is_live_view,
    routing_text,
)
from conveyor.deploy.metrics import (
    REPLICA_FAILURES,
    REPLICA_REQUESTS,
    STALE_S,
    exposition,
    metrics_hub,
)
from conveyor.server.common import SSE_DONE, sse
from conveyor.server.errors import REQUEST_ID_HEADER, error_body

# What a handle raises when the replica it sent a request to died or cannot be reached.
REPLICA_GONE = (RayActorError, ActorUnavailableError)
# Seconds a client should wait before retrying a request whose replica died (the others
# serve at once; a new replica starts within a few health-check periods).
RETRY_AFTER_S = 1
REPLICA_HEADER = b"x-conveyor-replica"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Frontend:
    """The deployment's ingress (one replica, no CPU of its own)."""

    def __init__(self, engine: Any, hub_name: str, max_body_bytes: int) -> None:
        self._engine = engine.options(stream=True, method_name="forward")
        self._hub = metrics_hub(hub_name)
        self._max_body_bytes = max_body_bytes

    async def __call__(self, request: Request) -> Response:
        if request.method == "GET" and _app_path(request) == "/metrics":
            snapshot = await self._hub.snapshot.remote(STALE_S)
            return Response(exposition(snapshot), media_type=METRICS_CONTENT_TYPE)
        forwarded = await _forwarded(request, self._max_body_bytes)
        responses = self._engine.remote(forwarded)
        try:
            start = await responses.__anext__()
        except REPLICA_GONE as e:
            REPLICA_FAILURES.labels("unknown").inc()
            return _replica_died_response(e)
        except BaseException:
            responses.cancel()  # the client went away: the replica aborts the request
            raise
        REPLICA_REQUESTS.labels(start.replica).inc()
        response = StreamingResponse(_rest(start, responses), status_code=start.status)
        # Ray Serve's proxy adds X-Request-Id to every response: the id it put on the request
        # (the client's, else a new one), which the replica's app took as its own.
        response.raw_headers = [*((k, v) for k, v in start.headers
                                  if k.lower() != REQUEST_ID_HEADER),
                                (REPLICA_HEADER, start.replica.encode())]
        return response


async def _forwarded(request: Request, max_body_bytes: int) -> ForwardedRequest:
    """The request, its body read up to one byte past the limit (the replica answers 413)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body_bytes:
            break
    path = _app_path(request)
    client = request.client
    headers = list(request.scope.get("headers", []))
    return ForwardedRequest(request.method, path, request.scope.get("query_string", b""),
                            headers, bytes(body), (client.host, client.port) if client else None,
                            routing_text(path, bytes(body)), is_live_view(path, headers))


def _app_path(request: Request) -> str:
    """The path below the application's route prefix (`serve.run(..., route_prefix=)`):
    the replica's app serves its routes at the root."""
    path: str = request.scope["path"]
    root = request.scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


async def _rest(start: ResponseStart, responses: Any) -> AsyncIterator[bytes]:
    """The response body: the first chunk, then the replica's further chunks."""
    finished = False
    try:
        yield start.body
        async for chunk in responses:
            yield chunk
        finished = True
    except REPLICA_GONE as e:
        REPLICA_FAILURES.labels(start.replica).inc()
        finished = True
        if start.is_event_stream:  # a non-stream's body came whole with its head
            yield sse(_replica_died_body(e)).encode()
            yield SSE_DONE.encode()
    finally:
        if not finished:  # the client went away mid-stream
            responses.cancel()


def _replica_died_body(error: BaseException) -> dict[str, Any]:
    return error_body(f"the replica serving this request stopped ({type(error).__name__}); "
                      "Ray Serve is restarting it and the other replicas are serving: "
                      "retry the request", "server_error", None, "replica_died")


def _replica_died_response(error: BaseException) -> Response:
    return JSONResponse(_replica_died_body(error), status_code=HTTPStatus.SERVICE_UNAVAILABLE,
                        headers={"Retry-After": str(RETRY_AFTER_S)})

"""One HTTP request carried from the Ray Serve front door to an engine replica, and the
replica's own FastAPI app (conveyor.server.app) answering it in-process.

The front door reads the request (method, path, headers, body) into a `ForwardedRequest`;
a replica runs it through the ASGI app with `call_asgi` and yields the response back: first
a `ResponseStart` (status, headers and the first body chunk), then the following chunks as
they come (a stream's SSE events). Ray-free, so it is tested and read without Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

# Paths whose JSON body holds the prompt the prefix router looks at.
_PROMPT_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
# The web page's live view and load button (conveyor.server.webui), and the header the page
# puts on all its requests (its chat too): these go to one replica, the live view's.
LIVE_VIEW_PATH_PREFIX = "/v1/engine/"
LIVE_VIEW_HEADER = b"x-conveyor-live-view"
# How long a replica's app may take to end after its client went away.
APP_EXIT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the front door received it (the body read whole)."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    # What the prefix router matches on: the prompt, or the messages' roles and contents in
    # order (the system prompt first); None for requests without one.
    routing_text: str | None = field(default=None)
    live_view: bool = False  # the router sends it to the live view's replica (`is_live_view`)


@dataclass(frozen=True)
class ResponseStart:
    """The first thing a replica yields: the response head with its first body chunk."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    replica: str  # which replica answered (front door metrics, the X-Conveyor-Replica header)

    @property
    def is_event_stream(self) -> bool:
        return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                   for k, v in self.headers)


def is_live_view(path: str, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request belongs with the live view: `/v1/engine/*`, or the web page's own
    (it sends the live-view header), so that the page watches the engine that runs its
    chat and its load burst."""
    return path.startswith(LIVE_VIEW_PATH_PREFIX) or \
        any(k.lower() == LIVE_VIEW_HEADER for k, _ in headers)


def routing_text(path: str, body: bytes) -> str | None:
    """The prompt text of a completion, chat, responses or messages request (None if it has
    none or is not JSON); a response's instructions and input, a message's system and
    messages, as the chat messages they become."""
    if path not in _PROMPT_PATHS:
        return None
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(payload, dict):
        return None
    messages = payload.get("messages")
    if path == "/v1/responses":
        given = payload.get("input")
        instructions = payload.get("instructions")
        messages = [{"role": "system", "content": instructions}] if instructions else []
        messages += given if isinstance(given, list) else [{"role": "user", "content": given}]
    elif path == "/v1/messages" and isinstance(messages, list):
        system = payload.get("system")
        messages = [{"role": "system", "content": system}, *messages] if system else messages
    if isinstance(messages, list):
        return "".join(_message_text(m) for m in messages if isinstance(m, dict))
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt (the others usually share its prefix)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # token ids
        return " ".join(str(t) for t in prompt)
    return None


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return f"<{message.get('role')}>{content if isinstance(content, str) else ''}"


def _scope(request: ForwardedRequest) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.0"},
            "http_version": "1.1", "method": request.method, "scheme": "http",
            "path": request.path, "raw_path": request.path.encode(),
            "query_string": request.query_string, "root_path": "",
            "headers": request.headers, "client": request.client,
            "server": ("127.0.0.1", 0), "state": {}, "extensions": {}}


async def call_asgi(app: ASGIApp, request: ForwardedRequest,
                    replica: str) -> AsyncIterator[ResponseStart | bytes]:
    """Run `request` through `app`: a ResponseStart, then the body's further chunks.

    Closing the iterator early (the client went away) tells the app its client disconnected,
    so it aborts the engine requests, as it does behind uvicorn.
    """
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.put_nowait(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        finally:
            sent.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        async for piece in _pieces(sent, replica):
            yield piece
    finally:
        disconnected.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, APP_EXIT_TIMEOUT_S)


async def _pieces(sent: asyncio.Queue[Message | None],
                  replica: str) -> AsyncIterator[ResponseStart | bytes]:
    head: Message | None = None
    while (message := await sent.get()) is not None:
        if message["type"] == "http.response.start":
            head = message
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if head is not None:  # the first body chunk travels with the head
                yield ResponseStart(head["status"], list(head.get("headers", [])), body,
                                    replica)
                head = None
            elif body:
                yield body
            if not message.get("more_body", False):
                return
    if head is not None:  # a head without a body (the app ended right after it)
        yield ResponseStart(head["status"], list(head.get("headers", [])), b"", replica)

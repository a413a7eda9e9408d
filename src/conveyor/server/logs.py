"""Logging that never blocks serving, and the access log.

Log records leave the event-loop thread through a bounded queue and are written by one
thread of their own: a slow or full output (a pipe nobody reads) delays log lines, never
requests or signals. When the queue is full, records are dropped and counted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from http import HTTPStatus
from logging.handlers import QueueHandler

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Records held while the output is slower than the server; past it they are dropped.
LOG_QUEUE_SIZE = 10_000
# How long shutdown waits for queued records to be written before it gives up on them.
FLUSH_TIMEOUT_S = 2.0

access_logger = logging.getLogger("conveyor.access")


class _DroppingQueueHandler(QueueHandler):
    """A QueueHandler that drops (and counts) a record rather than wait for room."""

    def __init__(self, records: queue.Queue[logging.LogRecord | None]) -> None:
        super().__init__(records)
        self.num_dropped = 0

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.num_dropped += 1


class LogQueue:
    """The root logger's handlers moved behind a queue, written by a daemon thread.

    uvicorn's loggers must have no handlers of their own (uvicorn.Config(log_config=None)):
    they propagate to the root, hence to the queue.
    """

    def __init__(self) -> None:
        self._records: queue.Queue[logging.LogRecord | None] = queue.Queue(LOG_QUEUE_SIZE)
        self._handler = _DroppingQueueHandler(self._records)
        root = logging.getLogger()
        self._outputs = list(root.handlers)
        root.handlers = [self._handler]
        logging.captureWarnings(True)  # warnings.showwarning writes to stderr directly
        self._thread = threading.Thread(target=self._write, name="conveyor-logs", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        while (record := self._records.get()) is not None:
            for handler in self._outputs:
                if record.levelno >= handler.level:
                    handler.handle(record)

    def close(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Write what is queued within timeout_s; False if the output is still blocked."""
        deadline = time.monotonic() + timeout_s
        if self._handler.num_dropped:
            logging.getLogger(__name__).warning(
                "%d log records were dropped: the log output was too slow",
                self._handler.num_dropped)
        try:
            self._records.put(None, timeout=timeout_s)
        except queue.Full:
            return False
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        return not self._thread.is_alive()


class AccessLog:
    """ASGI middleware: one line per request once it ends, as vLLM (uvicorn) prints them,
    plus the duration: `127.0.0.1:50312 - "POST /v1/completions HTTP/1.1" 200 OK 35.2 ms`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: int | None = None

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            status = status or HTTPStatus.INTERNAL_SERVER_ERROR  # the error handler's answer
            raise
        finally:
            _log_access(scope, status, time.perf_counter() - start)


def _log_access(scope: Scope, status: int | None, seconds: float) -> None:
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    path = scope["path"] + (f"?{scope['query_string'].decode('latin-1')}"
                            if scope.get("query_string") else "")
    if status is None:  # the client left before any answer
        outcome = "- (no response)"
    else:
        try:
            outcome = f"{status} {HTTPStatus(status).phrase}"
        except ValueError:
            outcome = str(status)
    access_logger.info('%s - "%s %s HTTP/%s" %s %.1f ms', who, scope["method"], path,
                       scope.get("http_version", "1.1"), outcome, seconds * 1000)

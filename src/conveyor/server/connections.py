"""uvicorn's h11 protocol with the read deadlines it lacks.

uvicorn (0.54) closes a kept-alive connection after `timeout_keep_alive`, but nothing else:
a connection that never sends a byte, headers trickled one byte at a time (slowloris) or a
body shorter than its Content-Length hold their connection (and its memory) forever. Here:

- a fresh connection that sends nothing is idle like a kept-alive one (`timeout_keep_alive`);
- a request's headers must be complete `timeout_read_headers` seconds after its first byte;
- its body must be complete `timeout_read_body` seconds after its headers.

A missed deadline answers 408 (OpenAI's error body) and closes the connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from conveyor.server.errors import error_body

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadTimeouts:
    headers_s: float  # from a request's first byte to the end of its headers
    body_s: float  # from the end of its headers to the end of its body


class TimedH11Protocol(H11Protocol):
    """H11Protocol with a deadline on reading each request (see the module docstring)."""

    read_timeouts: ClassVar[ReadTimeouts] = ReadTimeouts(headers_s=15.0, body_s=60.0)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._reading: str | None = None  # "headers" | "body": what the timer waits for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_read_timer(None)
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track_reading()  # a pipelined request may be half read

    def _track_reading(self) -> None:
        state = self.conn.their_state
        if state is h11.IDLE and self.conn.trailing_data[0]:
            self._set_read_timer("headers")  # some bytes of a request, not all its headers
        elif state is h11.SEND_BODY:
            self._set_read_timer("body")
        else:
            self._set_read_timer(None)

    def _set_read_timer(self, reading: str | None) -> None:
        if reading == self._reading:
            return  # the deadline runs from the start of this part, not from the last byte
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._reading = reading
        if reading is not None:
            seconds = (self.read_timeouts.headers_s if reading == "headers"
                       else self.read_timeouts.body_s)
            self._read_timer = self.loop.call_later(seconds, self._on_read_timeout, reading)

    def _on_read_timeout(self, reading: str) -> None:
        self._read_timer = None
        self._reading = None
        if self.transport.is_closing():
            return
        logger.warning("closing a connection from %s: request %s not received in time",
                       _address(self.client), reading)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app reads a disconnect, writes nothing more
            self.cycle.message_event.set()
        if self.cycle is None or not self.cycle.response_started:
            self._send_408(reading)
        self.transport.close()

    def _send_408(self, reading: str) -> None:
        body = json.dumps(error_body(f"the request {reading} did not arrive in time",
                                     "invalid_request_error", None, "request_timeout")).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        try:
            for event in (h11.Response(status_code=HTTPStatus.REQUEST_TIMEOUT, headers=headers,
                                       reason=b"Request Timeout"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event) or b"")
        except h11.LocalProtocolError:  # h11 cannot answer in this state: just close
            pass


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def timed_protocol(read_timeouts: ReadTimeouts) -> type[TimedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...) (uvicorn makes one per connection)."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"read_timeouts": read_timeouts})

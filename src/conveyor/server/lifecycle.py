"""uvicorn's server with conveyor's start and stop.

- The first SIGTERM/SIGINT closes the listening sockets at once (new connections are
  refused), then in-flight requests have `shutdown_timeout` seconds to finish; those still
  running then end with an error (a stream: an SSE error event and `[DONE]`; otherwise a 503
  body), their KV blocks are freed, and the process exits 0.
- A second SIGTERM/SIGINT exits at once (status 128 + the signal's number).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Generator
from types import FrameType

import uvicorn

from conveyor.engine.async_engine import AsyncEngine, EngineStoppedError

logger = logging.getLogger("conveyor.server")

# After the shutdown timeout, how long the cut responses get to write their error event.
CUT_RESPONSES_TIMEOUT_S = 5
# How often shutdown looks whether the in-flight requests have finished.
DRAIN_POLL_S = 0.05


def freeze_start_up_heap() -> None:
    """Freeze what start-up built (the model, the tokenizer, the app: ~230k objects): the
    cyclic collector's full passes then skip it. Each pass holds the GIL, and the engine's
    loop with it: over the unfrozen heap one took 173 ms in a 64-stream decode (Zen 4,
    docs/benchmarks.md). vLLM's engine freezes its start-up heap likewise. Only for a process
    that keeps its one engine to its end (`conveyor serve`, a Ray Serve replica): a frozen
    object is never collected, so a process that builds and drops engines would keep each
    dropped one's reference cycles."""
    gc.collect()
    gc.freeze()


class GracefulServer(uvicorn.Server):
    """uvicorn.Server with the start and stop described in the module docstring."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine,
                 shutdown_timeout_s: float) -> None:
        config.timeout_graceful_shutdown = CUT_RESPONSES_TIMEOUT_S
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises the captured signal after its shutdown, so the process would die
        # "by signal"; a server that drained its requests cleanly exits 0 instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:  # the second signal: the operator wants out now
            os._exit(128 + sig)
        self.should_exit = True
        if self._loop is not None:
            # Runs on the next turn of the event loop, before uvicorn's main loop notices
            # should_exit (up to 0.1 s later) and before anything is logged.
            self._loop.call_soon_threadsafe(self._stop_listening)

    def _stop_listening(self) -> None:
        for server in getattr(self, "servers", []):
            server.close()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            logger.info("conveyor serving %s on http://%s:%d", self.engine.model_name, host,
                        port)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._stop_listening()
        self.engine.stop_accepting()
        tasks = self.server_state.tasks
        logger.info("shutting down: %d requests in flight get up to %g s to finish",
                    len(tasks), self.shutdown_timeout_s)
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle connections close; busy ones after their response
        deadline = time.monotonic() + self.shutdown_timeout_s
        while tasks and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.engine.num_unfinished:
            logger.warning("shutdown timeout: ending %d unfinished requests with an error",
                           self.engine.num_unfinished)
            self.engine.fail_unfinished(EngineStoppedError(
                "the server shut down before this request finished"))
        await super().shutdown(sockets)  # the cut responses end; the lifespan stops the engine
        stats = self.engine.stats
        logger.info("conveyor shut down: %d of %d KV blocks free, %d requests unfinished",
                    stats.kv_blocks_free, stats.kv_blocks_total,
                    self.engine.num_unfinished)

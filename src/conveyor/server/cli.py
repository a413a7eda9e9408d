"""`conveyor serve`: the engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from conveyor.cli.engine_args import add_engine_args, engine_args_from
from conveyor.config import SERVER_MAX_NUM_BATCHED_TOKENS, EngineArgs
from conveyor.server.common import DEFAULT_MAX_BODY_BYTES

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    p.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: "
                        "$CONVEYOR_API_KEY, else no key)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 429 (Retry-After) once this many requests wait "
                        "(default: unbounded)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body accepted (default: {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish on SIGTERM (default: 30)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   help="uvicorn's log level (access logs at info; default: warning)")
    add_engine_args(p)
    p.set_defaults(func=run)


def server_engine_args(args: argparse.Namespace) -> EngineArgs:
    """The flags as EngineArgs, with the server's token budget unless one is given."""
    return engine_args_from(args, max_num_batched_tokens=args.max_num_batched_tokens
                            or SERVER_MAX_NUM_BATCHED_TOKENS)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.server.app import build_app

    # Build the engine off the main thread. Once the main thread has run a parallel torch
    # op, torch ops in any other thread (the engine loop) run ~1.5x slower on this CPU
    # build (measured: a decode-size linear, 330 vs 500 us); threads other than the main
    # one do not interfere with each other.
    with ThreadPoolExecutor(max_workers=1) as pool:
        llm_engine = pool.submit(LLMEngine, server_engine_args(args)).result()  # logs KV capacity
    engine = AsyncEngine(llm_engine, max_queued_requests=args.max_queued_requests)
    app = build_app(engine, api_key=args.api_key, max_body_bytes=args.max_request_body_bytes,
                    shutdown_timeout_s=args.shutdown_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level.lower(),
                            timeout_graceful_shutdown=max(int(args.shutdown_timeout), 1))
    server = _make_server(config)

    def on_engine_dead(error: BaseException) -> None:
        # Never a server that accepts requests it will never answer: stop, exit non-zero.
        logger.error("the engine cannot continue; the server shuts down")
        server.should_exit = True

    engine.on_dead = on_engine_dead
    logger.info("serving %s on http://%s:%d", engine.model_name, args.host, args.port)
    server.run()
    return 0 if server.started and engine.dead_error is None else 1


def _make_server(config: Any) -> Any:
    """uvicorn's server, except that SIGTERM/SIGINT end the process with status 0.

    uvicorn re-raises the captured signal after its graceful shutdown, so the process would
    die "by signal"; a server that drained its requests cleanly exits 0 instead.
    """
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
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

    return Server(config)

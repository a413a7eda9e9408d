"""One engine replica of a Ray Serve deployment: an LLMEngine, its AsyncEngine and the very
app `conveyor serve` runs (conveyor.server.app.build_app), answering forwarded requests
in-process. Ray Serve restarts a replica whose actor dies or whose engine fails its health
check."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import generate_latest
from ray import serve

from conveyor.config import EngineArgs
from conveyor.deploy.bridge import ForwardedRequest, ResponseStart, call_asgi
from conveyor.deploy.metrics import PUSH_PERIOD_S, metrics_hub
from conveyor.deploy.routing import replica_name
from conveyor.server.config import ServerConfig
from conveyor.server.lifecycle import freeze_start_up_heap

logger = logging.getLogger("conveyor.deploy")

# A dead engine or actor is noticed within this period and its replica replaced.
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 10.0


class EngineReplica:
    """The engine behind one replica; `forward` answers one HTTP request."""

    # Ray Serve awaits an async constructor on the replica's event loop.
    async def __init__(self, engine_args: EngineArgs,  # type: ignore[misc]
                       server_config: ServerConfig,
                       hub_name: str) -> None:
        from conveyor.engine.async_engine import AsyncEngine
        from conveyor.engine.llm_engine import LLMEngine
        from conveyor.server.app import build_app

        # Off this thread, as `conveyor serve` does (torch ops in the engine's loop thread
        # run slower once the thread that built the engine has run parallel ops).
        with ThreadPoolExecutor(max_workers=1) as pool:
            llm_engine = await asyncio.wrap_future(pool.submit(LLMEngine, engine_args))
        self.engine = AsyncEngine(llm_engine,
                                  max_queued_requests=server_config.max_queued_requests)
        self.app = build_app(self.engine, server_config)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the engine's loop on this event loop
        self.name = replica_name(serve.get_replica_context().replica_id)
        self._hub = metrics_hub(hub_name)
        self._pusher = asyncio.create_task(self._push_metrics())
        freeze_start_up_heap()  # the actor's process keeps this one engine to its end
        logger.info("replica %s (pid %d) serving %s", self.name, os.getpid(),
                    self.engine.model_name)

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        async for piece in call_asgi(self.app, request, self.name):
            yield piece

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it replace the replica."""
        if not self.engine.is_healthy:
            raise RuntimeError(f"the engine of replica {self.name} is not running: "
                               f"{self.engine.dead_error!r}")

    async def _push_metrics(self) -> None:
        registry = self.app.state.server.metrics.registry
        while True:
            with contextlib.suppress(Exception):  # a hub restart must not end the pushes
                await self._hub.put.remote(self.name, generate_latest(registry).decode(),
                                           os.getpid())
            await asyncio.sleep(PUSH_PERIOD_S)

    async def __del__(self) -> None:
        """Ray Serve's graceful shutdown: in-flight requests had their time; stop the engine."""
        self._pusher.cancel()
        with contextlib.suppress(Exception):
            await self._hub.drop.remote(self.name)
        await self._lifespan.__aexit__(None, None, None)


def replica_options(num_replicas: int, num_cpus: float, max_num_seqs: int,
                    server_config: ServerConfig) -> dict[str, Any]:
    """The engine deployment's Ray Serve options."""
    return {
        "name": "EngineReplica", "num_replicas": num_replicas,
        "ray_actor_options": {"num_cpus": num_cpus},
        # Ray Serve's default (5) would hold back what the engine batches: let every
        # sequence slot and as many waiting requests through; the engine queues them.
        "max_ongoing_requests": 2 * max_num_seqs,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "graceful_shutdown_timeout_s": server_config.shutdown_timeout,
    }

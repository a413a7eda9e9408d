"""`conveyor serve --replicas N` and `conveyor.deploy.build_app`: N engine replicas on Ray
Serve behind one OpenAI-compatible endpoint."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from conveyor.config import EngineArgs
from conveyor.deploy.config import DeployConfig, check_ray_address_answers, replica_cpus
from conveyor.deploy.frontend import Frontend
from conveyor.deploy.replica import EngineReplica, replica_options
from conveyor.server.config import ServerConfig

logger = logging.getLogger("conveyor.deploy")

APP_NAME = "conveyor"
# The front door takes every client connection; replicas bound what runs (their engines).
FRONTEND_MAX_ONGOING_REQUESTS = 100_000


def build_app(engine_args: EngineArgs | None = None, server_config: ServerConfig | None = None,
              deploy_config: DeployConfig | None = None, app_name: str = APP_NAME) -> Any:
    """The Ray Serve application (pass it to `serve.run(app, name=app_name, route_prefix="/")`):
    `deploy_config.replicas` engine replicas, each the app of `conveyor serve`, behind one
    front door; `deploy_config.routing` picks Ray Serve's power of two choices or prefix
    affinity. `app_name` must be the name it is run under (it names its metrics hub)."""
    engine_args = engine_args or EngineArgs().for_server()
    server_config = server_config or ServerConfig()
    deploy_config = deploy_config or DeployConfig(replicas=1)
    num_replicas = deploy_config.replicas or 1
    options = replica_options(num_replicas, replica_cpus(num_replicas, _cpus()),
                              engine_args.max_num_seqs, server_config)
    prefix = deploy_config.routing == "prefix"
    options["request_router_config"] = RequestRouterConfig(
        # by import path: Ray imports it in the front door's process
        request_router_class="conveyor.deploy.routing:"  # type: ignore[arg-type]
                             + ("PrefixAffinityRouter" if prefix else "PowerOfTwoRouter"),
        request_router_kwargs={"imbalance_threshold": deploy_config.routing_imbalance_threshold}
        if prefix else {})
    hub_name = f"conveyor-metrics:{app_name}"
    engine = serve.deployment(**options)(EngineReplica).bind(engine_args, server_config,
                                                              hub_name)
    frontend = serve.deployment(name="Frontend", num_replicas=1,
                                ray_actor_options={"num_cpus": 0},
                                max_ongoing_requests=FRONTEND_MAX_ONGOING_REQUESTS)(Frontend)
    return frontend.bind(engine, hub_name, server_config.max_request_body_bytes)


def _cpus() -> float:
    if ray.is_initialized():
        return float(ray.cluster_resources().get("CPU", 0.0))
    return float(os.cpu_count() or 1)


def serve_replicas(engine_args: EngineArgs, server_config: ServerConfig,
                   deploy_config: DeployConfig) -> int:
    """`conveyor serve --replicas N`: start (or join) Ray, run the app, serve until
    SIGTERM/SIGINT, then shut Serve down (in-flight requests get `shutdown_timeout`)."""
    _init_ray(deploy_config.ray_address)
    # Caught from here on (after ray.init, whose driver handler would exit with status 15):
    # the endpoint answers before serve.run returns, and a signal in that window still shuts
    # down cleanly once it has.
    stop = _stop_on_signal()
    try:
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        serve.run(build_app(engine_args, server_config, deploy_config), name=APP_NAME,
                  route_prefix="/")
        logger.info("conveyor serving %d replicas (%s routing) on http://%s:%d",
                    deploy_config.replicas, deploy_config.routing, server_config.host,
                    server_config.port)
        while not stop.wait(0.5):
            pass
        logger.info("shutting down: in-flight requests get up to %g s to finish",
                    server_config.shutdown_timeout)
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0


def _init_ray(address: str | None) -> None:
    """Start a local Ray cluster (None, "local") or join one ("auto": the one running on this
    machine; "host:port", "ray://host:port"); ValueError naming --ray-address when there is
    none to join (at an address where nothing answers, Ray itself would retry for a minute)."""
    check_ray_address_answers(address)
    try:
        ray.init(address=address, include_dashboard=False)
    except ConnectionError as e:  # "auto" with no cluster running here
        raise ValueError(f"--ray-address {address}: {e}") from e


def _stop_on_signal() -> threading.Event:
    """An event that SIGTERM or SIGINT sets."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop

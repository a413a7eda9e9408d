"""`conveyor serve --replicas`: the settings of a Ray Serve deployment (Ray is not imported
here, so the flags exist and are checked without the optional extra)."""

from __future__ import annotations

import logging
import re
import socket
from dataclasses import dataclass

from conveyor.config import _require

ROUTINGS = ("pow2", "prefix")
# A Ray cluster's address: its GCS "host:port", or a Ray Client "ray://host:port".
_RAY_ADDRESS = re.compile(r"(ray://)?[^\s:/]+:[0-9]{1,5}")
# Seconds --ray-address may take to accept a connection before it is reported missing.
RAY_CONNECT_TIMEOUT_S = 5.0
RAY_EXTRA_HINT = "pip install -e '.[ray]'"

logger = logging.getLogger("conveyor.deploy")


class RayNotInstalledError(ImportError):
    """Ray Serve is an optional extra; this names the command that installs it."""


@dataclass(frozen=True)
class DeployConfig:
    """How many engine replicas run behind the one endpoint, and how requests reach them."""

    # None: no Ray, the single in-process server; N >= 1: N engine replicas on Ray Serve.
    replicas: int | None = None
    # "pow2": Ray Serve's default (power of two choices on queue length); "prefix": requests
    # whose prompts share a prefix go to the replica that served it (its prefix cache holds
    # the KV), unless the replicas' queues differ by more than routing_imbalance_threshold.
    routing: str = "pow2"
    # Queue-length gap (requests) past which prefix affinity yields to power of two choices.
    routing_imbalance_threshold: int = 4
    # None or "local": start a local Ray cluster; "auto" (the one running on this machine),
    # "host:port" (its GCS) or "ray://host:port" (Ray Client): join a running one.
    ray_address: str | None = None

    def __post_init__(self) -> None:
        _require(self.replicas is None or self.replicas >= 1, "replicas", ">= 1 (or unset)",
                 self.replicas)
        _require(self.routing in ROUTINGS, "routing", f"one of {', '.join(ROUTINGS)}",
                 self.routing)
        _require(self.routing_imbalance_threshold >= 0, "routing_imbalance_threshold", ">= 0",
                 self.routing_imbalance_threshold)
        address = self.ray_address
        _require(address is None or address in ("auto", "local")
                 or _RAY_ADDRESS.fullmatch(address) is not None, "ray_address (--ray-address)",
                 "'auto', 'local', 'host:port' or 'ray://host:port'", address)
        # Replicas' settings without replicas would be silently ignored: refused.
        _require(self.replicas is not None or (
                     self.routing == DeployConfig.routing and self.ray_address is None
                     and self.routing_imbalance_threshold == DeployConfig.routing_imbalance_threshold),
                 "replicas (--replicas)", "set for --routing, --routing-imbalance-threshold "
                 "or --ray-address", self.replicas)


def check_ray_address_answers(address: str | None,
                              timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """ValueError naming --ray-address unless something accepts a TCP connection at a
    'host:port' or 'ray://host:port' address within timeout_s (None, 'auto', 'local': no check)."""
    if address is None or address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout_s).close()
    except OSError as e:
        raise ValueError(f"--ray-address {address}: no Ray cluster answers there ({e}); start "
                         "one with `ray start --head` or give its address") from e


def require_ray() -> None:
    """Raise RayNotInstalledError (naming the extra) unless `ray[serve]` can be imported."""
    try:
        import ray.serve  # noqa: F401  (ray without the serve extra lacks its dependencies)
    except ImportError as e:
        raise RayNotInstalledError(
            f"replicas need Ray Serve, which is not installed ({e}): {RAY_EXTRA_HINT}") from e


def replica_cpus(num_replicas: int, num_cpus: float) -> float:
    """CPUs each replica reserves: one, or a share when there are more replicas than CPUs
    (with a warning: Ray would otherwise leave the extra replicas pending forever)."""
    if num_replicas <= num_cpus:
        return 1.0
    share = max(num_cpus, 0.01) / num_replicas
    logger.warning("%d replicas on %g CPUs: each replica gets %.2f of a CPU and they share "
                   "cores (slower than fewer replicas; nothing waits for a free CPU)",
                   num_replicas, num_cpus, share)
    return share

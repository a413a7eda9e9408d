"""Metrics of a Ray Serve deployment: every replica's own /metrics, labelled `replica`, and
the front door's routing counters, on the endpoint's one /metrics.

Each replica pushes its registry's text (conveyor.server.metrics: vLLM's names with the
`conveyor:` prefix) to a `MetricsHub` actor every PUSH_PERIOD_S; the front door merges the
fresh ones at scrape time. A replica that died stops pushing and drops out after STALE_S.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

PREFIX = "conveyor:"
PUSH_PERIOD_S = 1.0
# A replica whose last push is older than this is gone (a restarted one has a new id).
STALE_S = 5.0
# Named actors live in a namespace; each replica process would otherwise have its own.
HUB_NAMESPACE = "conveyor"

# The front door's process: the routers (which run in it) and the front door count here.
REGISTRY = CollectorRegistry()
ROUTING_DECISIONS = Counter(
    PREFIX + "routing_decisions", "Requests routed, by router policy and the reason for the "
    "replica chosen (prefix: it holds the prompt's prefix; no_match: no replica does; "
    "imbalanced: queues differ too much for affinity; no_prompt: nothing to match).",
    ["policy", "reason"], registry=REGISTRY)
REPLICA_REQUESTS = Counter(PREFIX + "replica_requests",
                           "Requests answered, by the replica that answered them.",
                           ["replica"], registry=REGISTRY)
REPLICA_FAILURES = Counter(PREFIX + "replica_failures",
                           "Requests cut short because their replica died (503 or an SSE "
                           "error event; Ray Serve restarts the replica).", ["replica"],
                           registry=REGISTRY)


@ray.remote(num_cpus=0)
class MetricsHub:
    """The latest /metrics text of each replica (a detached actor named per application)."""

    def __init__(self) -> None:
        self._latest: dict[str, tuple[str, int, float]] = {}

    def put(self, replica: str, text: str, pid: int) -> None:
        self._latest[replica] = (text, pid, time.monotonic())

    def drop(self, replica: str) -> None:
        self._latest.pop(replica, None)

    def snapshot(self, max_age_s: float) -> dict[str, tuple[str, int]]:
        now = time.monotonic()
        return {r: (text, pid) for r, (text, pid, at) in self._latest.items()
                if now - at <= max_age_s}


def metrics_hub(name: str) -> Any:
    """The application's hub, created by whoever asks first (detached: it outlives them)."""
    return MetricsHub.options(  # type: ignore[attr-defined]  # added by @ray.remote
        name=name, namespace=HUB_NAMESPACE, get_if_exists=True, lifetime="detached").remote()


class _Replicas(Collector):
    """The replicas' metric families, each sample labelled with its replica."""

    def __init__(self, snapshot: dict[str, tuple[str, int]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        info = Metric(PREFIX + "replica_info", "A live engine replica (its process id).",
                      "gauge")
        for replica, (text, pid) in sorted(self._snapshot.items()):
            info.add_sample(info.name, {"replica": replica, "pid": str(pid)}, 1.0)
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, Metric(
                    family.name, family.documentation, family.type, family.unit))
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "replica": replica},
                                      sample.value, sample.timestamp)
        return [info, *families.values()]


def exposition(snapshot: dict[str, tuple[str, int]]) -> bytes:
    """The endpoint's /metrics: the routing counters, then every fresh replica's metrics."""
    merged = CollectorRegistry()
    merged.register(_Replicas(snapshot))
    return generate_latest(REGISTRY) + generate_latest(merged)

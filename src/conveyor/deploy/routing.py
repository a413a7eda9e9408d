"""conveyor's Ray Serve request routers: Ray Serve's power of two choices (`--routing pow2`)
and prefix affinity (`--routing prefix`), both sending the web page's requests to one replica.

The live view's replica: the web page's live view, its load button and its chat
(`bridge.is_live_view`) all go to one replica (the smallest name when first needed), so the
page watches the engine that runs its requests; when that replica dies the smallest of the
others takes over (the page reconnects to it).

Prefix affinity:

Requests whose prompts share a prefix (a system prompt, a few-shot preamble, a chat's
history) go to the replica that served that prefix before, whose prefix cache still holds
its KV blocks: prefill skips them. Affinity yields to Ray Serve's power of two choices when
the replicas' queues differ by more than `imbalance_threshold` requests (a hot prefix must
not pile onto one replica while another idles) and when no replica holds the prefix.

It runs in the process that holds the deployment handle (the front door) and counts each
decision in `conveyor:routing_decisions_total{policy="prefix", reason}`.
"""

from __future__ import annotations

# Ray Serve's own default router: the fallback and the base (queue probing, FIFO, retries).
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RunningReplica

from conveyor.deploy.bridge import ForwardedRequest
from conveyor.deploy.prefix_index import DEFAULT_BLOCK_CHARS, PrefixIndex

# Routing reasons kept for requests not yet routed: a request cancelled while queued is never
# routed, so its entry would stay; past this many the oldest go (it then counts "no_prompt").
MAX_PENDING_REASONS = 10_000


def replica_name(replica_id: ReplicaID) -> str:
    """The replica's name in metrics and headers (the replica computes the same)."""
    return str(replica_id.unique_id)


class PowerOfTwoRouter(PowerOfTwoChoicesRequestRouter):
    """Ray Serve's power of two choices, except for the live view's requests."""

    _live_view: str | None = None  # the live view's replica, while it lives

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        pinned = self.live_view_replica(candidate_replicas, pending_request)
        if pinned is not None:
            return pinned
        return await super().choose_replicas(candidate_replicas, pending_request)

    def live_view_replica(self, candidate_replicas: list[RunningReplica],
                          pending_request: PendingRequest | None
                          ) -> list[list[RunningReplica]] | None:
        """The live view's replica for a request that belongs with it (None: any other): the
        one chosen before while it lives (a replica that joins later does not take over),
        else the smallest name."""
        forwarded = _forwarded(pending_request)
        if forwarded is None or not forwarded.live_view or not candidate_replicas:
            return None
        by_name = {replica_name(r.replica_id): r for r in candidate_replicas}
        if self._live_view not in by_name:
            self._live_view = min(by_name)
        return [[by_name[self._live_view]]]


class PrefixAffinityRouter(PowerOfTwoRouter):
    """Power of two choices, except that a prompt goes where its longest prefix went (and
    the live view's requests to its replica)."""

    def initialize_state(self, imbalance_threshold: int = 4,  # type: ignore[override]
                         block_chars: int = DEFAULT_BLOCK_CHARS) -> None:
        self._imbalance_threshold = imbalance_threshold
        self._index = PrefixIndex(block_chars)
        self._reasons: dict[str, str] = {}  # request id -> why its replica was chosen

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        pinned = self.live_view_replica(candidate_replicas, pending_request)
        if pinned is not None:
            self._note(pending_request, "live_view")
            return pinned
        fallback = await super().choose_replicas(candidate_replicas, pending_request)
        text = _routing_text(pending_request)
        if text is None or not fallback:
            self._note(pending_request, "no_prompt")
            return fallback
        by_name = {replica_name(r.replica_id): r for r in candidate_replicas}
        best, _ = self._index.longest_match(text, by_name)
        if best is None:
            self._note(pending_request, "no_match")
            return fallback
        if await self._imbalanced(candidate_replicas):
            self._note(pending_request, "imbalanced")
            return fallback
        self._note(pending_request, "prefix")
        return [[by_name[best]]]

    async def _imbalanced(self, replicas: list[RunningReplica]) -> bool:
        """Whether the replicas' queue lengths differ by more than the threshold."""
        lengths = {r: self._replica_queue_len_cache.get(r.replica_id) for r in replicas}
        missing = [r for r, length in lengths.items() if length is None]
        if missing:  # not cached or stale: ask those replicas (as power of two choices does)
            lengths.update(await self._probe_queue_lens(missing, 0))
        known = [length for length in lengths.values() if length is not None]
        return bool(known) and max(known) - min(known) > self._imbalance_threshold

    def _note(self, pending_request: PendingRequest | None, reason: str) -> None:
        if pending_request is None:
            return
        self._reasons[pending_request.metadata.request_id] = reason
        if len(self._reasons) > MAX_PENDING_REASONS:
            del self._reasons[next(iter(self._reasons))]  # the oldest (insertion order)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        # Imported here: Ray Serve pickles this module by value, and the counter (with its
        # lock) must be the front door's own, the one its /metrics shows.
        from conveyor.deploy.metrics import ROUTING_DECISIONS

        reason = self._reasons.pop(pending_request.metadata.request_id, "no_prompt")
        ROUTING_DECISIONS.labels("prefix", reason).inc()
        text = _routing_text(pending_request)
        if text is not None:
            self._index.insert(replica_name(replica_id), text)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {replica_name(r.replica_id) for r in replicas}
        for name in self._index.replicas():
            if name not in live:  # a dead replica's cache died with it
                self._index.remove(name)


def _forwarded(pending_request: PendingRequest | None) -> ForwardedRequest | None:
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(arg, ForwardedRequest):
            return arg
    return None


def _routing_text(pending_request: PendingRequest | None) -> str | None:
    forwarded = _forwarded(pending_request)
    return None if forwarded is None else forwarded.routing_text

"""Admission and preemption policies: who waits in front, and who yields blocks.

A policy owns the waiting queue. ``Scheduler.schedule()`` asks it for the next request to
admit, for a running request to displace when a more deserving one waits, and for a victim
when blocks run out; it never branches on which policy it has.

Shared rules, enforced here for every policy:
- a request that was preempted is not preempted again until it has made progress (produced
  a token since), so two requests cannot evict each other forever (thrash);
- a victim is never more urgent (lower ``priority`` value) than the request needing room.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Iterator

from conveyor.config import SchedulerConfig, parse_tenant_weights
from conveyor.request import Request

DEFAULT_TENANT = ""  # requests without a `user` share one tenant


def preemptible(request: Request) -> bool:
    """False until a preempted request has produced a token since its last preemption."""
    return request.num_output_tokens > request.output_len_at_preemption


class SchedulingPolicy(ABC):
    """The waiting queue plus the choice of preemption victims."""

    name: str

    @abstractmethod
    def __init__(self, config: SchedulerConfig) -> None: ...

    @abstractmethod
    def add(self, request: Request) -> None:
        """A newly arrived request joins the queue."""

    @abstractmethod
    def requeue(self, request: Request) -> None:
        """A preempted request returns; it should not lose its place to later arrivals."""

    @abstractmethod
    def peek(self) -> Request | None:
        """The request to admit next (not removed)."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Drop a waiting request (admitted, aborted or finished)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def begin_step(self) -> None:
        """Called once per scheduling step (aging clocks tick here)."""

    def forget(self, request: Request) -> None:
        """``request`` finished (any way): drop whatever the policy keeps about it."""

    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        """``request`` computes ``num_tokens`` this step (accounting hook)."""

    def victim_order(self, candidates: list[Request]) -> list[Request]:
        """Candidates, the first to preempt first. Default: the most recently admitted
        (its recompute loses the least, and the oldest requests keep their progress)."""
        return list(reversed(candidates))

    def pick_victim(self, running: list[Request], needing: Request) -> Request | None:
        """The running request to preempt so ``needing`` can grow, or None to preempt
        ``needing`` itself."""
        candidates = [r for r in running if r is not needing and preemptible(r)
                      and r.priority >= needing.priority]
        ordered = self.victim_order(candidates)
        return ordered[0] if ordered else None

    def pick_admission_victim(self, running: list[Request], waiting: Request) -> Request | None:
        """A running request that ``waiting`` deserves to displace now, or None (FCFS: never)."""
        return None


class FCFSPolicy(SchedulingPolicy):
    """First come, first served; preempted requests go back to the front."""

    name = "fcfs"

    def __init__(self, config: SchedulerConfig) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def requeue(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityPolicy(SchedulingPolicy):
    """Lowest ``priority`` value first (vLLM's convention), arrival order among equals.

    Waiting ages a request: its effective priority drops by one level per
    ``priority_aging_steps`` steps waited, so a stream of urgent arrivals cannot starve it.
    A waiting request more urgent than the least urgent running one displaces it, even when
    ``max_num_seqs`` or the KV cache is full.
    """

    name = "priority"

    def __init__(self, config: SchedulerConfig) -> None:
        self.aging_steps = config.priority_aging_steps
        self._waiting: set[Request] = set()
        # Per live request: the step it arrived (aging counts from there, and survives
        # preemption) and its arrival sequence (FCFS among equals).
        self._joined: dict[Request, int] = {}
        self._order: dict[Request, int] = {}
        self._step = 0
        self._seq = 0

    def effective_priority(self, request: Request) -> float:
        waited = self._step - self._joined.get(request, self._step)
        return request.priority - waited / self.aging_steps

    def _key(self, request: Request) -> tuple[float, int]:
        return self.effective_priority(request), self._order[request]

    def add(self, request: Request) -> None:
        self._order[request] = self._seq
        self._seq += 1
        self._joined[request] = self._step
        self._waiting.add(request)

    def requeue(self, request: Request) -> None:
        self._waiting.add(request)  # keeps its arrival order and the aging it earned

    def peek(self) -> Request | None:
        return min(self._waiting, key=self._key) if self._waiting else None

    def remove(self, request: Request) -> None:
        self._waiting.discard(request)

    def forget(self, request: Request) -> None:
        self._order.pop(request, None)
        self._joined.pop(request, None)

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._waiting, key=self._key))

    def begin_step(self) -> None:
        self._step += 1

    def victim_order(self, candidates: list[Request]) -> list[Request]:
        # Least urgent first; among equals the one that loses the least computed work.
        return sorted(candidates, key=lambda r: (-r.priority, r.num_computed_tokens))

    def pick_admission_victim(self, running: list[Request], waiting: Request) -> Request | None:
        # Displacement compares declared priorities: aging reorders the queue (so a waiting
        # request reaches the front), but does not let equals evict each other (thrash).
        candidates = [r for r in running if preemptible(r) and r.priority > waiting.priority]
        ordered = self.victim_order(candidates)
        return ordered[0] if ordered else None


class FairPolicy(SchedulingPolicy):
    """Per-tenant fair share (tenant = the request's ``user``), accounted in tokens computed.

    The next slot goes to the waiting tenant with the least weighted service; a tenant that
    was idle starts from the least service of the active ones (those with requests waiting
    or running: no banked credit), so one tenant flooding the queue cannot starve another,
    and an idle one cannot burst forever.
    """

    name = "fair"

    def __init__(self, config: SchedulerConfig) -> None:
        self.weights = parse_tenant_weights(config.tenant_weights)
        self._queues: dict[str, deque[Request]] = {}  # tenants with requests waiting
        self._live: Counter[str] = Counter()  # tenant -> its requests added, not finished
        self.served: dict[str, float] = {}  # tenant -> tokens computed / weight

    @staticmethod
    def tenant(request: Request) -> str:
        return request.user or DEFAULT_TENANT

    def _queue_for(self, request: Request) -> deque[Request]:
        tenant = self.tenant(request)
        if tenant not in self._queues:
            active = [self.served[t] for t in self._live if t in self.served]
            floor = min(active) if active else 0.0
            # An idle tenant at or below the floor would rejoin at the floor: its entry says
            # nothing (dropped, so that a `user` per request does not grow this forever).
            for idle in [t for t, s in self.served.items() if s <= floor and t not in self._live]:
                del self.served[idle]
            self.served[tenant] = max(self.served.get(tenant, 0.0), floor)
            self._queues[tenant] = deque()
        return self._queues[tenant]

    def add(self, request: Request) -> None:
        self._queue_for(request).append(request)
        self._live[self.tenant(request)] += 1

    def forget(self, request: Request) -> None:
        tenant = self.tenant(request)
        self._live[tenant] -= 1
        if self._live[tenant] <= 0:
            del self._live[tenant]

    def requeue(self, request: Request) -> None:
        self._queue_for(request).appendleft(request)

    def peek(self) -> Request | None:
        if not self._queues:
            return None
        tenant = min(self._queues, key=lambda t: self.served[t])
        return self._queues[tenant][0]

    def remove(self, request: Request) -> None:
        tenant = self.tenant(request)
        queue = self._queues[tenant]
        queue.remove(request)
        if not queue:
            del self._queues[tenant]

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[Request]:
        return (r for q in self._queues.values() for r in q)

    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        tenant = self.tenant(request)
        self.served[tenant] = self.served.get(tenant, 0.0) + \
            num_tokens / self.weights.get(tenant, 1.0)

    def victim_order(self, candidates: list[Request]) -> list[Request]:
        # The most-served tenant yields first, its newest request first.
        newest_first = list(reversed(candidates))
        return sorted(newest_first, key=lambda r: -self.served.get(self.tenant(r), 0.0))

    def pick_admission_victim(self, running: list[Request], waiting: Request) -> Request | None:
        """Displace a request of a tenant holding more than its share of the running slots."""
        tenant = self.tenant(waiting)
        counts: dict[str, int] = {}
        for r in running:
            counts[self.tenant(r)] = counts.get(self.tenant(r), 0) + 1
        mine = counts.get(tenant, 0)
        over = [r for r in running if preemptible(r) and r.priority >= waiting.priority
                and counts[self.tenant(r)] > mine + 1
                and self.served.get(self.tenant(r), 0.0) > self.served.get(tenant, 0.0)]
        ordered = self.victim_order(over)
        return ordered[0] if ordered else None


POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": FCFSPolicy, "priority": PriorityPolicy, "fair": FairPolicy}


def make_policy(config: SchedulerConfig) -> SchedulingPolicy:
    try:
        cls = POLICIES[config.policy]
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {config.policy!r}") \
            from None
    return cls(config)

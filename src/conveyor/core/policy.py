"""Admission and preemption policies: who waits in front, and who yields blocks.

A policy owns the waiting queue. ``Scheduler.schedule()`` asks it for the next request to
admit and, when blocks run out, for a victim; it never branches on which policy it has.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from conveyor.request import Request


class SchedulingPolicy(ABC):
    """The waiting queue plus the choice of preemption victim."""

    name: str

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
    def pop(self) -> Request:
        """Remove and return ``peek()``."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Drop a waiting request (abort)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def pick_victim(self, running: list[Request], needing: Request) -> Request | None:
        """The running request to preempt so ``needing`` can proceed, or None to preempt
        ``needing`` itself. Default: the most recently admitted request (recompute loses
        the least shared work and the oldest requests keep their progress)."""
        return running[-1] if running[-1] is not needing else None


class FCFSPolicy(SchedulingPolicy):
    """First come, first served; preempted requests go back to the front."""

    name = "fcfs"

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def requeue(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


POLICIES: dict[str, type[SchedulingPolicy]] = {"fcfs": FCFSPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}") from None

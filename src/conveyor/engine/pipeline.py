"""The steps handed to the model runner whose results the engine has not taken yet.

Synchronous (the default): a step runs when it is submitted, and its results are taken
next. With ``async_scheduling`` (vLLM's name) the engine submits step N+1 before it takes
step N's results: the runner launches N+1 (on a GPU its kernels queue behind N's) and the
engine then waits for N's tokens, takes them (the scheduler's update, detokenization, stop
checks, streaming) and schedules N+2, all while the device runs N+1. The scheduler's side of
that (placeholders for the tokens N samples) is in ``core/scheduler.py``; the runner's (N+1
reads N's tokens on the device) in ``runner/model_runner.py``. One thread does it all.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from conveyor.core.outputs import ModelRunnerOutput, SchedulerOutput


class Pending(Protocol):
    """What the runner returns for a step it launched (``ModelRunner.launch``)."""

    def result(self) -> ModelRunnerOutput: ...  # waits for the step's tokens


@dataclass
class Submitted:
    """A step handed to the runner: what it runs, when it was scheduled, its results (or the
    error its launch raised)."""

    out: SchedulerOutput
    start: float  # perf_counter() before it was scheduled
    pending: Pending | None
    error: Exception | None = None

    def result(self) -> ModelRunnerOutput:
        if self.error is not None:
            raise self.error
        assert self.pending is not None
        return self.pending.result()


class _Done:
    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output


class StepPipeline:
    def __init__(self, execute: Callable[[SchedulerOutput], ModelRunnerOutput],
                 launch: Callable[[SchedulerOutput], Pending] | None) -> None:
        """``execute`` runs a step and returns its results; with ``launch`` (async
        scheduling) steps are launched one ahead of their results instead."""
        self._execute = execute
        self._launch = launch
        self._queue: deque[Submitted] = deque()
        # The requests of the last step whose launch raised: the step after it was
        # scheduled before the failure was known, and must not run them
        self._failed: set[str] = set()

    def submit(self, out: SchedulerOutput, start: float) -> None:
        if self._failed:  # the engine ends those requests: their state may be broken
            failed, self._failed = self._failed, set()
            out = dataclasses.replace(
                out, scheduled=[s for s in out.scheduled if s.request_id not in failed],
                new_requests=[r for r in out.new_requests if r.request_id not in failed],
                finished_request_ids=out.finished_request_ids | failed)
        try:
            pending = (self._launch(out) if self._launch is not None
                       else _Done(self._execute(out)))
        except Exception as error:  # the engine's step() sees it when it takes the step
            if self._launch is not None:
                self._failed = {s.request_id for s in out.scheduled}
            self._queue.append(Submitted(out, start, None, error))
            return
        self._queue.append(Submitted(out, start, pending))

    @property
    def ready(self) -> bool:
        """Whether the oldest step's results are due: at once when synchronous; with
        async scheduling once the next step is launched too."""
        return len(self._queue) >= (2 if self._launch is not None else 1)

    def take(self) -> Submitted:
        """The oldest step (``result()`` waits for its tokens)."""
        return self._queue.popleft()

    def __len__(self) -> int:
        return len(self._queue)

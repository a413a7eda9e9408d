"""The steps handed to the model runner whose results the engine has not taken yet.

Synchronous (the default): a step runs when it is submitted, and its results are taken
next. With ``async_scheduling`` (vLLM's name) a worker thread runs the steps in submission
order while the engine thread schedules the next one and takes the last one's results
(``update``, detokenization, stop checks, streaming): the engine submits step N+1 before it
takes step N's, so that host work overlaps N+1's forward pass instead of leaving the device
idle between steps. The scheduler's side of that (placeholders for the tokens N samples) is
in ``core/scheduler.py``; the runner needs nothing new: it keeps each request's tokens
itself, so N+1's input is N's sample by the time N+1 runs.

On CPU only one thread may keep OpenMP workers (``ops/openmp.py``): when a burst of steps
starts, the engine thread gives back the pool it made loading the model (or running another
engine), and when the engine goes idle the worker gives back its own.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from conveyor.core.outputs import ModelRunnerOutput, SchedulerOutput
from conveyor.ops.openmp import release_openmp_threads

Execute = Callable[[SchedulerOutput], ModelRunnerOutput]


@dataclass
class Submitted:
    """A step handed to the runner: what it runs, when it was scheduled, its results."""

    out: SchedulerOutput
    start: float  # perf_counter() before it was scheduled
    result: Future[ModelRunnerOutput]


class StepPipeline:
    def __init__(self, execute: Execute, async_scheduling: bool) -> None:
        self._execute = execute
        self._worker = (ThreadPoolExecutor(1, thread_name_prefix="conveyor-runner")
                        if async_scheduling else None)
        self._queue: deque[Submitted] = deque()
        # The requests of the last step that raised (worker thread only): the step after it
        # was scheduled before the failure was known, and must not run them
        self._failed: set[str] = set()

    def submit(self, out: SchedulerOutput, start: float) -> None:
        if self._worker is not None:
            if not self._queue:  # a burst starts: the forward passes' OpenMP pool only
                release_openmp_threads()
            result = self._worker.submit(self._run_after_failure, out)
        else:
            result = Future()
            try:
                result.set_result(self._execute(out))
            except Exception as error:  # the engine's step() sees it when it takes it
                result.set_exception(error)
        self._queue.append(Submitted(out, start, result))

    @property
    def ready(self) -> bool:
        """Whether the oldest step's results are due: at once when synchronous; with
        async scheduling once the next step is submitted too."""
        return len(self._queue) >= (2 if self._worker is not None else 1)

    def take(self) -> Submitted:
        """The oldest step (its ``result`` may still be running: wait on it)."""
        step = self._queue.popleft()
        if self._worker is not None and not self._queue:  # idle: the worker's pool goes
            self._worker.submit(release_openmp_threads)
        return step

    def __len__(self) -> int:
        return len(self._queue)

    def shutdown(self) -> None:
        """Wait for the steps in flight and stop the worker (idempotent)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def _run_after_failure(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self._failed:  # the engine ends those requests: their state may be broken
            failed, self._failed = self._failed, set()
            out = dataclasses.replace(
                out, scheduled=[s for s in out.scheduled if s.request_id not in failed],
                new_requests=[r for r in out.new_requests if r.request_id not in failed],
                finished_request_ids=out.finished_request_ids | failed)
        try:
            return self._execute(out)
        except Exception:
            self._failed = {s.request_id for s in out.scheduled}
            raise

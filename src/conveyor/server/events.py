"""The live engine view's data: step summaries for `GET /v1/engine/events` (Server-Sent Events).

The engine's loop thread hands every step's `StepTrace` to `EngineEvents.on_trace` and every
loop iteration's outputs to `on_step`. With no subscriber, `on_trace` returns at once and
`on_step` only notes finished requests' latencies (for the percentiles over the last minute).
With subscribers, a step costs one small record appended under a lock, plus a block map
snapshot at most once per `PUBLISH_INTERVAL_S`. A task on the event loop wakes every
`PUBLISH_INTERVAL_S`, coalesces the records since its last turn into one event, serialises it
once and queues it for every subscriber; a subscriber that falls behind loses its oldest
events (its queue is bounded), and the engine never waits for one.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from conveyor.bench.palette import CATEGORIES
from conveyor.core.kv_cache_manager import BlockMap
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.stats import EngineStats, StepTrace
from conveyor.outputs import RequestOutput

logger = logging.getLogger(__name__)

# Seconds between two events: the page redraws at this rate; steps in between are coalesced.
PUBLISH_INTERVAL_S = 0.2
# Most step records one event carries; older ones are dropped (and counted) beyond it.
MAX_STEPS_PER_EVENT = 512
# Events a subscriber may have unread before its oldest are dropped.
SUBSCRIBER_QUEUE_EVENTS = 16
# The latency percentiles cover requests that finished within this many seconds.
LATENCY_WINDOW_S = 60.0
# Generation tokens per second are counted over this many seconds.
RATE_WINDOW_S = 2.0
# The most finished requests the percentiles keep (a bound on memory when no page reads them).
MAX_LATENCY_SAMPLES = 10_000
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class StepSummary:
    """One engine step as the page draws it (a `StepTrace`, lighter)."""

    step: int
    time: float  # Unix time the step began (seconds)
    duration_ms: float
    # (request id, tokens, "prefill" | "decode" | "verify": StepTrace's kinds)
    scheduled: tuple[tuple[str, int, str], ...]
    preempted: tuple[str, ...]
    # Request ids waiting after this step that were not waiting after the previous one
    # recorded (new requests, preempted ones back in the queue; after a stream opens, every
    # waiting one, for the newcomer): the page marks them waiting until they run, so the full
    # waiting list need not travel every step.
    arrived: tuple[str, ...]
    finished: tuple[str, ...]
    num_waiting: int
    kv_blocks_used: int


@dataclass(frozen=True)
class Percentiles:
    """Latency percentiles over the requests that finished in the last LATENCY_WINDOW_S."""

    count: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None


@dataclass(frozen=True)
class EngineInfo:
    """The first event of every stream: what does not change while the server runs."""

    model: str
    kv_blocks_total: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    publish_interval_s: float
    latency_window_s: float
    categories: tuple[tuple[int, str, str], ...]  # the timeline's (value, label, colour)
    type: str = "info"


@dataclass(frozen=True)
class StepsEvent:
    """Every later event: the steps since the previous event and the engine's state now."""

    time: float  # Unix time of the event
    steps: tuple[StepSummary, ...]
    dropped_steps: int  # steps left out of `steps` (more than MAX_STEPS_PER_EVENT)
    num_requests_running: int
    num_requests_waiting: int
    kv_blocks_used: int
    num_preemptions: int
    generation_tokens_per_s: float  # over the last RATE_WINDOW_S
    ttft: Percentiles  # time to first token
    tpot: Percentiles  # time per output token after the first (per request, its mean)
    block_map: BlockMap | None  # None when no step ran since the previous event
    # Requests that finished since the previous event, including those aborted between steps
    # (a step's `finished` has only those that finished in it); the engine's ids of the API's
    # requests (the response's id, "-" and a random suffix), whose samples are "ID#i" in the
    # steps when n > 1.
    ended: tuple[str, ...]
    num_subscribers: int  # streams open on /v1/engine/events, this one included
    type: str = "steps"


# Dataclasses become their fields' dict, without the deep copy of dataclasses.asdict (8x
# slower: this runs on the event loop five times a second, beside the engine's thread).
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=vars)


def sse(event: str, payload: object) -> str:
    """One Server-Sent Event whose data is `payload` (a dataclass) as JSON on one line."""
    return f"event: {event}\ndata: {_ENCODER.encode(payload)}\n\n"


class Subscriber:
    """One open events stream: a bounded queue of serialised events (None: the end)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[str | None] = asyncio.Queue(SUBSCRIBER_QUEUE_EVENTS)

    def put(self, item: str | None) -> None:
        if self.queue.full():
            self.queue.get_nowait()  # the oldest event goes; the newest carries the state
        self.queue.put_nowait(item)


class EngineEvents:
    """Collects step records in the loop thread; publishes them to subscribers."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._subscribers: set[Subscriber] = set()  # event loop only
        self._num_subscribers = 0  # read by the loop thread: records are kept only if > 0
        self._lock = threading.Lock()  # guards the five fields below
        self._steps: collections.deque[StepSummary] = collections.deque(maxlen=MAX_STEPS_PER_EVENT)
        self._num_steps_recorded = 0  # since the last publish (dropped ones included)
        self._block_map: BlockMap | None = None
        self._ended: list[str] = []
        # (finished at, ttft s, tpot s) of finished requests
        self._latencies: collections.deque[tuple[float, float | None, float | None]] = (
            collections.deque(maxlen=MAX_LATENCY_SAMPLES))
        self._rates: collections.deque[tuple[float, int]] = collections.deque()  # event loop
        self._prev_waiting: frozenset[str] = frozenset()  # loop thread only
        # Set by a new subscriber (event loop), taken by the loop thread: the next step lists
        # every waiting request as arrived, so the newcomer learns of those already waiting.
        self._resend_waiting = False
        self._last_map_time = 0.0  # loop thread only
        # StepTrace.time is perf_counter(); the page wants wall-clock times.
        self._clock_offset = time.time() - time.perf_counter()
        self._closed = False

    # ------------------------------------------------------------------ the loop thread
    def on_trace(self, trace: StepTrace) -> None:
        """Record one step if anyone watches (LLMEngine.trace_listener; never raises)."""
        if not self._num_subscribers:
            self._prev_waiting = frozenset()
            return
        try:
            self._record(trace)
        except Exception:  # the live view must never take the engine down
            logger.exception("recording a step for the live view failed")

    def _record(self, trace: StepTrace) -> None:
        if self._resend_waiting:
            self._resend_waiting = False
            self._prev_waiting = frozenset()
        waiting = frozenset(trace.waiting)
        summary = StepSummary(
            trace.step, trace.time + self._clock_offset, trace.duration * 1e3,
            tuple((e.request_id, e.num_new_tokens, e.kind) for e in trace.scheduled),
            trace.preempted, tuple(r for r in trace.waiting if r not in self._prev_waiting),
            trace.finished, len(waiting), trace.kv_blocks_used)
        self._prev_waiting = waiting
        block_map = None
        now = time.perf_counter()
        if now - self._last_map_time >= PUBLISH_INTERVAL_S:
            self._last_map_time = now
            block_map = self.engine.engine.block_map()
        with self._lock:
            self._steps.append(summary)
            self._num_steps_recorded += 1
            if block_map is not None:
                self._block_map = block_map

    def on_step(self, outputs: list[RequestOutput], stats: EngineStats, now: float) -> None:
        """Note the requests that finished and their latencies (an AsyncEngine listener)."""
        for output in outputs:
            if not output.finished:
                continue
            if self._num_subscribers:
                with self._lock:
                    self._ended.append(output.request_id)
            m, n = output.metrics, output.metrics.num_generation_tokens
            tpot = None
            if n > 1 and m.first_token_time is not None and m.finished_time is not None:
                tpot = (m.finished_time - m.first_token_time) / (n - 1)
            with self._lock:
                self._latencies.append((now, m.time_to_first_token, tpot))

    # ------------------------------------------------------------------ the event loop
    def info(self) -> EngineInfo:
        llm = self.engine.engine
        sched = llm.scheduler_config
        return EngineInfo(self.engine.model_name, self.engine.stats.kv_blocks_total,
                          llm.kv_layout.block_size, sched.max_num_seqs,
                          sched.max_num_batched_tokens, PUBLISH_INTERVAL_S, LATENCY_WINDOW_S,
                          CATEGORIES)

    async def stream(self) -> AsyncIterator[str]:
        """The SSE text of one subscriber: the info event, then one event per publish, until
        the server stops. Leaving early (the client went away) unsubscribes."""
        subscriber = Subscriber()
        self._subscribers.add(subscriber)
        self._num_subscribers = len(self._subscribers)
        self._resend_waiting = True
        try:
            yield sse("info", self.info())
            while not self._closed:
                item = await subscriber.queue.get()
                if item is None:
                    return
                yield item
        finally:
            self._subscribers.discard(subscriber)
            self._num_subscribers = len(self._subscribers)

    async def run(self) -> None:
        """The publisher task (started with the app); ends the streams when the engine stops
        accepting requests, so that a graceful shutdown does not wait for open pages."""
        while self.engine.is_accepting:
            await asyncio.sleep(PUBLISH_INTERVAL_S)
            if not self._subscribers:
                continue
            try:
                self.publish()
            except Exception:  # a bug here must not end the publishing
                logger.exception("publishing the live view's event failed")
        self.close()

    def close(self) -> None:
        self._closed = True
        for subscriber in self._subscribers:
            subscriber.put(None)

    def publish(self) -> None:
        """Coalesce the steps recorded since the last publish into one event for everyone."""
        with self._lock:
            steps, num_recorded = tuple(self._steps), self._num_steps_recorded
            block_map, self._block_map = self._block_map, None
            ended, self._ended = tuple(self._ended), []
            self._steps.clear()
            self._num_steps_recorded = 0
        now = time.time()
        stats = self.engine.stats
        event = StepsEvent(
            now, steps, num_recorded - len(steps), stats.num_requests_running,
            stats.num_requests_waiting, stats.kv_blocks_total - stats.kv_blocks_free,
            stats.num_preemptions, self._token_rate(now, stats.num_generation_tokens),
            *self._latency_percentiles(now), block_map, ended, len(self._subscribers))
        text = sse("steps", event)
        for subscriber in self._subscribers:
            subscriber.put(text)

    def _token_rate(self, now: float, num_tokens: int) -> float:
        rates = self._rates
        rates.append((now, num_tokens))
        while len(rates) > 2 and now - rates[1][0] >= RATE_WINDOW_S:
            rates.popleft()
        (t0, n0), (t1, n1) = rates[0], rates[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def _latency_percentiles(self, now: float) -> tuple[Percentiles, Percentiles]:
        with self._lock:
            latencies = self._latencies
            while latencies and now - latencies[0][0] > LATENCY_WINDOW_S:
                latencies.popleft()
            window = list(latencies)
        return (_percentiles([t for _, t, _ in window if t is not None]),
                _percentiles([t for _, _, t in window if t is not None]))


def _percentiles(seconds: list[float]) -> Percentiles:
    if not seconds:
        return Percentiles(0, None, None, None)
    p50, p90, p99 = (float(v) * 1e3 for v in np.percentile(seconds, PERCENTILES))
    return Percentiles(len(seconds), p50, p90, p99)

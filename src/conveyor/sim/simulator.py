"""The discrete-event simulator of `conveyor simulate`: the engine's own scheduler on a clock.

Each replica is the real ``core/`` stack, ``Scheduler`` (with its policy) over a
``KVCacheManager``, unchanged, driven the way ``LLMEngine.step`` drives it: schedule, run,
update. The model runner is replaced by a step that returns one token per request that
reached the end of its input and advances the replica's virtual clock by the cost model's
price of the step. A request ends at EOS where its workload says (``SimRequest.eos_at``:
`bench serve` without ``--ignore-eos``), else by length at its ``max_tokens``. ``n > 1``
runs as the engine runs it: n requests sharing the prompt, samples 2..n queued once the
first has computed the prompt (its blocks are then cached and shared).

The client is `bench serve`'s: a request is sent at its arrival time, or, under
``max_concurrency``, when a slot frees; it may cancel the stream after a given number of
tokens (``abort_after``), which aborts it in the engine at the next step boundary. The
cost model may price the server's own work: a per-request front-end time (a serial queue
per replica before the engine sees the request) and per-token work inside the step.

Several replicas sit behind a router; events are processed in time order: a client event
(an arrival, a finished request freeing a concurrency slot) is handled once every busy
replica's clock has reached it, otherwise the replica whose clock is furthest behind runs
its next step. Requests arriving while a step runs join at the next step boundary, as in
the engine.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from conveyor.bench.metrics import RequestRecord
from conveyor.config import SchedulerConfig
from conveyor.core.block_pool import hash_block
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.outputs import ModelRunnerOutput, SchedulerOutput
from conveyor.core.scheduler import Scheduler
from conveyor.engine.stats import ScheduledEntry, StepTrace
from conveyor.request import Request, RequestStatus
from conveyor.sampling_params import SamplingParams
from conveyor.sim.cost import CostModel, StepShape

ROUTING_POLICIES = ("round-robin", "least-loaded", "prefix-affinity")


@dataclass(frozen=True)
class SimSetup:
    """One replica's engine: its scheduler settings and KV cache geometry."""

    scheduler: SchedulerConfig
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    num_swap_blocks: int = 0
    eos_token_ids: tuple[int, ...] = ()
    output_token: int = 0  # the token every simulated step samples (not an EOS)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory holds no KV block (num_blocks={self.num_blocks})")
        if self.output_token in self.eos_token_ids:
            raise ValueError(f"output_token {self.output_token} is an EOS token")

    @property
    def end_token(self) -> int:
        """The token a request ends with at its EOS: the model's EOS, else one past the
        output token, made a stop token id (a model without EOS)."""
        return self.eos_token_ids[0] if self.eos_token_ids else self.output_token + 1

    def sampling_params(self, max_tokens: int, ignore_eos: bool) -> SamplingParams:
        stop = () if self.eos_token_ids or ignore_eos else (self.end_token,)
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos,
                              stop_token_ids=stop)

    def build_scheduler(self) -> Scheduler:
        cfg = self.scheduler
        reserve = cfg.max_model_len if cfg.kv_allocation == "reserve" else None
        kv = KVCacheManager(self.num_blocks, self.block_size, self.enable_prefix_caching,
                            self.num_swap_blocks, reserve_tokens=reserve)
        return Scheduler(cfg, kv)


@dataclass
class SimRequest:
    """One request of the workload and what happened to it."""

    request_id: str
    arrival: float  # virtual seconds since the start
    prompt_token_ids: list[int]
    output_len: int  # max_tokens
    # Per sample, the output token (1-based) that is an EOS; empty: none (--ignore-eos)
    eos_at: tuple[int, ...] = ()
    n: int = 1  # parallel samples of the prompt
    abort_after: int | None = None  # the client cancels after this many tokens (0: at once)
    record: RequestRecord = field(default_factory=lambda: RequestRecord(success=False))
    replica: int = -1
    sent: float = 0.0  # when the client sent it (later than arrival under max_concurrency)
    admit_at: float = 0.0  # when the engine sees it (after the server's front-end time)
    last_token: float | None = None
    num_streamed: int = 0  # tokens streamed so far, all samples

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.eos_at and len(self.eos_at) != self.n:
            raise ValueError(f"eos_at needs one length per sample ({self.n}), got "
                             f"{len(self.eos_at)}")


@dataclass(frozen=True)
class StepSample:
    """A replica's state after one step (for the over-time figures)."""

    time: float  # virtual seconds at the end of the step
    kv_blocks_used: int
    num_waiting: int
    num_running: int


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """The arrival offsets `bench serve` sends at: gamma gaps (shape = burstiness, mean =
    1/rate) from the same seeded generator, in the same order; all 0 for an infinite rate."""
    if not math.isfinite(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    scale = 1.0 / (rate * burstiness)
    times, now = [], 0.0
    for i in range(n):
        times.append(now)
        if i + 1 < n:
            now += float(rng.gamma(shape=burstiness, scale=scale))
    return times


@dataclass
class _Group:
    """A request inside a replica: its samples (as the engine's RequestGroup)."""

    sim: SimRequest
    live: set[str]  # sample request ids the scheduler holds
    pending: list[Request]  # samples 2..n, queued once the first has its first token


class Replica:
    """One simulated engine: the real scheduler, a virtual clock and a cost model."""

    def __init__(self, index: int, setup: SimSetup, cost: CostModel,
                 trace_ids: frozenset[str] | None = None) -> None:
        self.index = index
        self.setup = setup
        self.cost = cost
        self.scheduler = setup.build_scheduler()
        self.clock = 0.0
        self.incoming: deque[SimRequest] = deque()
        self.groups: dict[str, _Group] = {}
        self._owner: dict[str, tuple[_Group, int]] = {}  # sample id -> (group, index)
        self.ended: list[SimRequest] = []  # requests that ended since the client last looked
        self.samples: list[StepSample] = []
        self.trace: list[StepTrace] | None = None if trace_ids is None else []
        self.trace_ids = trace_ids or frozenset()
        self.busy_time = 0.0
        self._frontend_free = 0.0
        self._stall = 0.0  # front-end time to add to the next step (see _admit_arrived)
        self._idle_since: float | None = 0.0  # when the engine last ran out of work
        self._empty_steps = 0

    @property
    def busy(self) -> bool:
        return bool(self.incoming) or self.scheduler.has_unfinished_requests()

    @property
    def load(self) -> int:
        """Requests routed here and not finished."""
        return len(self.incoming) + len(self.groups)

    def submit(self, request: SimRequest) -> None:
        """The request reaches the server at request.sent; its front end (one at a time)
        hands it to the engine after the cost model's per-request time."""
        request.replica = self.index
        request.admit_at = max(request.sent, self._frontend_free) + self.cost.request_time_s
        self._frontend_free = request.admit_at
        self.incoming.append(request)

    def _admit_arrived(self) -> None:
        """Hand the engine what the front end has finished. The front end shares the
        process (and its GIL) with the engine loop: a request it handled while the engine
        was running steps delays the engine by its front-end time."""
        if not self.scheduler.has_unfinished_requests() and self.incoming:
            self.clock = max(self.clock, self.incoming[0].admit_at)
        while self.incoming and self.incoming[0].admit_at <= self.clock:
            if self.scheduler.has_unfinished_requests():
                self._stall += self.cost.request_time_s
            self._admit(self.incoming.popleft())

    def _admit(self, sim: SimRequest) -> None:
        """Queue the request's samples as LLMEngine.add_request does."""
        params = self.setup.sampling_params(sim.output_len, ignore_eos=not sim.eos_at)
        samples = [Request(sim.request_id if sim.n == 1 else f"{sim.request_id}#{i}",
                           sim.prompt_token_ids, params, eos_token_ids=self.setup.eos_token_ids,
                           max_model_len=self.setup.scheduler.max_model_len)
                   for i in range(sim.n)]
        try:
            self.scheduler.check_fits(samples[0])  # as the engine refuses it
        except ValueError as e:
            sim.record.error = f"rejected: {e}"
            self._end(sim, self.clock)
            return
        caching = self.scheduler.kv_cache.enable_caching
        group = _Group(sim, set(), samples[1:] if caching else [])
        self.groups[sim.request_id] = group
        for i, request in enumerate(samples):
            self._owner[request.request_id] = (group, i)
        for request in samples[:1] if caching else samples:
            self._add(group, request)

    def _add(self, group: _Group, request: Request) -> None:
        self.scheduler.add_request(request)
        group.live.add(request.request_id)

    def step(self) -> None:
        """Admit what has arrived, then run one scheduler step on the clock."""
        self._admit_arrived()
        if not self.scheduler.has_unfinished_requests():
            return
        out = self.scheduler.schedule()
        self._empty_steps = self._empty_steps + 1 if out.is_empty else 0
        if self._empty_steps > 2:
            raise RuntimeError("the scheduler scheduled nothing three steps in a row")
        start = self.clock
        duration = self.cost.step_time(StepShape.of(out)) + self._stall
        if self._idle_since is not None:  # the first step after an idle spell
            duration += self.cost.idle_time(start - self._idle_since)
            self._idle_since = None
        self._stall = 0.0
        self.clock += duration
        self.busy_time += duration
        sampled = {item.request_id: [self._next_token(item.request_id)]
                   for item in out.scheduled if item.samples}
        updated = self.scheduler.update(out, ModelRunnerOutput(sampled_token_ids=sampled))
        finished = [r.request_id for r in updated if r.status.finished]
        by_group: dict[str, list[Request]] = {}
        for request in updated:
            by_group.setdefault(self._owner[request.request_id][0].sim.request_id,
                                []).append(request)
        for request_id, requests in by_group.items():
            self._on_tokens(self.groups[request_id], requests)
        kv = self.scheduler.kv_cache
        used = kv.num_blocks - kv.num_free_blocks
        self.samples.append(StepSample(self.clock, used, self.scheduler.num_waiting,
                                       self.scheduler.num_running))
        if not self.scheduler.has_unfinished_requests():
            self._idle_since = self.clock
        if self.trace is not None:
            self._trace_step(out, start, duration, finished, used)

    def _next_token(self, request_id: str) -> int:
        """The sample's next token: the end token where its EOS is due, else a plain one."""
        group, index = self._owner[request_id]
        eos_at = group.sim.eos_at
        request = self.scheduler.requests[request_id]
        due = eos_at and request.num_output_tokens + 1 >= eos_at[index]
        return self.setup.end_token if due else self.setup.output_token

    def _on_tokens(self, group: _Group, updated: list[Request]) -> None:
        """This step's tokens of one request's samples: stream them (one chunk per step,
        as the client times it), queue the waiting samples, end it when all are done or
        the client cancels."""
        sim, record, now = group.sim, group.sim.record, self.clock
        if sim.last_token is None:
            record.ttft = now - sim.sent
        else:
            record.itl.append(now - sim.last_token)
        sim.last_token = now
        sim.num_streamed += len(updated)
        for request in updated:
            if request.status.finished:
                group.live.discard(request.request_id)
                record.output_tokens += request.num_output_tokens
        if group.pending:  # the prompt's blocks are cached now: the samples share them
            for request in group.pending:
                self._add(group, request)
            group.pending.clear()
        if sim.abort_after is not None and sim.num_streamed >= sim.abort_after \
                and group.live:
            self.scheduler.finish_requests(sorted(group.live), RequestStatus.FINISHED_ABORTED)
            group.live.clear()
            record.aborted = True
        if not group.live:
            record.success = not record.aborted
            record.latency = now - sim.sent
            self._end(sim, now)

    def _end(self, sim: SimRequest, now: float) -> None:
        sim.record.end_time = now
        group = self.groups.pop(sim.request_id, None)
        if group is not None:
            for i in range(sim.n):
                self._owner.pop(sim.request_id if sim.n == 1 else f"{sim.request_id}#{i}")
        self.ended.append(sim)

    def _trace_step(self, out: SchedulerOutput, start: float, duration: float,
                    finished: list[str], used: int) -> None:
        """A StepTrace (the engine's record) restricted to the traced requests."""
        assert self.trace is not None

        def traced(request_id: str) -> bool:  # a sample "id#i" is traced with its request
            return request_id.partition("#")[0] in self.trace_ids

        self.trace.append(StepTrace(
            step=out.step_id, time=start, duration=duration,
            scheduled=tuple(ScheduledEntry(s.request_id, s.num_new_tokens,
                                           "decode" if s.num_new_tokens == 1
                                           and s.num_computed_tokens else "prefill")
                            for s in out.scheduled if traced(s.request_id)),
            preempted=tuple(sorted(i for i in out.preempted_request_ids if traced(i))),
            waiting=tuple(r.request_id for r in self.scheduler.policy if traced(r.request_id)),
            finished=tuple(i for i in finished if traced(i)),
            kv_blocks_used=used, kv_blocks_total=self.scheduler.kv_cache.num_blocks))


class Router:
    """Sends each arriving request to a replica."""

    def __init__(self, policy: str, replicas: Sequence[Replica], block_size: int) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}, "
                             f"got {policy!r}")
        self.policy = policy
        self.replicas = list(replicas)
        self.block_size = block_size
        self._next = 0
        self._prefixes: list[set[int]] = [set() for _ in replicas]  # block-chain hashes seen

    def route(self, request: SimRequest) -> Replica:
        if self.policy == "round-robin":
            replica = self.replicas[self._next % len(self.replicas)]
            self._next += 1
            return replica
        least = min(self.replicas, key=lambda r: (r.load, r.index))
        if self.policy == "least-loaded":
            return least
        return self._by_prefix(request, least)

    def _by_prefix(self, request: SimRequest, fallback: Replica) -> Replica:
        """The replica that has seen the longest prefix of whole blocks of this prompt (its
        prefix cache likely holds it); the least loaded one when none has."""
        bs, tokens = self.block_size, request.prompt_token_ids
        chain, parent = [], None
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = hash_block(parent, tokens[start:start + bs])
            chain.append(hash(parent))
        best, best_len = fallback, 0
        for replica, seen in zip(self.replicas, self._prefixes, strict=True):
            matched = next((i for i, h in enumerate(chain) if h not in seen), len(chain))
            if matched > best_len:
                best, best_len = replica, matched
        self._prefixes[best.index].update(chain)
        return best


class Client:
    """`bench serve`'s client: sends each request at its arrival, or when a slot frees under
    `max_concurrency` (first come, first served), and cancels a request at once when its
    abort point is 0 (it never reaches the engine; later ones abort inside the replica)."""

    def __init__(self, requests: Sequence[SimRequest], max_concurrency: int | None) -> None:
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
        self.limit = max_concurrency or len(requests) or 1
        self.in_flight = 0
        self.blocked: deque[SimRequest] = deque()
        self._order = itertools.count()
        # (time, 0 for a request ending / 1 for an arrival, order, request): an end at t
        # frees its slot before an arrival at t takes one.
        self.events: list[tuple[float, int, int, SimRequest]] = [
            (r.arrival, 1, next(self._order), r) for r in requests]
        heapq.heapify(self.events)

    @property
    def next_time(self) -> float | None:
        return self.events[0][0] if self.events else None

    def ended(self, request: SimRequest) -> None:
        heapq.heappush(self.events, (request.record.end_time, 0, next(self._order), request))

    def handle_next(self) -> list[SimRequest]:
        """Process the earliest event; the requests to send now (their `sent` set)."""
        now, kind, _, request = heapq.heappop(self.events)
        if kind == 0:
            self.in_flight -= 1
        else:
            self.blocked.append(request)
        sent = []
        while self.blocked and self.in_flight < self.limit:
            request = self.blocked.popleft()
            request.sent = request.record.start_time = now
            self.in_flight += 1
            if request.abort_after == 0:  # cancelled as soon as the response starts
                request.record.aborted = True
                request.record.end_time = now
                self.ended(request)
            else:
                sent.append(request)
        return sent


@dataclass
class SimRun:
    """A finished simulation: every request's record and every replica's history."""

    requests: list[SimRequest]
    replicas: list[Replica]
    duration_s: float  # virtual: first arrival to the last token
    wall_s: float  # real seconds the simulation took

    @property
    def records(self) -> list[RequestRecord]:
        return [r.record for r in self.requests]


def simulate(setup: SimSetup, cost: CostModel, requests: Sequence[SimRequest],
             num_replicas: int = 1, routing: str = "round-robin",
             trace_ids: frozenset[str] | None = None,
             max_concurrency: int | None = None) -> SimRun:
    """Run the requests through `num_replicas` simulated engines behind `bench serve`'s
    client (see Client)."""
    if num_replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {num_replicas}")
    wall = time.perf_counter()
    replicas = [Replica(i, setup, cost, trace_ids) for i in range(num_replicas)]
    router = Router(routing, replicas, setup.block_size)
    for sim in requests:
        sim.record = RequestRecord(success=False, prompt_len=len(sim.prompt_token_ids),
                                   start_time=sim.arrival)
    client = Client(requests, max_concurrency)
    while True:
        busy = [r for r in replicas if r.busy]
        laggard = min(busy, key=lambda r: (r.clock, r.index), default=None)
        now = client.next_time
        if now is not None and (laggard is None or now <= laggard.clock):
            for sim in client.handle_next():
                router.route(sim).submit(sim)
        elif laggard is not None:
            laggard.step()
            for sim in laggard.ended:
                client.ended(sim)
            laggard.ended.clear()
        else:
            break
    for replica in replicas:
        replica.scheduler.check_integrity()  # every KV block is free again
    end = max((r.record.end_time for r in requests), default=0.0)
    start = min((r.arrival for r in requests), default=0.0)
    return SimRun(list(requests), replicas, end - start, time.perf_counter() - wall)

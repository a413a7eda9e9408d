"""The discrete-event simulator of `conveyor simulate`: the engine's own scheduler on a clock.

Each replica is the real ``core/`` stack, ``Scheduler`` (with its policy) over a
``KVCacheManager``, unchanged, driven the way ``LLMEngine.step`` drives it: schedule, run,
update. The model runner is replaced by a step that returns one token per request that
reached the end of its input and advances the replica's virtual clock by the cost model's
price of the step. Requests end by length at their dataset output length (the benchmark
sends it as ``max_tokens``; run the real benchmark with ``--ignore-eos`` to compare).

Several replicas sit behind a router; events are processed in time order: an arrival is
routed once every busy replica's clock has reached it, otherwise the replica whose clock
is furthest behind runs its next step. Requests arriving while a step runs join at the
next step boundary, as in the engine.
"""

from __future__ import annotations

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
from conveyor.request import Request
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
    record: RequestRecord = field(default_factory=lambda: RequestRecord(success=False))
    replica: int = -1
    last_token: float | None = None


@dataclass
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
        self.live: dict[str, SimRequest] = {}
        self.samples: list[StepSample] = []
        self.trace: list[StepTrace] | None = None if trace_ids is None else []
        self.trace_ids = trace_ids or frozenset()
        self.busy_time = 0.0
        self._empty_steps = 0

    @property
    def busy(self) -> bool:
        return bool(self.incoming) or self.scheduler.has_unfinished_requests()

    @property
    def load(self) -> int:
        """Requests routed here and not finished."""
        return len(self.incoming) + len(self.live)

    def submit(self, request: SimRequest) -> None:
        request.replica = self.index
        self.incoming.append(request)

    def _admit_arrived(self) -> None:
        if not self.scheduler.has_unfinished_requests() and self.incoming:
            self.clock = max(self.clock, self.incoming[0].arrival)
        while self.incoming and self.incoming[0].arrival <= self.clock:
            sim = self.incoming.popleft()
            params = SamplingParams(max_tokens=sim.output_len, temperature=0.0)
            request = Request(sim.request_id, sim.prompt_token_ids, params,
                              eos_token_ids=self.setup.eos_token_ids,
                              max_model_len=self.setup.scheduler.max_model_len)
            try:
                self.scheduler.add_request(request)  # check_fits: as the engine refuses it
            except ValueError as e:
                sim.record.error = f"rejected: {e}"
                sim.record.end_time = sim.arrival
                continue
            self.live[sim.request_id] = sim

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
        duration = self.cost.step_time(StepShape.of(out))
        self.clock += duration
        self.busy_time += duration
        token = self.setup.output_token
        sampled = {item.request_id: [token] for item in out.scheduled if item.samples}
        updated = self.scheduler.update(out, ModelRunnerOutput(sampled_token_ids=sampled))
        finished = [self._on_token(r) for r in updated]
        kv = self.scheduler.kv_cache
        used = kv.num_blocks - kv.num_free_blocks
        self.samples.append(StepSample(self.clock, used, self.scheduler.num_waiting,
                                       self.scheduler.num_running))
        if self.trace is not None:
            self._trace_step(out, start, duration, [f for f in finished if f], used)

    def _on_token(self, request: Request) -> str | None:
        """Record the token's time on the request's record; its id if it finished."""
        sim = self.live[request.request_id]
        record, now = sim.record, self.clock
        if sim.last_token is None:
            record.ttft = now - sim.arrival
        else:
            record.itl.append(now - sim.last_token)
        sim.last_token = now
        if not request.status.finished:
            return None
        record.success = True
        record.output_tokens = request.num_output_tokens
        record.latency = now - sim.arrival
        record.end_time = now
        del self.live[request.request_id]
        return request.request_id

    def _trace_step(self, out: SchedulerOutput, start: float, duration: float,
                    finished: list[str], used: int) -> None:
        """A StepTrace (the engine's record) restricted to the traced requests."""
        ids = self.trace_ids
        assert self.trace is not None
        self.trace.append(StepTrace(
            step=out.step_id, time=start, duration=duration,
            scheduled=tuple(ScheduledEntry(s.request_id, s.num_new_tokens,
                                           "decode" if s.num_new_tokens == 1
                                           and s.num_computed_tokens else "prefill")
                            for s in out.scheduled if s.request_id in ids),
            preempted=tuple(sorted(i for i in out.preempted_request_ids if i in ids)),
            waiting=tuple(r.request_id for r in self.scheduler.policy if r.request_id in ids),
            finished=tuple(i for i in finished if i in ids),
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
             trace_ids: frozenset[str] | None = None) -> SimRun:
    """Run the requests (sorted by arrival) through `num_replicas` simulated engines."""
    if num_replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {num_replicas}")
    wall = time.perf_counter()
    replicas = [Replica(i, setup, cost, trace_ids) for i in range(num_replicas)]
    router = Router(routing, replicas, setup.block_size)
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    for sim in pending:
        sim.record = RequestRecord(success=False, prompt_len=len(sim.prompt_token_ids),
                                   start_time=sim.arrival)
    while True:
        busy = [r for r in replicas if r.busy]
        laggard = min(busy, key=lambda r: (r.clock, r.index), default=None)
        if pending and (laggard is None or pending[0].arrival <= laggard.clock):
            sim = pending.popleft()
            router.route(sim).submit(sim)
        elif laggard is not None:
            laggard.step()
        else:
            break
    for replica in replicas:
        replica.scheduler.check_integrity()  # every KV block is free again
    end = max((r.record.end_time for r in requests), default=0.0)
    start = min((r.arrival for r in requests), default=0.0)
    return SimRun(list(requests), replicas, end - start, time.perf_counter() - wall)

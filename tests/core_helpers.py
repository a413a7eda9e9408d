"""Shared helpers for the torch-free core tests: requests, a fake model runner, a harness.

The fake runner keeps a shadow KV cache: every slot holds a key naming the exact token prefix
written there (position and all tokens before it). Each step it first writes the scheduled
tokens' keys into their slots (as a layer stores K/V before attention), then checks that
every position a request attends to holds that request's own prefix. A wrong block table, a
wrong prefix-cache hit or a block handed to two requests at once fails that check.

Like the real runner it keeps a request's tokens across a preemption (``new_requests`` rebuilds
them on resume), and verifies drafted tokens (``spec_token_ids``) greedily: the token at each
row is ``token_fn``'s, a draft is kept while it equals it. A draft's slot gets the key of the
prefix *with the drafts*: a rejected draft's KV published to the prefix cache would then fail
a later hit's check. A verify whose drafts the scheduler left to the runner (method
draft_model: ``num_spec_tokens`` without ids) gets them from ``draft_fn``, the fake draft model.
With ``forced_fn``, it reports after each sampling step the tokens a grammar would force next
(``ModelRunnerOutput.forced_token_ids``), as the real runner does for structured outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from conveyor.config import SchedulerConfig, SpeculativeConfig
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from conveyor.core.scheduler import Scheduler
from conveyor.request import Request, RequestStatus
from conveyor.sampling_params import SamplingParams

# (request_id, index of the output token being sampled) -> token id
TokenFn = Callable[[str, int], int]
# (request_id, index of the next output token) -> the tokens a grammar forces from there
ForcedFn = Callable[[str, int], list[int]]

OUTPUT_TOKEN_BASE = 1000  # default fake outputs live far from prompt ids and EOS


def default_token_fn(request_id: str, index: int) -> int:
    return OUTPUT_TOKEN_BASE + index


def make_request(request_id: str, prompt: Sequence[int], max_tokens: int | None = 8, *,
                 eos: tuple[int, ...] = (), max_model_len: int = 1024,
                 **sampling: object) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    return Request(request_id, list(prompt), params, eos_token_ids=eos,
                   max_model_len=max_model_len)


def _prefix_keys(tokens: Sequence[int]) -> list[int]:
    """keys[i] names tokens[:i + 1] (chained hash), so equal keys mean equal prefixes."""
    keys, key = [], 0
    for pos, token in enumerate(tokens):
        key = hash((key, pos, token))
        keys.append(key)
    return keys


class FakeRunner:
    """Plays the model runner: shadow KV writes/reads, the sampled (and accepted) tokens."""

    def __init__(self, num_blocks: int, block_size: int, token_fn: TokenFn,
                 draft_fn: TokenFn | None = None, forced_fn: ForcedFn | None = None) -> None:
        self.block_size = block_size
        self.token_fn = token_fn
        self.draft_fn = draft_fn
        self.forced_fn = forced_fn
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tokens: dict[str, list[int]] = {}
        self.num_prompt: dict[str, int] = {}
        self.stale: set[str] = set()  # preempted, not resumed yet

    def _slot(self, block_ids: list[int], pos: int) -> tuple[int, int]:
        assert pos // self.block_size < len(block_ids), \
            f"position {pos} beyond a block table of {len(block_ids)} blocks"
        return block_ids[pos // self.block_size], pos % self.block_size

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in out.finished_request_ids:
            self.tokens.pop(request_id, None)
        self.stale |= out.preempted_request_ids
        for new in out.new_requests:
            self.tokens[new.request_id] = list(new.all_token_ids)
            self.num_prompt[new.request_id] = new.num_prompt_tokens
            self.stale.discard(new.request_id)
        keys = {}
        scheduled = [self._with_drafts(item) for item in out.scheduled]
        for item in scheduled:  # write this step's K/V first ...
            assert item.request_id in self.tokens, f"runner never saw {item.request_id}"
            assert item.request_id not in self.stale, f"{item.request_id} resumed without data"
            tokens = self.tokens[item.request_id]
            end = item.num_computed_tokens + item.num_new_tokens - len(item.spec_token_ids)
            assert end <= len(tokens), f"{item.request_id}: computes past its tokens"
            keys[item.request_id] = _prefix_keys(tokens[:end] + item.spec_token_ids)
            for pos in range(item.num_computed_tokens, end + len(item.spec_token_ids)):
                block, offset = self._slot(item.block_ids, pos)
                self.slots[block][offset] = keys[item.request_id][pos]
        sampled, forced = {}, {}
        for item in scheduled:  # ... then attend over the whole prefix
            request_keys = keys[item.request_id]
            for pos, key in enumerate(request_keys):
                block, offset = self._slot(item.block_ids, pos)
                assert self.slots[block][offset] == key, \
                    f"{item.request_id}: wrong KV at position {pos} (block {block})"
            tokens = self.tokens[item.request_id]
            num_verified = len(request_keys) - len(item.spec_token_ids)
            assert item.samples == (num_verified == len(tokens))
            if item.samples:
                sampled[item.request_id] = self._verify(item.request_id, item.spec_token_ids)
                tokens.extend(sampled[item.request_id])
                index = len(tokens) - self.num_prompt[item.request_id]
                if self.forced_fn is not None and (f := self.forced_fn(item.request_id, index)):
                    forced[item.request_id] = f
        return ModelRunnerOutput(sampled_token_ids=sampled, forced_token_ids=forced)

    def _with_drafts(self, item: ScheduledRequest) -> ScheduledRequest:
        """A verify with its drafts: the scheduler's, or the fake draft model's."""
        assert len(item.spec_token_ids) in (0, item.num_spec_tokens)
        if not item.num_spec_tokens or item.spec_token_ids:
            return item
        assert self.draft_fn is not None, f"{item.request_id}: drafts but no draft model"
        index = len(self.tokens[item.request_id]) - self.num_prompt[item.request_id]
        return replace(item, spec_token_ids=[self.draft_fn(item.request_id, index + i)
                                             for i in range(item.num_spec_tokens)])

    def _verify(self, request_id: str, drafts: list[int]) -> list[int]:
        """The accepted drafts and the token after them (greedy verification)."""
        index = len(self.tokens[request_id]) - self.num_prompt[request_id]
        out = []
        for i in range(len(drafts) + 1):
            out.append(self.token_fn(request_id, index + i))
            if i == len(drafts) or drafts[i] != out[-1]:
                return out
        return out


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """Per-step invariants of a SchedulerOutput against the scheduler's state."""
    config = sched.config
    ids = [item.request_id for item in out.scheduled]
    assert len(ids) == len(set(ids)), f"a request scheduled twice: {ids}"
    assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(out.scheduled) <= config.max_num_seqs
    assert sched.num_running <= config.max_num_seqs
    assert {r.request_id for r in out.new_requests} <= set(ids)
    assert not (set(ids) & out.preempted_request_ids)
    running_ids = {r.request_id for r in sched.running}
    assert set(ids) <= running_ids
    block_size = sched.kv_cache.block_size
    for item in out.scheduled:
        request = sched.requests[item.request_id]
        assert request.status == RequestStatus.RUNNING
        assert item.num_new_tokens >= 1
        # (schedule() counted this step's tokens in flight, and its sample a placeholder)
        assert item.num_computed_tokens == request.num_scheduled_tokens - item.num_new_tokens
        end = item.num_computed_tokens + item.num_new_tokens
        num_drafts = item.num_spec_tokens
        assert len(item.spec_token_ids) in (0, num_drafts)
        num_tokens = request.num_tokens + request.num_output_placeholders - item.samples
        assert end - num_drafts <= num_tokens
        assert item.samples == (end - num_drafts == num_tokens)
        assert not num_drafts or item.num_new_tokens == num_drafts + 1, "drafts on a chunk"
        assert len(item.block_ids) * block_size >= end
        assert item.block_ids == sched.kv_cache.block_tables[item.request_id]
    for request in sched.running:
        assert request.status == RequestStatus.RUNNING
    for request in sched.policy:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def assert_no_leak(sched: Scheduler) -> None:
    sched.check_integrity()
    kv = sched.kv_cache
    if not sched.has_unfinished_requests():
        assert sched.num_running == 0 and sched.num_waiting == 0
        assert kv.num_live_requests() == 0
        assert kv.num_free_blocks == kv.num_blocks


@dataclass
class Harness:
    """A scheduler over a KV manager, driven step by step through a FakeRunner.

    With ``async_scheduling`` it drives them as the engine's pipeline does: a step is
    scheduled and run before the results of the one before it are taken (``update``)."""

    sched: Scheduler
    runner: FakeRunner
    outputs: list[SchedulerOutput] = field(default_factory=list)
    in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None

    @property
    def kv(self) -> KVCacheManager:
        return self.sched.kv_cache

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.sched.add_request(request)

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        check_step(self.sched, out)
        runner_out = self.runner.execute(out)  # the runner works on this step ...
        if self.sched.config.async_scheduling:  # ... while the last one's results are taken
            previous, self.in_flight = self.in_flight, (out, runner_out)
            if previous is not None:
                self.sched.update(*previous)
        else:
            self.sched.update(out, runner_out)
        self.sched.check_integrity()
        self.outputs.append(out)
        return out

    def drain(self) -> None:
        """Take the results of the step in flight, if any (async scheduling)."""
        if self.in_flight is not None:
            self.sched.update(*self.in_flight)
            self.in_flight = None

    def run(self, max_steps: int = 2000) -> int:
        """Step until no request is alive; returns the number of steps; checks for leaks."""
        steps = 0
        while self.sched.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps <= max_steps, "the scheduler made no progress"
        self.drain()
        assert_no_leak(self.sched)
        return steps


def scheduler_config(**config: object) -> SchedulerConfig:
    """SchedulerConfig for the harnesses: a 2048-token context and a 512-token step unless
    given (the engine resolves them from the model and the usage)."""
    return SchedulerConfig(**{"max_model_len": 2048, "max_num_batched_tokens": 512,
                              **config})  # type: ignore[arg-type]


def make_harness(num_blocks: int = 64, block_size: int = 4, enable_caching: bool = True,
                 token_fn: TokenFn = default_token_fn,
                 speculative: SpeculativeConfig | None = None,
                 draft_fn: TokenFn | None = None, forced_fn: ForcedFn | None = None,
                 **config: object) -> Harness:
    kv = KVCacheManager(num_blocks, block_size, enable_caching)
    sched = Scheduler(scheduler_config(**config), kv, speculative=speculative)
    return Harness(sched, FakeRunner(num_blocks, block_size, token_fn, draft_fn, forced_fn))


def scripted(tokens: dict[str, list[int]], default: int = OUTPUT_TOKEN_BASE) -> TokenFn:
    """A token_fn that plays a fixed script per request, then ``default``."""

    def token_fn(request_id: str, index: int) -> int:
        script = tokens.get(request_id, [])
        return script[index] if index < len(script) else default

    return token_fn


# ---------------------------------------------------------------- policies, swap, reserve
def make_policy_request(request_id: str, prompt: Sequence[int], max_tokens: int | None = 8, *,
                        priority: int = 0, user: str | None = None,
                        **kwargs: object) -> Request:
    """make_request plus the scheduling fields the policies read (priority, tenant)."""
    request = make_request(request_id, prompt, max_tokens, **kwargs)  # type: ignore[arg-type]
    request.priority = priority
    request.user = user
    return request


class SwapFakeRunner(FakeRunner):
    """FakeRunner with a shadow host swap space: applies a step's block copies (swap-outs
    first, then swap-ins, as the real runner does) before the step's K/V writes, so a swap
    that restores the wrong block fails the shadow-KV check."""

    def __init__(self, num_blocks: int, block_size: int, token_fn: TokenFn,
                 num_swap_blocks: int) -> None:
        super().__init__(num_blocks, block_size, token_fn)
        self.host: list[list[int | None]] = [[None] * block_size
                                             for _ in range(num_swap_blocks)]

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for device, host in out.swap_out:
            self.host[host] = list(self.slots[device])
        for host, device in out.swap_in:
            self.slots[device] = list(self.host[host])
        return super().execute(out)


def make_policy_harness(num_blocks: int = 64, block_size: int = 4, enable_caching: bool = True,
                        token_fn: TokenFn = default_token_fn, num_swap_blocks: int = 0,
                        **config: object) -> Harness:
    """make_harness with swap blocks (a SwapFakeRunner) and the reserve baseline wired as the
    engine wires them (``kv_allocation="reserve"`` reserves ``max_model_len`` tokens)."""
    sched_config = scheduler_config(**config)
    reserve = sched_config.max_model_len if sched_config.kv_allocation == "reserve" else None
    kv = KVCacheManager(num_blocks, block_size, enable_caching, num_swap_blocks,
                        reserve_tokens=reserve)
    runner = SwapFakeRunner(num_blocks, block_size, token_fn, num_swap_blocks)
    return Harness(Scheduler(sched_config, kv), runner)

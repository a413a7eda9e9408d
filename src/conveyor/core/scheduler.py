"""Iteration-level scheduling: who computes how many tokens in the next forward pass.

There are no prefill and decode phases. Each step spends one token budget
(``max_num_batched_tokens``) across at most ``max_num_seqs`` requests: running requests
first (a decode costs one token, an unfinished prompt gets a chunk), then waiting requests in
the policy's order. A request that finishes leaves in the same step and its blocks are free
for the next. When blocks run out, the policy names a victim to preempt (recompute: its
blocks are freed and its tokens recomputed on resume).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from conveyor.config import SchedulerConfig
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.outputs import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from conveyor.core.policy import FCFSPolicy, SchedulingPolicy
from conveyor.request import Request, RequestStatus

# Admission keeps this share of blocks free so newly admitted requests rarely force a
# preemption on their next decode (vLLM uses the same 1% watermark).
ADMISSION_WATERMARK = 0.01


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_preempted_tokens: int = 0  # computed tokens thrown away by preemption (recompute cost)
    num_steps: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 policy: SchedulingPolicy | None = None) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.policy = policy or FCFSPolicy()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_ids: set[str] = set()
        self._step_id = 0
        self._watermark_blocks = int(ADMISSION_WATERMARK * kv_cache.num_blocks)

    # ------------------------------------------------------------------ admission
    def check_fits(self, request: Request) -> None:
        """Refuse a request that could never complete: ValueError with the reason."""
        limit = self.config.max_model_len
        if request.num_prompt_tokens >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {request.num_prompt_tokens} input tokens. Please reduce the "
                "length of the input messages.")
        worst_case = request.num_prompt_tokens + request.max_tokens
        blocks = self.kv_cache.blocks_needed(worst_case)
        if blocks > self.kv_cache.num_blocks:
            raise ValueError(
                f"the request needs up to {worst_case} tokens of KV cache ({blocks} blocks) but "
                f"the cache holds {self.kv_cache.num_blocks} blocks of "
                f"{self.kv_cache.block_size} tokens; raise kv_cache_memory or lower max_tokens")

    def add_request(self, request: Request) -> None:
        self.check_fits(request)
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.policy.add(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        """Abort live requests (unknown or finished ids are ignored); blocks freed now."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.policy.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(request)
        return aborted

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish running requests from outside (a stop string found by the detokenizer)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        request.status = status
        request.times.finished = time.time()
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, and place their KV."""
        step = _StepBuilder(self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        self._step_id += 1
        self.stats.num_steps += 1
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(step_id=self._step_id, new_requests=step.new_requests,
                               scheduled=list(step.scheduled.values()),
                               finished_request_ids=finished,
                               preempted_request_ids=step.preempted)

    def _schedule_running(self, step: _StepBuilder) -> None:
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING or step.budget == 0:
                continue  # preempted earlier in this loop, or the budget is spent
            num_new = min(request.num_uncomputed_tokens, step.budget)
            while (table := self.kv_cache.allocate_slots(request, num_new)) is None:
                victim = self.policy.pick_victim(self.running, request)
                self._preempt(victim or request, step)
                if victim is None:
                    break
            if table is not None:
                step.add(request, num_new, table)

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        while (len(self.running) < self.config.max_num_seqs and step.budget > 0
               and (request := self.policy.peek()) is not None):
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
            remaining = request.num_tokens - num_cached
            num_new = min(remaining, step.budget)
            if num_new < remaining and not self.config.enable_chunked_prefill:
                break
            blocks = self.kv_cache.blocks_needed(num_cached + num_new)
            if blocks + self._watermark_blocks - len(computed_blocks) \
                    > self.kv_cache.num_free_blocks and self.running:
                break  # keep headroom for running decodes (an idle engine admits anyway)
            table = self.kv_cache.allocate_slots(request, num_new, computed_blocks)
            if table is None:
                break
            self.policy.pop()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.times.first_scheduled is None:
                request.times.first_scheduled = time.time()
            self.running.append(request)
            step.new_requests.append(NewRequestData(
                request_id=request.request_id, all_token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params))
            step.add(request, num_new, table)

    def _preempt(self, request: Request, step: _StepBuilder) -> None:
        """Recompute preemption: free the blocks, requeue, start over on resume."""
        step.unschedule(request)
        self.running.remove(request)
        self.kv_cache.free(request)
        self.stats.num_preemptions += 1
        self.stats.num_preempted_tokens += request.num_computed_tokens
        request.num_preemptions += 1
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.policy.requeue(request)
        step.preempted.add(request.request_id)

    def update(self, scheduler_output: SchedulerOutput,
               runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish on length/EOS/stop ids.

        Returns the requests that got a new token (finished ones included).
        """
        updated = []
        now = time.time()
        for item in scheduler_output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None:
                continue  # aborted while the step ran
            request.num_computed_tokens += item.num_new_tokens
            if not item.samples:
                continue
            request.append_output_token(runner_output.sampled_token_ids[item.request_id])
            if request.times.first_token is None:
                request.times.first_token = now
            request.times.last_token = now
            status = request.check_stop()
            if status is not None:
                self._finish(request, status)
            updated.append(request)
        return updated

    # ------------------------------------------------------------------ introspection
    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def check_integrity(self) -> None:
        """KV invariants; with no live request, every block must be free."""
        self.kv_cache.check_integrity()
        if not self.requests:
            assert self.kv_cache.num_free_blocks == self.kv_cache.num_blocks, \
                f"{self.kv_cache.num_blocks - self.kv_cache.num_free_blocks} KV blocks leaked"


class _StepBuilder:
    """The step being assembled: scheduled requests in batch order and the budget left."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.scheduled: dict[str, ScheduledRequest] = {}
        self.new_requests: list[NewRequestData] = []
        self.preempted: set[str] = set()

    def add(self, request: Request, num_new: int, block_table: list[int]) -> None:
        self.budget -= num_new
        samples = request.num_computed_tokens + num_new == request.num_tokens
        self.scheduled[request.request_id] = ScheduledRequest(
            request_id=request.request_id, num_new_tokens=num_new,
            num_computed_tokens=request.num_computed_tokens, block_ids=list(block_table),
            samples=samples)

    def unschedule(self, request: Request) -> None:
        item = self.scheduled.pop(request.request_id, None)
        if item is not None:
            self.budget += item.num_new_tokens
        self.new_requests = [r for r in self.new_requests if r.request_id != request.request_id]

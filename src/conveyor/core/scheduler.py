"""Iteration-level scheduling: who computes how many tokens in the next forward pass.

There are no prefill and decode phases. Each step spends one token budget
(``max_num_batched_tokens``) across at most ``max_num_seqs`` requests: running requests
first (a decode costs one token, an unfinished prompt gets a chunk), then waiting requests in
the policy's order. A request that finishes leaves in the same step and its blocks are free
for the next. When blocks run out, the policy names a victim to preempt (recompute: its
blocks are freed and its tokens recomputed on resume).

With speculative decoding (``spec_decode.SpecDecoder``), running decodes may then carry
drafted tokens to verify, paid from the same budget, before waiting requests are admitted.
A structured-output request whose grammar forces its next tokens (the runner reports them,
``ModelRunnerOutput.forced_token_ids``: a JSON object's next key, say) verifies those as its
drafts, with or without speculative decoding: its mask allows only them, so they are
accepted and the output is the same, in fewer steps.

With ``async_scheduling`` the engine schedules step N+1 before step N's results are in (the
runner works on N meanwhile): a request N samples for continues in N+1 from a placeholder
(``Request.num_output_placeholders``), whose id the runner has (on the device) by the time
N+1 runs. Its ``update`` then comes after the next ``schedule``: a request may have been
preempted, or a new one admitted under a finished one's id, in between. A placeholder that turns out to
follow a stop costs one wasted token; one that reaches ``max_tokens`` is not scheduled on.
Drafts need the tokens before them, so an async scheduler verifies none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from conveyor.config import SchedulerConfig, SpeculativeConfig
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.outputs import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from conveyor.core.policy import SchedulingPolicy, make_policy
from conveyor.core.spec_decode import SpecDecoder
from conveyor.request import Request, RequestStatus

# Admission keeps this share of blocks free so newly admitted requests rarely force a
# preemption on their next decode (vLLM uses the same 1% watermark).
ADMISSION_WATERMARK = 0.01
# Most grammar-forced tokens one verify carries (the step's budget and max_tokens bound it too).
MAX_FORCED_DRAFTS = 16


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_preempted_tokens: int = 0  # computed tokens thrown away by preemption (recompute cost)
    num_swapped_blocks: int = 0  # blocks copied to host memory by swap preemption
    num_steps: int = 0
    peak_running: int = 0  # most sequences running in one step
    peak_kv_utilization: float = 0.0  # at that peak: share of allocated KV slots holding tokens
    num_forced_draft_tokens: int = 0  # grammar-forced tokens verified as drafts
    num_forced_accepted_tokens: int = 0  # of those, accepted (all, unless a stop came first)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 policy: SchedulingPolicy | None = None,
                 speculative: SpeculativeConfig | None = None) -> None:
        if config.max_model_len < 1 or config.max_num_batched_tokens < 1:
            raise ValueError("the scheduler needs max_model_len and max_num_batched_tokens "
                             "resolved (>= 1): SchedulerConfig.resolved(model_max_len)")
        self.config = config
        self.kv_cache = kv_cache
        self.policy = policy or make_policy(config)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_ids: set[str] = set()
        self._step_id = 0
        self._watermark_blocks = int(ADMISSION_WATERMARK * kv_cache.num_blocks)
        self.spec = SpecDecoder(speculative) if speculative is not None else None
        self._step_started = 0.0  # perf_counter() when the last schedule() returned
        # request id -> the tokens its grammar forces after its last token (runner-reported)
        self._forced: dict[str, list[int]] = {}
        self._forced_verifies: set[str] = set()  # this step's verifies of forced tokens
        # step id -> its requests, until its results are in (``update``): the ids may
        # belong to other requests by then
        self._in_flight: dict[int, dict[str, Request]] = {}

    # ------------------------------------------------------------------ admission
    def check_fits(self, request: Request) -> None:
        """Refuse a request that could never complete: ValueError with the reason."""
        limit = self.config.max_model_len
        # (an embedding's prompt may fill the context: its one sampled token is dropped)
        room = 0 if request.sampling_params.return_embedding else 1
        if request.num_prompt_tokens + room > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {request.num_prompt_tokens} input tokens. Please reduce the "
                "length of the input messages.")
        # The last sampled token never needs KV, hence the - 1.
        worst_case = request.num_prompt_tokens + request.max_tokens - 1
        blocks = self.kv_cache._target_blocks(worst_case)
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
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(request)
        return aborted

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish live requests from outside (a stop string found by the detokenizer, a
        failed step); unknown or finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.policy.remove(request)  # waiting or preempted
        self.policy.forget(request)
        if self.spec is not None:
            self.spec.forget(request.request_id)
        self._forced.pop(request.request_id, None)
        request.status = status
        request.times.finished = time.time()
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, and place their KV."""
        self.policy.begin_step()
        self.kv_cache.begin_step()
        step = _StepBuilder(self.config.max_num_batched_tokens, self.policy)
        self._schedule_running(step)
        self._forced_verifies = set()
        if not step.preempted:
            self._schedule_waiting(step)
        # Drafts last, from the blocks and budget admission left: a draft never costs a
        # waiting request its admission or a running one its place.
        if (self.spec is not None or self._forced) and not step.preempted \
                and not self.config.async_scheduling:
            self._schedule_drafts(step)
        self._step_id += 1
        self.stats.num_steps += 1
        self._record_peak(step)
        self._start_step(step)
        finished, self._finished_ids = self._finished_ids, set()
        output = SchedulerOutput(step_id=self._step_id, new_requests=step.new_requests,
                               scheduled=list(step.scheduled.values()),
                               finished_request_ids=finished,
                               preempted_request_ids=step.preempted,
                               swapped_out_request_ids=step.swapped_out,
                               swap_out=step.swap_out, swap_in=step.swap_in)
        self._step_started = time.perf_counter()
        return output

    def _start_step(self, step: _StepBuilder) -> None:
        """The step's tokens are in flight until ``update`` takes its results."""
        requests = {}
        for item in step.scheduled.values():
            request = self.requests[item.request_id]
            request.num_inflight_tokens += item.num_new_tokens
            request.num_output_placeholders += item.samples
            requests[item.request_id] = request
        self._in_flight[self._step_id] = requests

    def _schedule_running(self, step: _StepBuilder) -> None:
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING or step.budget == 0:
                continue  # preempted earlier in this loop, or the budget is spent
            if request.num_output_placeholders and request.num_output_tokens \
                    + request.num_output_placeholders >= request.max_tokens:
                continue  # the step in flight samples its last token
            num_new = min(request.num_uncomputed_tokens, step.budget)
            # (a step in flight has its tokens' slots already; they count again here)
            while (table := self.kv_cache.allocate_slots(
                    request, request.num_inflight_tokens + num_new)) is None:
                victim = self.policy.pick_victim(self.running, request)
                self._preempt(victim or request, step)
                if victim is None:
                    break
            if table is not None:
                step.add(request, num_new, table)

    def _schedule_drafts(self, step: _StepBuilder) -> None:
        """Give this step's decodes drafted tokens to verify, from the budget left: the
        tokens their grammar forces, else speculative drafts. A draft never preempts anyone:
        without free blocks for it, the request decodes plainly."""
        decodes = [r for r in self.running if (item := step.scheduled.get(r.request_id))
                   and item.num_new_tokens == 1 and item.samples
                   and r.num_computed_tokens >= r.num_prompt_tokens]
        if self.spec is not None:
            scheduled = self.config.max_num_batched_tokens - step.budget
            self.spec.begin_step(scheduled, sum(s.samples for s in step.scheduled.values()))
        for request in decodes:
            # The drafts and the token sampled after them stay within max_tokens.
            limit = min(step.budget, request.max_tokens - request.num_output_tokens - 1)
            if limit <= 0:
                continue
            if forced := self._forced.get(request.request_id):
                drafts = forced[:min(limit, MAX_FORCED_DRAFTS)]
                num = len(drafts)
            elif self.spec is not None:
                num, drafts = self.spec.propose(request, limit)
            else:
                continue
            if num and (table := self.kv_cache.allocate_slots(request, 1 + num)) is not None:
                step.add_drafts(request, num, drafts, table)
                if forced:
                    self._forced_verifies.add(request.request_id)

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        if not self._may_admit():
            return
        while step.budget > 0 and (request := self.policy.peek()) is not None:
            if request.request_id in step.preempted:
                return  # displaced in this very step: resuming it now would waste the work
            while not (len(self.running) < self.config.max_num_seqs
                       and self._admit(request, step)):
                # Full (slots or blocks): the policy may displace a less deserving request.
                victim = self.policy.pick_admission_victim(self.running, request)
                if victim is None:
                    return
                self._preempt(victim, step)

    def _may_admit(self) -> bool:
        """Continuous batching admits every step. The static baseline admits only while its
        batch is still forming (nobody has produced a token yet): finished sequences hold
        their slots until the batch's longest one ends."""
        if self.config.scheduling == "continuous":
            return True
        return all(r.num_output_tokens + r.num_output_placeholders == 0 for r in self.running)

    def _admit(self, request: Request, step: _StepBuilder) -> bool:
        """Place the first tokens of a waiting request; False (no change) if they don't fit."""
        # (never before the results of a step it was preempted from: that step's update
        # comes before the next schedule, and a request preempted in a step waits it out)
        assert not request.num_output_placeholders, f"{request.request_id} resumed too early"
        if request.swapped_out:
            return self._admit_swapped(request, step)
        computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
        remaining = request.num_tokens - num_cached
        num_new = min(remaining, step.budget)
        if num_new < remaining and not self.config.enable_chunked_prefill:
            return False
        # A resumed request must have room for all its tokens, or it would be preempted
        # again before producing one; a new one needs room for this chunk. Either way keep
        # headroom for running decodes (an idle engine admits anyway).
        num_tokens = request.num_tokens if request.num_preemptions else num_cached + num_new
        blocks = self.kv_cache.blocks_needed(num_tokens)
        if self.running and blocks + self._watermark_blocks - len(computed_blocks) \
                > self.kv_cache.num_free_blocks:
            return False
        # A resumed request takes blocks for all its tokens now, so the rest of its
        # recompute cannot be preempted before it produces a token.
        lookahead = request.num_tokens - num_cached - num_new if request.num_preemptions else 0
        table = self.kv_cache.allocate_slots(request, num_new, computed_blocks, lookahead)
        if table is None:
            return False
        if request.status == RequestStatus.WAITING:  # first admission, not a resume
            request.num_cached_tokens = num_cached
            self.kv_cache.record_prefix_lookup(request.num_tokens, num_cached)
        request.num_computed_tokens = num_cached
        self._start_running(request, step)
        step.add(request, num_new, table)
        return True

    def _admit_swapped(self, request: Request, step: _StepBuilder) -> bool:
        num_new = min(request.num_uncomputed_tokens, step.budget)
        copies = self.kv_cache.swap_in(request, num_new)
        if copies is None:
            return False
        step.swap_in.extend(copies)
        request.swapped_out = False
        self._start_running(request, step)
        step.add(request, num_new, self.kv_cache.block_tables[request.request_id])
        return True

    def _start_running(self, request: Request, step: _StepBuilder) -> None:
        self.policy.remove(request)
        request.status = RequestStatus.RUNNING
        if request.times.first_scheduled is None:
            request.times.first_scheduled = time.time()
        self.running.append(request)
        step.new_requests.append(NewRequestData(
            request_id=request.request_id, all_token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params, eos_token_ids=request.eos_token_ids))

    def _preempt(self, request: Request, step: _StepBuilder) -> None:
        """Swap the request's KV out to host memory if configured and there is room, else
        free it (recompute on resume). Either way it waits again, at the policy's front."""
        step.unschedule(request)
        self.running.remove(request)
        if self.config.preemption == "swap" and self.kv_cache.can_swap_out(request):
            copies = self.kv_cache.swap_out(request)
            step.swap_out.extend(copies)
            step.swapped_out.add(request.request_id)
            request.swapped_out = True
            self.stats.num_swapped_blocks += len(copies)
        else:
            self.kv_cache.free(request)
            self.stats.num_preempted_tokens += request.num_computed_tokens
            request.num_computed_tokens = request.num_inflight_tokens = 0
        self.stats.num_preemptions += 1
        request.num_preemptions += 1
        # (with the token a step in flight samples for it: that one is not progress)
        request.output_len_at_preemption = request.num_output_tokens \
            + request.num_output_placeholders
        request.status = RequestStatus.PREEMPTED
        self.policy.requeue(request)
        step.preempted.add(request.request_id)

    def _record_peak(self, step: _StepBuilder) -> None:
        """Track the most concurrent sequences, and how full their KV blocks were then."""
        if len(self.running) < self.stats.peak_running:
            return
        kv = self.kv_cache
        used = sum(len(kv.block_tables.get(r.request_id, ())) for r in self.running)
        tokens = sum(r.num_scheduled_tokens for r in self.running) + \
            sum(s.num_new_tokens for s in step.scheduled.values())
        self.stats.peak_running = len(self.running)
        self.stats.peak_kv_utilization = tokens / max(used * kv.block_size, 1)

    def update(self, scheduler_output: SchedulerOutput,
               runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish on length/EOS/stop ids.

        Returns the requests that got a new token (finished ones included).
        """
        if self.spec is not None:
            proposed = sum(s.num_spec_tokens for s in scheduler_output.scheduled
                           if s.request_id not in self._forced_verifies)  # not the forced
            self.spec.record_step(scheduler_output.total_num_scheduled_tokens,
                                  time.perf_counter() - self._step_started, proposed,
                                  runner_output.draft_seconds)
        updated = []
        now = time.time()
        for item in scheduler_output.scheduled:
            request = self.live_request(scheduler_output, item.request_id)
            if request is None:
                continue  # ended (aborted, stopped) after it was scheduled
            tokens = runner_output.sampled_token_ids[item.request_id] if item.samples else []
            self._advance(request, item, tokens)
            if tokens:
                # what its grammar forces next, if it goes on
                self._set_forced(request, runner_output.forced_token_ids.get(item.request_id))
                if request.times.first_token is None:
                    request.times.first_token = now
                request.times.last_token = now
                updated.append(request)
        self._in_flight.pop(scheduler_output.step_id, None)
        return updated

    def live_request(self, scheduler_output: SchedulerOutput, request_id: str
                     ) -> Request | None:
        """The request the step ran under this id, if it has not ended since."""
        request = self._in_flight.get(scheduler_output.step_id, {}).get(request_id)
        return None if request is None or request.status.finished else request

    def step_failed(self, scheduler_output: SchedulerOutput) -> None:
        """The step's forward pass raised: it has no results (its requests are ended)."""
        self._in_flight.pop(scheduler_output.step_id, None)

    def _set_forced(self, request: Request, forced: list[int] | None) -> None:
        if forced and request.request_id in self.requests:
            self._forced[request.request_id] = forced
        else:
            self._forced.pop(request.request_id, None)

    def _advance(self, request: Request, item: ScheduledRequest, tokens: list[int]) -> None:
        """Take one step's result: its computed tokens (the rejected drafts' KV does not
        count), the tokens sampled in order up to a stop, the rejected drafts' blocks back."""
        num_drafts = item.num_spec_tokens
        assert len(tokens) <= num_drafts + 1, f"{item.request_id}: more tokens than drafts + 1"
        num_accepted = max(len(tokens) - 1, 0)
        request.num_output_placeholders -= item.samples
        # Preempted by a later step's schedule (async): with recompute its K/V is gone
        kv_kept = request.status == RequestStatus.RUNNING or request.swapped_out
        if kv_kept:
            request.num_inflight_tokens -= item.num_new_tokens
            request.num_computed_tokens += item.num_new_tokens - num_drafts + num_accepted
        status = None
        for token in tokens:
            request.append_output_token(token)
            if (status := request.check_stop()) is not None:
                break  # the tokens after a stop are dropped
        if kv_kept:
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            self.kv_cache.cache_computed_blocks(request)  # verified tokens only
        if request.request_id in self._forced_verifies:
            self.stats.num_forced_draft_tokens += num_drafts
            self.stats.num_forced_accepted_tokens += num_accepted
        elif num_drafts and self.spec is not None:
            self.spec.record(request.request_id, num_drafts, num_accepted)
        if status is not None:
            self._finish(request, status)
        elif num_drafts:
            self.kv_cache.trim(request)

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

    def __init__(self, budget: int, policy: SchedulingPolicy) -> None:
        self.budget = budget
        self.policy = policy
        self.scheduled: dict[str, ScheduledRequest] = {}
        self.new_requests: list[NewRequestData] = []
        self.preempted: set[str] = set()
        self.swapped_out: set[str] = set()
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []

    def add(self, request: Request, num_new: int, block_table: list[int]) -> None:
        self.budget -= num_new
        self.policy.on_scheduled(request, num_new)
        start = request.num_scheduled_tokens
        samples = start + num_new == request.num_tokens + request.num_output_placeholders
        self.scheduled[request.request_id] = ScheduledRequest(
            request_id=request.request_id, num_new_tokens=num_new,
            num_computed_tokens=start, block_ids=list(block_table),
            samples=samples)

    def add_drafts(self, request: Request, num: int, drafts: list[int],
                   block_table: list[int]) -> None:
        """The request's scheduled decode verifies ``num`` drafts too: ``drafts``, or tokens
        the runner's draft model proposes (``drafts`` empty)."""
        item = self.scheduled[request.request_id]
        self.budget -= num
        self.policy.on_scheduled(request, num)
        item.num_new_tokens += num
        item.num_spec_tokens = num
        item.spec_token_ids = list(drafts)
        item.block_ids = list(block_table)

    def unschedule(self, request: Request) -> None:
        item = self.scheduled.pop(request.request_id, None)
        if item is not None:
            self.budget += item.num_new_tokens
            self.policy.on_scheduled(request, -item.num_new_tokens)
        self.new_requests = [r for r in self.new_requests if r.request_id != request.request_id]

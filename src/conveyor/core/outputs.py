"""The scheduler <-> model runner contract. Layer 0: stdlib only.

The scheduler decides who runs and where their KV lives; the runner turns that into tensors
and returns one sampled token per request that reached the end of its input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (new, or resumed after preemption)."""

    request_id: str
    all_token_ids: list[int]  # prompt + outputs so far (a resumed request recomputes them all)
    num_prompt_tokens: int  # penalties count only generated tokens
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()  # masked while fewer than min_tokens were generated


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    num_new_tokens: int  # tokens computed this step (1 for a decode, more for a prefill chunk)
    num_computed_tokens: int  # tokens whose KV is already in the cache before this step
    block_ids: list[int]  # the request's whole block table after this step's allocation
    samples: bool  # True when this step reaches the end of its tokens: sample one token


@dataclass
class SchedulerOutput:
    """What one step runs. Requests appear in the order their tokens are concatenated."""

    step_id: int
    new_requests: list[NewRequestData]  # the runner must (re)build state for these first
    scheduled: list[ScheduledRequest]  # in batch order
    # new token ids of running requests (the sampled token the runner returned last step
    # is the input of the next decode; the runner appends it itself).
    finished_request_ids: set[str] = field(default_factory=set)  # runner drops their state
    preempted_request_ids: set[str] = field(default_factory=set)  # runner drops their state
    # Block copies to run before the forward pass, swap-outs first (a block a swap-out
    # frees may be reused by a swap-in or written by this very step):
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) blocks
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device) blocks

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class Logprob:
    """One candidate token's log-probability and its rank in the distribution (1 = top)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class ModelRunnerOutput:
    """One step's results, for the requests that sampled."""

    sampled_token_ids: dict[str, int]  # request_id -> the token sampled this step
    # request_id -> {token_id: Logprob}: top-N plus the sampled token (only if asked)
    logprobs: dict[str, dict[int, Logprob]] = field(default_factory=dict)

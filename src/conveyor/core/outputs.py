"""The scheduler <-> model runner contract. Layer 0: stdlib only.

The scheduler decides who runs and where their KV lives; the runner turns that into tensors
and returns the tokens sampled for each request that reached the end of its input: one, or
with speculative decoding the drafts it accepted plus one it sampled.

What the runner keeps per request between steps: the tokens the model has seen (prompt +
outputs, to which it appends what it samples, so the next decode's input is the token it
returned last step) and its sampling state (a seeded request's generator). It drops both
when the request is in ``finished_request_ids``; a preempted request keeps its sampling state
(its generator continues where it stopped) and gets its tokens again, all of them, in
``new_requests`` when it resumes.

With async scheduling the scheduler hands over step N+1 before it has seen step N's results:
the runner runs the steps in order, so a decode's input is still the token the runner
sampled last, which the scheduler does not know yet. A request may then run in a step after
the scheduler ended it (a stop it found in the step before: the runner's token is dropped)
and reach the runner in ``finished_request_ids`` a step later than it ended.
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
    samples: bool  # True when this step reaches the end of its tokens: sample
    # Drafted tokens to verify (speculative decoding), already counted in num_new_tokens and
    # given KV slots: the step computes the request's last token plus these. Never part of
    # the request's tokens (nor of the prefix cache) until the runner accepts them.
    num_spec_tokens: int = 0
    # Their ids when the scheduler proposed them (method ngram, or the tokens a grammar
    # forces). Empty with a draft model (method draft_model): the runner's draft model
    # proposes num_spec_tokens tokens at the start of the step, before the target model
    # verifies them.
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What one step runs."""

    step_id: int
    new_requests: list[NewRequestData]  # the runner must (re)build state for these first
    # In the scheduler's order (running requests, then admitted ones); the runner lays the
    # tokens out in its own order (decodes first), so no meaning is attached to this one.
    scheduled: list[ScheduledRequest]
    finished_request_ids: set[str] = field(default_factory=set)  # runner drops their state
    # Preempted this step: informational (traces, a failed step's cleanup); the runner keeps
    # their sampling state and rebuilds their tokens from new_requests when they resume.
    preempted_request_ids: set[str] = field(default_factory=set)
    swapped_out_request_ids: set[str] = field(default_factory=set)  # (the rest: recompute)
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
    # The token's bytes when they are not whole characters (a piece of one, which
    # decoded_token shows as "\ufffd"); None: decoded_token's UTF-8
    decoded_bytes: bytes | None = None


@dataclass
class ModelRunnerOutput:
    """One step's results, for the requests that sampled."""

    # request_id -> the tokens this step produced, in order: the accepted drafts, then the
    # token sampled after them (one token without drafts)
    sampled_token_ids: dict[str, list[int]]
    # request_id -> per token above, {token_id: Logprob}: top-N plus that token (if asked)
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    # request_id -> why it cannot go on (its grammar failed: llguidance ran out of fuel):
    # the engine ends it with finish_reason "error" before taking this step's tokens, so
    # the token sampled for it (EOS, all its failed mask allowed) is dropped
    errors: dict[str, str] = field(default_factory=dict)
    # Seconds the draft model spent proposing this step's drafts (method draft_model): the
    # scheduler's cost model charges them to the drafts, not to the step's tokens
    draft_seconds: float = 0.0
    # request_id -> the tokens its structured-output grammar forces after this step's
    # tokens (llguidance's canonical tokenization of the bytes it must write next; absent:
    # none). The scheduler has its next decode verify them as drafts.
    forced_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> (p, logprobs of prompt tokens p, p + 1, ...): what this step's prefill
    # chunk predicted of its prompt (requests with prompt_logprobs; a recomputed prompt
    # sends them again)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]] = \
        field(default_factory=dict)
    # request_id -> its prompt's embedding (SamplingParams.return_embedding), computed with
    # its first sampled token
    embeddings: dict[str, list[float]] = field(default_factory=dict)

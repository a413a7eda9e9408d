"""What the engine returns to callers (vLLM's offline-API names). Layer 0: stdlib only."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.core.outputs import Logprob


@dataclass
class CompletionOutput:
    """One generated sequence (one of ``n``); text and ids are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # Why it ended with "error" when the request itself failed (its grammar ran out of
    # fuel); None when an engine step failed (an internal error, logged).
    error: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token, if asked
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock milestones (time.time()) of a request, and what preemption cost it."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request (all its ``n`` sequences) after a step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: None = field(default=None, repr=False)

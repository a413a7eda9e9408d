"""What the engine returns to callers (vLLM's offline-API names). Layer 0: stdlib only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from conveyor.core.outputs import Logprob


@dataclass
class CompletionOutput:
    """One generated sequence (one of ``n``): its text, token ids and logprobs so far, or
    with ``output_kind=DELTA`` those new since the request's previous output."""

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

    def finished(self) -> bool:
        """Whether the sequence has ended (a method, as vLLM's; RequestOutput's is a field)."""
        return self.finish_reason is not None

    def add(self, delta: CompletionOutput) -> None:
        """Append the sequence's next delta (in place: call it on an output you own)."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = list(delta.logprobs)
            else:
                self.logprobs.extend(delta.logprobs)
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        self.error, self.cumulative_logprob = delta.error, delta.cumulative_logprob


@dataclass
class RequestMetrics:
    """Wall-clock milestones (time.time()) of a request, and what preemption cost it."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Tokens generated so far by all the request's samples, whatever its output_kind
    num_generation_tokens: int = 0

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
    # SamplingParams.prompt_logprobs: per prompt token (None for the first), its logprob and
    # the top N, as vLLM gives them
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(default=None, repr=False)
    # SamplingParams.return_embedding: the prompt's embedding, once computed
    embedding: list[float] | None = field(default=None, repr=False)

    def add(self, delta: RequestOutput) -> None:
        """Append a later output of the same request with ``output_kind=DELTA`` (in place:
        call it on an output you own); its state (finished, metrics) replaces this one's."""
        mine = {c.index: c for c in self.outputs}
        for new in delta.outputs:
            if (c := mine.get(new.index)) is None:
                self.outputs.append(copy_completion(new))
            else:
                c.add(new)
        self.finished, self.metrics = delta.finished, delta.metrics
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:  # (the first delta that has them)
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            self.embedding = delta.embedding

    def copy(self) -> RequestOutput:
        """A copy whose outputs' lists are its own (to ``add`` deltas to)."""
        return dataclasses.replace(self, outputs=[copy_completion(c) for c in self.outputs])


@dataclass
class EmbeddingOutput:
    """vLLM's: one prompt's embedding."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's ``LLM.embed`` result for one prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


def copy_completion(c: CompletionOutput) -> CompletionOutput:
    return dataclasses.replace(c, token_ids=list(c.token_ids),
                               logprobs=None if c.logprobs is None else list(c.logprobs))


def joined(earlier: CompletionOutput | None, delta: CompletionOutput) -> CompletionOutput:
    """``earlier`` (an output the caller owns, or None) with ``delta`` appended: an output
    the caller owns (a stream holding back a delta until it has text to send)."""
    if earlier is None:
        return copy_completion(delta)
    earlier.add(delta)
    return earlier

"""The engine's view of one request: its ``n`` sequences, their text, stop strings, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.core.outputs import Logprob
from conveyor.outputs import CompletionOutput, RequestMetrics, RequestOutput
from conveyor.request import Request, RequestStatus
from conveyor.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from conveyor.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class Sequence:
    """One of a request's ``n`` samples: a scheduler request plus its decoded text."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why it ended with "error", when it failed alone
    num_tokens_seen: int = 0  # output tokens taken by add_token so far
    # What earlier outputs held (output_kind=DELTA: the next one holds what follows)
    num_chars_sent: int = 0
    num_tokens_sent: int = 0

    def new_token_ids(self) -> list[int]:
        """Output tokens the scheduler appended since the last ``add_token`` (several when a
        step accepted drafted tokens)."""
        return self.request.output_token_ids[self.num_tokens_seen:]

    def add_token(self, token_id: int, logprobs: dict[int, Logprob] | None,
                  last: bool = True) -> str | None:
        """Take the next token the scheduler appended (``last``: the step's last one, the one
        the request's status is about); returns a stop string it completed, if any."""
        params = self.request.sampling_params
        self.num_tokens_seen += 1
        if logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id].logprob
        status = self.request.status if last else RequestStatus.RUNNING
        stopped_on_token = (status == RequestStatus.FINISHED_STOPPED)
        if stopped_on_token and token_id in params.stop_token_ids:
            self.stop_reason = token_id
        if self.detokenizer is None:
            return None
        checked_len = len(self.text)
        # An EOS / stop token's own text is not part of the output.
        if not stopped_on_token or params.include_stop_str_in_output:
            self.text += self.detokenizer.update([token_id])
        if status.finished:
            self.text += self.detokenizer.flush()  # even a trailing incomplete character
        if self.num_tokens_seen <= params.min_tokens:
            return None  # as vLLM: no stop string ends within the first min_tokens tokens
        return self._find_stop_string(params, checked_len)

    def _find_stop_string(self, params: SamplingParams, checked_len: int) -> str | None:
        """The earliest stop string ending in the text past ``checked_len``; cuts the text.

        A match ends past ``checked_len``, so it starts at most ``len(stop) - 1`` characters
        before it, however long the new text (one token can decode to 20+ characters:
        newline plus indentation). ``text[:checked_len]`` held no stop string that counts:
        none, or (within min_tokens) none to stop on, so each is searched from there alone.
        """
        if not params.stop:
            return None
        best: tuple[int, str] | None = None
        for stop in params.stop:
            pos = self.text.find(stop, max(checked_len - len(stop) + 1, 0))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return None
        pos, stop = best
        self.text = self.text[:pos + len(stop)] if params.include_stop_str_in_output \
            else self.text[:pos]
        self.stop_reason = stop
        return stop

    def visible_end(self) -> int:
        """How much of the text is safe to stream: a tail that could still become a stop
        string is held back. It never shrinks (a stop string found later starts inside the
        held-back tail, or after it)."""
        stops = self.request.sampling_params.stop
        if self.finish_reason is not None or not stops:
            return len(self.text)
        return max(len(self.text) - max(len(s) for s in stops) + 1, 0)

    def output(self, kind: RequestOutputKind) -> CompletionOutput:
        """The sequence so far, or (DELTA) what is new since its previous output."""
        end, tokens = self.visible_end(), self.request.output_token_ids
        start_char, start_token = 0, 0
        if kind == RequestOutputKind.DELTA:
            start_char, start_token = self.num_chars_sent, self.num_tokens_sent
            self.num_chars_sent, self.num_tokens_sent = max(end, start_char), len(tokens)
        return CompletionOutput(index=self.index, text=self.text[start_char:end],
                                token_ids=tokens[start_token:],
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason,
                                error=self.error,
                                logprobs=None if self.logprobs is None
                                else self.logprobs[start_token:],
                                cumulative_logprob=(self.cumulative_logprob
                                                    if self.logprobs is not None else None))


@dataclass
class RequestGroup:
    """A user request: ``n`` sequences sharing one prompt (and its KV blocks)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Sequence]
    # Samples 2..n wait until sample 1 has computed the prompt, then reuse its cached blocks.
    pending: list[Request] = field(default_factory=list)
    # The logprobs of prompt tokens 1, 2, ... (params.prompt_logprobs), from sample 1's
    # prefill chunks; whether an output (DELTA) has carried them
    prompt_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    embedding: list[float] | None = None  # params.return_embedding, from sample 1

    def add_prompt_logprobs(self, position: int, entries: list[dict[int, Logprob]]) -> None:
        """Logprobs of prompt tokens ``position``, ``position + 1``, ...: those not held yet
        (a recomputed prompt scores its tokens again)."""
        have = len(self.prompt_logprobs) + 1  # the next position wanted
        if position <= have:
            self.prompt_logprobs.extend(entries[have - position:])

    def _prompt_logprobs_out(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's RequestOutput.prompt_logprobs (None for the first token) once complete:
        in every output, or with DELTA outputs in the first."""
        complete = len(self.prompt_logprobs) == len(self.prompt_token_ids) - 1
        if self.params.prompt_logprobs is None or not complete or (
                self.prompt_logprobs_sent and self.params.output_kind == RequestOutputKind.DELTA):
            return None
        self.prompt_logprobs_sent = True
        return [None, *self.prompt_logprobs]

    @property
    def finished(self) -> bool:
        return not self.pending and all(s.finish_reason is not None for s in self.sequences)

    def output(self) -> RequestOutput:
        first = self.sequences[0].request
        times = first.times
        metrics = RequestMetrics(
            arrival_time=times.arrival, first_scheduled_time=times.first_scheduled,
            first_token_time=times.first_token, last_token_time=times.last_token,
            finished_time=max((s.request.times.finished for s in self.sequences
                               if s.request.times.finished is not None), default=None)
            if self.finished else None,
            num_preemptions=sum(s.request.num_preemptions for s in self.sequences),
            num_generation_tokens=0 if self.params.return_embedding  # (its token is dropped)
            else sum(s.request.num_output_tokens for s in self.sequences))
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids,
                             outputs=[s.output(self.params.output_kind)
                                      for s in self.sequences],
                             finished=self.finished, metrics=metrics,
                             num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=self._prompt_logprobs_out(),
                             embedding=self.embedding)

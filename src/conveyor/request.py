"""One request's state as the scheduler sees it. Layer 0: stdlib only."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from conveyor.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every status after RUNNING... is finished (``status.finished``)."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the step it ran in failed (kernel error, out of memory, a bug)

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop",
                RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort",
                RequestStatus.FINISHED_ERROR: "error"}.get(self)


@dataclass
class RequestTimes:
    """Wall-clock (time.time()) milestones of one request; None until reached."""

    arrival: float = field(default_factory=time.time)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Request:
    """A sequence the scheduler batches: the tokens it owns and how many have KV computed.

    ``all_token_ids`` = prompt + generated. A request needs ``num_tokens -
    num_computed_tokens`` more tokens computed; when that reaches 0 after a step it samples.

    With async scheduling the next step is scheduled while the last one runs: its tokens
    are then ``num_inflight_tokens`` (their K/V being written, counted in
    ``num_computed_tokens`` once the step's results are in) and the token it samples is a
    placeholder (``num_output_placeholders``) until then. Both are 0 between the steps of a
    synchronous engine.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    priority: int = 0  # lower is more urgent (vLLM's convention)
    user: str | None = None  # tenant, for fairness policies
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V steps that finished have written
    num_inflight_tokens: int = 0  # scheduled in steps whose results are not in yet
    num_output_placeholders: int = 0  # tokens those steps sample, ids unknown yet
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0
    output_len_at_preemption: int = -1  # outputs at the last preemption (-1: never)
    swapped_out: bool = False  # its KV waits in host memory (preemption="swap")
    times: RequestTimes = field(default_factory=RequestTimes)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed or being computed: where the next step's tokens start."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the next step may compute (a placeholder's too: its id reaches the runner
        before that step runs)."""
        return self.num_tokens + self.num_output_placeholders - self.num_scheduled_tokens

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed: the request's own limit, capped by the context length."""
        room = self.max_model_len - self.num_prompt_tokens
        limit = self.sampling_params.max_tokens
        return room if limit is None else min(limit, room)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` outputs (a stop string ended the text earlier)."""
        del self.output_token_ids[num_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_tokens:]

    def check_stop(self) -> RequestStatus | None:
        """Stop on EOS or a stop token id (past min_tokens), else on length.

        Stop strings are the engine's job: they need text.
        """
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            last = self.output_token_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

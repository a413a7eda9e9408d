"""Speculative decoding, the scheduler's side: who drafts how many tokens. Layer 0: stdlib.

A running request whose next step is a plain decode may verify drafted tokens in the same
step: the scheduler proposes them (method ngram: prompt lookup over the request's own
verified tokens; method draft_model: only their number, the runner's draft model proposes
the tokens at the start of the step), counts them against the step's token budget and
allocates their KV slots; the runner computes the k+1 tokens as one chunk, keeps the
accepted drafts plus one token it samples, and the scheduler gives back the slots the
rejected drafts held.

How many tokens to draft is decided per request and per step from two measurements:

- the request's acceptance rate ``alpha`` (decayed counts of drafted vs accepted tokens): the
  i-th draft is accepted with probability about ``alpha ** i``;
- the step's cost ``t(T) = a + b*T`` for ``T`` tokens, fitted by least squares over recent
  steps (the scheduler times each step between ``schedule`` and ``update``, less the time
  the runner reports its draft model took), and with a draft model the cost ``c`` of
  proposing one draft token (the draft model's seconds over the draft tokens it proposed,
  over recent drafting steps, once there are 8; 0 for n-gram drafts, whose lookup is not
  timed). A draft
  token costs ``b + c`` more seconds and yields its acceptance probability ``P`` more
  tokens; a step producing ``G`` tokens in ``t`` seconds gains throughput only if
  ``P > G*(b + c)/t``.

So a request drafts its i-th token only while ``alpha ** i`` clears that threshold. When the
batch is large enough that the step is compute-bound (``b*T`` dominates ``a``) the threshold
nears 1 and speculation turns itself off for the step; when the weights' read dominates
(small batches) it is close to 0. A draft model as costly as the target (``c`` near
``t``) keeps it above 1 at any batch size. A request whose drafts keep failing stops drafting
for a back-off that doubles (up to ``MAX_BACKOFF_STEPS``), then drafts again as many as its
acceptance estimate is worth. With
``adaptive: false`` the step's cost is not consulted (the threshold stays 0): every request
with a match drafts up to ``num_speculative_tokens``, back-off included.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field

from conveyor.config import SpeculativeConfig
from conveyor.request import Request

# Acceptance prior (as if this many of DRAFT_PRIOR_TRIED drafts were accepted): an n-gram
# match is a fair hint that the text repeats.
ACCEPT_PRIOR = 1.4
DRAFT_PRIOR_TRIED = 2.0
ACCEPT_DECAY = 0.8  # weight of a request's older verifies in its acceptance rate
COST_WINDOW = 128  # steps the cost fit looks back over
COST_MIN_SAMPLES = 8  # until then (or without spread in T) drafts are not cost-limited
MAX_BACKOFF_STEPS = 32
OFF_THRESHOLD = 0.999  # a step whose drafts would need this acceptance counts as "off"


class NgramProposer:
    """Prompt lookup: the continuation of the first earlier occurrence of the request's last
    n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] (as vLLM: the
    first occurrence of a repeating text has the longest continuation)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) <= self.min_n:
            return []
        ids = array("i", tokens)  # token ids fit int32; bytes.find runs in C
        size, data = ids.itemsize, ids.tobytes()
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            pattern = data[-n * size:]
            end = len(data) - size  # the occurrence must end before the last token
            pos = data.find(pattern, 0, end)
            while pos != -1 and pos % size:  # a match across token boundaries: look on
                pos = data.find(pattern, pos + 1, end)
            if pos != -1:
                start = pos // size + n
                return tokens[start:start + k]
        return []


@dataclass
class SpecDecodeStats:
    """vLLM's spec_decode counters (cumulative)."""

    num_drafts: int = 0  # verifies: request-steps that carried at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted tokens by draft position (index 0: the first draft of a verify)
    accepted_per_pos: list[int] = field(default_factory=list)
    num_steps_off: int = 0  # steps where the cost model let no request draft


@dataclass
class _RequestSpec:
    accepted: float = ACCEPT_PRIOR
    tried: float = DRAFT_PRIOR_TRIED
    backoff: int = 0  # steps to wait before drafting again
    next_backoff: int = 1

    @property
    def alpha(self) -> float:
        return self.accepted / self.tried


class _CostWindow:
    """The last COST_WINDOW (count, seconds) samples of a measured cost (counts > 0)."""

    def __init__(self) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=COST_WINDOW)

    def record(self, count: int, seconds: float) -> None:
        if count > 0:
            self.samples.append((count, seconds))


class StepCostModel(_CostWindow):
    """t(T) = a + b*T over the last COST_WINDOW steps of T tokens (least squares)."""

    def fit(self) -> tuple[float, float] | None:
        n = len(self.samples)
        if n < COST_MIN_SAMPLES:
            return None
        mean_t = sum(t for t, _ in self.samples) / n
        mean_s = sum(s for _, s in self.samples) / n
        var = sum((t - mean_t) ** 2 for t, _ in self.samples)
        if var == 0:
            return None
        b = sum((t - mean_t) * (s - mean_s) for t, s in self.samples) / var
        b = max(b, 0.0)
        return max(mean_s - b * mean_t, 0.0), b

    def draft_threshold(self, num_tokens: int, num_samples: int,
                        draft_cost: float = 0.0) -> float:
        """The acceptance probability a draft token needs to pay for itself in a step of
        ``num_tokens`` tokens where ``num_samples`` requests sample, when proposing it costs
        ``draft_cost`` seconds (0: no fit yet)."""
        fitted = self.fit()
        if fitted is None:
            return 0.0
        a, b = fitted
        step = a + b * num_tokens
        return num_samples * (b + draft_cost) / step if step > 0 else 0.0


class DraftCost(_CostWindow):
    """Seconds per proposed draft token over the last COST_WINDOW drafting steps; 0 until
    COST_MIN_SAMPLES of them (a request's first draft pays for catching up its whole
    prompt: one step alone would price every later draft at that)."""

    @property
    def per_token(self) -> float:
        if len(self.samples) < COST_MIN_SAMPLES:
            return 0.0
        return sum(s for _, s in self.samples) / sum(n for n, _ in self.samples)


class SpecDecoder:
    """Proposes drafts for the scheduler and learns from their verification."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        # A draft model runs in the runner (it proposes at the start of the step): here only
        # the number of its drafts is decided.
        self.proposer = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                         if config.method == "ngram" else None)
        self.cost = StepCostModel()
        self.draft_cost = DraftCost()  # stays empty for n-gram drafts
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._requests: dict[str, _RequestSpec] = {}
        self._threshold = 0.0

    def begin_step(self, num_tokens: int, num_samples: int) -> None:
        """Set this step's threshold from its expected size (tokens and sampling requests
        before any draft); 0 when the config is not adaptive."""
        if not self.config.adaptive:
            return
        self._threshold = self.cost.draft_threshold(num_tokens, num_samples,
                                                    self.draft_cost.per_token)
        if self._threshold >= OFF_THRESHOLD:
            self.stats.num_steps_off += 1

    def num_to_draft(self, request: Request, limit: int) -> int:
        """Drafts worth verifying for ``request`` this step, at most ``limit``."""
        state = self._requests.setdefault(request.request_id, _RequestSpec())
        if state.backoff > 0:
            state.backoff -= 1
            return 0
        k, p = 0, 1.0
        limit = min(limit, self.config.num_speculative_tokens)
        while k < limit and (p := p * state.alpha) > self._threshold:
            k += 1
        return k

    def propose(self, request: Request, limit: int) -> tuple[int, list[int]]:
        """(how many drafts ``request`` verifies this step, their ids): the n-gram match, or
        no ids for a draft model, whose drafts the runner proposes."""
        k = self.num_to_draft(request, limit)
        if not k or self.proposer is None:
            return k, []
        drafts = self.proposer.propose(request.all_token_ids, k)
        return len(drafts), drafts

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """One verify's outcome: ``num_accepted`` of ``num_drafted`` drafts were kept."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            stats.accepted_per_pos[i] += 1
        state = self._requests.setdefault(request_id, _RequestSpec())
        state.accepted = ACCEPT_DECAY * state.accepted + num_accepted
        state.tried = ACCEPT_DECAY * state.tried + num_accepted + (num_accepted < num_drafted)
        if num_accepted == 0:  # nothing gained: wait before drafting again, longer each time
            state.backoff = state.next_backoff
            state.next_backoff = min(2 * state.next_backoff, MAX_BACKOFF_STEPS)
        else:
            state.next_backoff = 1

    def record_step(self, num_tokens: int, seconds: float, num_drafts: int = 0,
                    draft_seconds: float = 0.0) -> None:
        """A step of ``num_tokens`` tokens (drafts included) took ``seconds``, of which the
        draft model took ``draft_seconds`` to propose its ``num_drafts`` drafts."""
        self.cost.record(num_tokens, seconds - draft_seconds)
        if draft_seconds > 0:
            self.draft_cost.record(num_drafts, draft_seconds)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

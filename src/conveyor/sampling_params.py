"""How to sample one request's output, validated at construction (vLLM's field names)."""

from __future__ import annotations

import dataclasses
import enum
import json as _json
import math
from dataclasses import dataclass
from typing import Any

# Bounds on what one request may ask for: they keep one request from hogging the engine.
MAX_N = 16
MAX_LOGPROBS = 20
# Any 64-bit signed seed, as vLLM and OpenAI take it (torch's generators read a negative one
# modulo 2**64); sample i of n uses seed + i.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
# Below this temperature a request decodes greedily (vLLM's _SAMPLING_EPS): logits / 1e-40
# overflow to inf, and the softmax of that is NaN.
GREEDY_TEMPERATURE = 1e-5


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# The forms of StructuredOutputsParams (vLLM's names); exactly one is set.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


# The answer of a request whose only constraint is a thinking budget: any tokens.
ANY_ANSWER = "start: <[*]>*"


@dataclass(frozen=True)
class ReasoningSection:
    """Where a reasoning model thinks before it answers: between ``start`` and ``end`` (as
    tokens where the vocabulary has them, else as text)."""

    start: str
    end: str
    opened: bool = False  # the prompt left the section open: the output begins inside it
    # At most this many tokens inside (then only the end tag; it must be a token); None: any
    budget: int | None = None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output, enforced token by token (vLLM's field names).

    Exactly one of: ``json`` (a JSON Schema, as a dict or its JSON text), ``regex``,
    ``choice`` (the output is one of these strings), ``grammar`` (GBNF/EBNF or Lark),
    ``json_object=True`` (any JSON object). With ``after_reasoning`` the constraint applies
    after that section only (free thinking first: none, or one closed section, when the
    prompt did not open it). The grammar package compiles it; its errors
    (an invalid schema, an unsupported feature) are ValueErrors too, raised when the
    request is added.
    """

    json: dict | str | None = None  # a dict is stored as its JSON text
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    after_reasoning: ReasoningSection | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, dict):  # stored as text: hashable, and the cache's key
            try:
                object.__setattr__(self, "json", _json.dumps(self.json))
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json is not JSON: {e}") from None
        set_kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        _check(len(set_kinds) == 1, "structured_outputs must set exactly one of "
               f"{', '.join(STRUCTURED_OUTPUT_KINDS)}, got {set_kinds or 'none'}")
        _check(self.json is None or isinstance(self.json, dict | str),
               f"structured_outputs.json must be a JSON Schema object, got {self.json!r:.80}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value != ""),
                   f"structured_outputs.{name} must be a non-empty string, got {value!r:.80}")
        if self.choice is not None:
            _check(isinstance(self.choice, tuple) and len(self.choice) > 0
                   and all(isinstance(c, str) and c for c in self.choice),
                   "structured_outputs.choice must be a non-empty list of non-empty strings, "
                   f"got {self.choice!r:.80}")

    @property
    def bounds_thinking_only(self) -> bool:
        """A thinking budget and nothing else (``ANY_ANSWER`` after the section): once the
        output reaches the answer, nothing is left to enforce."""
        return self.grammar == ANY_ANSWER and self.after_reasoning is not None \
            and self.after_reasoning.budget is not None

    @property
    def kind(self) -> str:
        """Which form is set: one of STRUCTURED_OUTPUT_KINDS."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))


class RequestOutputKind(enum.IntEnum):
    """What each of a request's outputs holds (vLLM's names and values)."""

    CUMULATIVE = 0  # all the text, token ids and logprobs so far (the default)
    DELTA = 1  # only what is new since the request's previous output
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping parameters for one request.

    ``temperature=0`` (or below ``GREEDY_TEMPERATURE``) is greedy decoding. ``seed`` makes a
    request's samples reproducible whatever else shares its batch. ``stop`` strings are not
    included in the output text.
    ``min_tokens`` holds back EOS, ``stop_token_ids`` and stop strings (one may begin in the
    first ``min_tokens`` tokens and end after them), as vLLM does.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one too)
    # top-N logprobs per prompt token (the prompt's own token too; the first has none):
    # RequestOutput.prompt_logprobs. Such a request computes its whole prompt (no prefix
    # cache hits), as in vLLM.
    prompt_logprobs: int | None = None
    # The prompt's embedding in RequestOutput.embedding: the last prompt token's final hidden
    # state, L2-normalized (an embedding model's last-token pooling; LLM.embed sets it)
    return_embedding: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # False: token ids only, no text (vLLM's detokenize; stop strings need the text)
    detokenize: bool = True
    # Added to the logits before sampling, {token id: bias in [-100, 100]} (OpenAI's and
    # vLLM's logit_bias: -100 bans a token, +100 all but forces it); None: no bias.
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (vLLM's allowed_token_ids); None: any.
    allowed_token_ids: tuple[int, ...] | None = None
    # Words the output may not contain (vLLM's bad_words): a word's tokens, written with and
    # without a leading space, are banned as a sequence (its last token, once the ones before
    # it were generated).
    bad_words: tuple[str, ...] = ()
    # bad_words as token sequences: the engine fills them in from its tokenizer.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Constrain the output to a JSON Schema, regex, choice or grammar (None: free text).
    structured_outputs: StructuredOutputsParams | None = None
    # What the engine's outputs for this request hold: a stream of deltas costs each step
    # only its new tokens; cumulative outputs copy everything generated so far, each step.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's: free-form arguments for custom sampling plugins; conveyor reads none
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # Accept lists and a single stop string for convenience; store tuples (frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        else:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", (self.bad_words,) if isinstance(self.bad_words, str)
                           else tuple(self.bad_words or ()))  # one word, as stop takes one
        self._validate()
        self._validate_token_filters()
        _check(self.detokenize or not self.stop,
               "stop strings need detokenize=True (they are matched in the text)")

    def _validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, int | float) and not isinstance(value, bool)
                   and math.isfinite(value), f"{name} must be a finite number, got {value!r}")
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N,
               f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(-2 <= self.presence_penalty <= 2,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        _check(-2 <= self.frequency_penalty <= 2,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        _check(self.repetition_penalty > 0,  # (vLLM's bound: above 1 penalizes, below favours)
               f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                   f"max_tokens must be at least 1, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
               f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens,
                   f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.seed is not None:
            _check(isinstance(self.seed, int) and MIN_SEED <= self.seed <= MAX_SEED,
                   f"seed must be an integer in [{MIN_SEED}, {MAX_SEED}], got {self.seed!r}")
        if self.logprobs is not None:
            _check(isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS,
                   f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be non-empty strings, got {self.stop!r}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs must be a StructuredOutputsParams, got "
               f"{type(self.structured_outputs).__name__}")
        _check(isinstance(self.output_kind, RequestOutputKind),
               f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        # A grammar that has ended allows nothing but EOS, which min_tokens bans: refused
        # (a thinking budget's never ends: the answer after the thinking is free).
        _check(self.structured_outputs is None or self.min_tokens == 0
               or self.structured_outputs.bounds_thinking_only,
               "min_tokens must be 0 with structured_outputs (a response_format, tool_choice "
               "or other constraint): the grammar decides where the output ends, got "
               f"{self.min_tokens}")

    def _validate_token_filters(self) -> None:
        if self.prompt_logprobs is not None:
            _check(_is_token_id(self.prompt_logprobs) and self.prompt_logprobs <= MAX_LOGPROBS,
                   f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                   f"{self.prompt_logprobs!r}")
        _check(all(isinstance(w, str) and w.strip() for w in self.bad_words),
               f"bad_words must be words (non-blank strings), got {self.bad_words!r:.80}")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict) and all(
                _is_token_id(t) and isinstance(b, int | float) and not isinstance(b, bool)
                and math.isfinite(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()),
                "logit_bias must map token ids to numbers in [-100, 100], got "
                f"{self.logit_bias!r:.80}")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0
                   and all(_is_token_id(t) for t in self.allowed_token_ids),
                   "allowed_token_ids must be a non-empty list of token ids, got "
                   f"{self.allowed_token_ids!r:.80}")
            # Two masks on the vocabulary could leave no token at all.
            _check(self.structured_outputs is None,
                   "allowed_token_ids cannot be combined with structured_outputs (a "
                   "response_format, tool_choice or other constraint)")

    @property
    def greedy(self) -> bool:
        """temperature 0, or so close to it that sampling would divide by ~0 (vLLM's rule)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def changes_logits(self) -> bool:
        """Whether the sampler changes the logits before choosing (penalties, logit_bias,
        allowed_token_ids): a greedy row then cannot take the plain argmax."""
        return (self.uses_penalties or self.logit_bias is not None
                or self.allowed_token_ids is not None)

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def clone(self) -> SamplingParams:
        """A copy (vLLM's name; these parameters are frozen: ``replace`` changes a copy)."""
        return dataclasses.replace(self)

    @classmethod
    def from_optional(cls, **fields: object) -> SamplingParams:
        """vLLM's: the fields given as None take their defaults."""
        return cls(**{k: v for k, v in fields.items() if v is not None})  # type: ignore[arg-type]


# An embedding's request (LLM.embed, /v1/embeddings): one token is generated (and dropped),
# the embedding comes with it.
EMBEDDING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, return_embedding=True,
                                  detokenize=False)

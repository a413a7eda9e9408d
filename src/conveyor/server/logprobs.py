"""Engine logprobs ({token_id: Logprob} per generated token) in OpenAI's two shapes."""

from __future__ import annotations

import codecs

from conveyor.core.outputs import Logprob
from conveyor.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)

TokenLogprobs = dict[int, Logprob]
# The lowest logprob a response carries, as vLLM's: a token a grammar or allowed_token_ids
# rules out has -inf, which JSON cannot hold (it would go out as null, not a number).
MIN_LOGPROB = -9999.0


def _value(logprob: Logprob) -> float:
    return max(logprob.logprob, MIN_LOGPROB)


def _token_text(token_id: int, logprob: Logprob) -> str:
    # decoded_token is set by the engine whenever the model has a tokenizer.
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def _token_bytes(token_id: int, logprob: Logprob) -> bytes:
    """The token's bytes: a piece of a character's own (its text is U+FFFD), else its text's."""
    if logprob.decoded_bytes is not None:
        return logprob.decoded_bytes
    return _token_text(token_id, logprob).encode("utf-8")


class TextOffsets:
    """Where each token's text starts, in characters: the tokens' bytes decoded in turn, so a
    token that begins a character (an emoji's first bytes) starts where it does, and the
    tokens completing it add it once."""

    def __init__(self, start: int) -> None:
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, token_bytes: bytes) -> int:
        at = self.offset
        self.offset += len(self._decoder.decode(token_bytes))
        return at


def completion_logprobs(token_ids: list[int], logprobs: list[TokenLogprobs],
                        offsets: TextOffsets) -> CompletionLogprobs:
    """/v1/completions shape for generated tokens; offsets: where the first one starts."""
    result = CompletionLogprobs()
    for token_id, candidates in zip(token_ids, logprobs, strict=False):
        sampled = candidates[token_id]
        text = _token_text(token_id, sampled)
        result.tokens.append(text)
        result.token_logprobs.append(_value(sampled))
        result.text_offset.append(offsets.next(_token_bytes(token_id, sampled)))
        ranked = sorted(candidates.items(), key=lambda item: item[1].rank)
        result.top_logprobs.append({_token_text(t, lp): _value(lp) for t, lp in ranked})
    return result


def chat_logprobs(token_ids: list[int], logprobs: list[TokenLogprobs],
                  num_top: int) -> ChatLogprobs:
    """/v1/chat/completions shape: the sampled token and the num_top most likely ones."""
    content = []
    for token_id, candidates in zip(token_ids, logprobs, strict=False):
        sampled = candidates[token_id]
        text = _token_text(token_id, sampled)
        top = sorted(((t, lp) for t, lp in candidates.items() if lp.rank <= num_top),
                     key=lambda item: item[1].rank)[:num_top]
        content.append(ChatTokenLogprob(
            token=text, logprob=_value(sampled), bytes=list(_token_bytes(token_id, sampled)),
            top_logprobs=[TopLogprob(token=_token_text(t, lp), logprob=_value(lp),
                                     bytes=list(_token_bytes(t, lp)))
                          for t, lp in top]))
    return ChatLogprobs(content=content)


def prompt_logprobs(entries: list[TokenLogprobs | None] | None) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs field: per prompt token (None for the first) its candidates,
    keyed by token id (a string in JSON)."""
    if entries is None:
        return None
    return [None if e is None else
            {str(t): PromptLogprob(logprob=_value(lp), rank=lp.rank,
                                   decoded_token=lp.decoded_token) for t, lp in e.items()}
            for e in entries]

"""Streaming detokenization: new text per step, never half a UTF-8 character.

A character can span several byte-level tokens (emoji, CJK), and a sentencepiece decoder can
change the text of earlier tokens (leading-space rules). So each step decodes a small window
`ids[prefix_offset:]` twice — without and with the not-yet-emitted tokens — and emits the
difference, holding it back while it ends in U+FFFD (an incomplete character). This is the
prefix_offset/read_offset scheme of TGI and vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.tokenizer.tokenizer import Tokenizer

# Prompt tokens kept as left context for the first decode, so that the first generated token
# decodes as it would mid-sequence (e.g. keeps its leading space).
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas, cheaply (a window per call)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Invariant: ids[prefix_offset:read_offset] decodes to text already emitted (context);
        # ids[read_offset:] are tokens whose text has not been emitted yet.
        self._ids: list[int] = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return "".join(self._chunks)

    def update(self, new_token_ids: list[int]) -> str:
        """Add generated ids; return the text they complete ("" while a character is split)."""
        self._ids.extend(new_token_ids)
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], skip)
        new_text = decode(self._ids[self._prefix_offset:], skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of a sequence: emit what is held back, even an incomplete character."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset],
                                             self._skip_special_tokens)
        new_text = self._tokenizer.decode(self._ids[self._prefix_offset:],
                                          self._skip_special_tokens)
        delta = new_text[len(prefix_text):]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - INITIAL_CONTEXT_TOKENS, 0)
        if delta:
            self._chunks.append(delta)
        return delta

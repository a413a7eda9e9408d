"""Reasoning models' thinking, read out of their text: ``<think>...</think>`` then the answer.

Qwen3, QwQ and the DeepSeek-R1 distills think between ``<think>`` and ``</think>`` before
they answer. With a reasoning parser the chat endpoints return the thinking apart from the
answer (``message.reasoning``, and ``reasoning_content``, the older name llama.cpp's server
and many clients read), tool calls are parsed out of the answer only, and a constraint
(response_format, a forced tool call) applies to the answer only: the grammar lets the model
think first (``StructuredOutputsParams.after_reasoning``).

Where the thinking starts is read from the rendered prompt, not guessed from the parser's
name: a template that ends its prompt with ``<think>`` (DeepSeek-R1's, Qwen3-Thinking-2507's)
leaves the section open, so the output begins inside it (as does an assistant message
continued after its ``<think>``); otherwise the output may open one itself, first thing
(Qwen3's). vLLM's parser names, ``deepseek_r1`` and ``qwen3``, are taken
and behave alike here.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from conveyor.sampling_params import ReasoningSection
from conveyor.server.tool_parsers import partial_tag

if TYPE_CHECKING:
    from conveyor.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# "auto": the think tags' parser when the vocabulary has both tags as tokens and the chat
# template writes them (as llama.cpp's server does by default); "none": the text as is.
REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3")
THINK = ReasoningSection("<think>", "</think>")


def reasoning_section(name: str, tokenizer: Tokenizer | None) -> ReasoningSection | None:
    """The section the server's --reasoning-parser reads (None: no parsing)."""
    if name == "none" or tokenizer is None:
        return None
    if name != "auto":
        return THINK
    has_tokens = all(tokenizer.token_to_id(tag) is not None for tag in (THINK.start, THINK.end))
    if has_tokens and THINK.start in (tokenizer.chat_template or ""):
        logger.info("reasoning parser: %s...%s (auto: the vocabulary and the chat template "
                    "have them; --reasoning-parser none turns it off)", THINK.start, THINK.end)
        return THINK
    return None


def for_prompt(section: ReasoningSection, prompt: str, prefill: str | None = None
               ) -> ReasoningSection | None:
    """``section`` as the rendered ``prompt`` leaves it, or None when the prompt already
    closed it (Qwen3's template with enable_thinking false writes an empty one): no
    thinking to read, a constraint from the first token (as vLLM). Open (the output begins
    inside it) when the template's generation prompt ends with the start tag (DeepSeek-R1's,
    QwQ's, Qwen3-Thinking-2507's) or, continuing an assistant message (``prefill``, its
    text), when that message's last tag is a start tag. (A tag in a user's words earlier in
    the prompt opens nothing.)"""
    if prefill is not None:
        start, end = prefill.rfind(section.start), prefill.rfind(section.end)
    else:  # (1 or 0: which tag the generation prompt ends with, compared as positions)
        tail = prompt.rstrip()
        start, end = int(tail.endswith(section.start)), int(tail.endswith(section.end))
    if end > start:
        return None
    return dataclasses.replace(section, opened=start > end)


class _State(Enum):
    START = 0  # nothing read yet: the output may open the section (after whitespace)
    OPENING = 1  # just inside the section: its leading whitespace is dropped
    THINKING = 2
    AFTER = 3  # just past the section: the answer's leading whitespace is dropped
    ANSWER = 4


@dataclass
class ReasoningStream:
    """Splits a streamed output into thinking and answer as it arrives.

    Text that may be the start of a tag (or whitespace a tag may follow) is held back until
    the next delta tells; the thinking's surrounding whitespace and the answer's leading
    whitespace are dropped. ``split`` (a whole output) runs the same code, so a stream's
    deltas always add up to the unstreamed answer.
    """

    section: ReasoningSection  # its ``opened``: the prompt left it open
    _state: _State = field(init=False)
    _held: str = field(default="", init=False)  # text waiting for the next delta

    def __post_init__(self) -> None:
        self._state = _State.OPENING if self.section.opened else _State.START

    def update(self, delta: str, finished: bool) -> tuple[str, str]:
        """(thinking, answer) text new with ``delta``; ``finished``: nothing more comes."""
        text, thinking, answer = self._held + delta, [], []
        while True:
            if self._state is _State.START:
                stripped = text.lstrip()
                if stripped.startswith(self.section.start):
                    text, self._state = stripped[len(self.section.start):], _State.OPENING
                    continue
                if self.section.start.startswith(stripped) and not finished:
                    break  # whitespace, or the tag's beginning: wait for more
                self._state = _State.ANSWER
            elif self._state in (_State.OPENING, _State.AFTER):
                stripped = text.lstrip()
                if not stripped and not finished:
                    text = ""
                    break
                text = stripped
                self._state = _State.THINKING if self._state is _State.OPENING else _State.ANSWER
            elif self._state is _State.THINKING:
                end = text.find(self.section.end)
                if end >= 0:
                    thinking.append(text[:end].rstrip())
                    text, self._state = text[end + len(self.section.end):], _State.AFTER
                    continue
                keep = 0 if finished else _held_back(text, self.section.end)
                thinking.append(text[:len(text) - keep])
                text = text[len(text) - keep:]
                break
            else:
                answer.append(text)
                text = ""
                break
        self._held = text
        return "".join(thinking), "".join(answer)


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` wait for the next delta: trailing
    whitespace and a beginning of ``tag`` (they vanish if the tag follows)."""
    body = text[:len(text) - partial_tag(text, tag)]
    return len(text) - len(body.rstrip())


def split(section: ReasoningSection, text: str) -> tuple[str | None, str]:
    """(thinking, answer) of a whole output: thinking None when there is none (no section,
    or an empty one: a stream sends nothing for it either)."""
    thinking, answer = ReasoningStream(section).update(text, finished=True)
    return thinking or None, answer

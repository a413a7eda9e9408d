"""What a chat request's tools, tool_choice and the reasoning parser make of its output:
thinking, content and tool calls, whole (``OutputPlan.parse``) or streamed
(``ChoiceStream``); the usage with its thinking tokens. /v1/chat/completions,
/v1/responses and /v1/messages read their outputs through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.outputs import CompletionOutput, RequestOutput, joined
from conveyor.sampling_params import ReasoningSection
from conveyor.server import reasoning
from conveyor.server.common import usage
from conveyor.server.logprobs import chat_logprobs
from conveyor.server.protocol import (
    ChatChunkChoice,
    ChatLogprobs,
    CompletionTokensDetails,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    Usage,
)
from conveyor.server.structured import Constraint
from conveyor.server.tool_parsers import ParsedToolCall, ToolParser
from conveyor.server.tools import ToolCallStream


@dataclass(frozen=True)
class OutputPlan:
    """What a request's `tools`, `tool_choice` and the reasoning parser make of its output."""

    tools: list[dict[str, Any]] | None  # for the chat template (None: no tools)
    parser: ToolParser | None  # parses tool calls out of the output (None: text only)
    constraint: Constraint | None  # "required" or a named function: the calls' grammar
    # Calls of a named function end with finish_reason "stop", as OpenAI's and vLLM's do;
    # "auto" and "required" ones with "tool_calls".
    named: bool = False
    # The thinking read out of the output first (None: no reasoning parser); the tool calls
    # and the content are read from the answer after it.
    reasoning: ReasoningSection | None = None
    include_reasoning: bool = True  # vLLM's field: False drops the thinking from the answer
    reasoning_end_id: int | None = None  # the end tag's token, to count thinking tokens

    def parse(self, text: str) -> tuple[str | None, str | None, list[ParsedToolCall]]:
        """(thinking, content, calls) of a finished output: the whole text as content
        without a parser."""
        thinking = None
        if self.reasoning is not None:
            thinking, text = reasoning.split(self.reasoning, text)
        content, calls = self.parser.parse(text) if self.parser is not None else (text, [])
        if thinking is not None and not content:
            content = None  # the model thought and never answered (cut by max_tokens)
        return (thinking if self.include_reasoning else None), content, calls

    def reasoning_tokens(self, token_ids: list[int], text: str) -> int:
        """A whole output's thinking tokens (its tags included): up to the end tag, or all
        of them while the thinking goes on."""
        if self.reasoning is None:
            return 0
        if self.reasoning_end_id in token_ids:
            return token_ids.index(self.reasoning_end_id) + 1
        thinking, answer = reasoning.split(self.reasoning, text)
        return len(token_ids) if thinking is not None and not answer else 0

    def usage(self, final: RequestOutput, outputs: list[tuple[list[int], str]]) -> Usage:
        """The request's usage, with its thinking tokens where the server reads thinking
        and can count them (the end tag is a token); ``outputs``: each choice's whole token
        ids and text (a stream's outputs are deltas)."""
        counted = usage([final])
        if self.reasoning is not None and self.reasoning_end_id is not None:
            counted.completion_tokens_details = CompletionTokensDetails(
                reasoning_tokens=sum(self.reasoning_tokens(ids, text) for ids, text in outputs))
        return counted

    def choice_stream(self) -> ChoiceStream:
        """What one streamed choice of this plan has sent so far (nothing yet)."""
        return ChoiceStream(ToolCallStream(self.parser) if self.parser else None, self.named,
                            reasoning.ReasoningStream(self.reasoning)
                            if self.reasoning is not None else None, self.include_reasoning)


def finish_reason(reason: str | None, made_calls: bool, named: bool) -> str | None:
    return "tool_calls" if made_calls and not named and reason == "stop" else reason


def choice_logprobs(c: CompletionOutput, num_top: int) -> ChatLogprobs | None:
    if c.logprobs is None:
        return None
    return chat_logprobs(c.token_ids, c.logprobs, num_top)



@dataclass
class ChoiceStream:
    """What one choice has streamed so far."""

    tools: ToolCallStream | None  # tool calls parsed out of the text (None: text only)
    named: bool  # OutputPlan.named
    thinking: reasoning.ReasoningStream | None = None  # None: no reasoning parser
    include_reasoning: bool = True
    text: str = ""  # the answer so far (the tool-call parser reads it whole)
    token_ids: list[int] = field(default_factory=list)  # the whole output's so far, and
    output_text: str = ""  # its text (the usage counts the thinking's tokens in them)
    held: CompletionOutput | None = None  # a delta not sent (no text yet): its logprobs wait
    made_calls: bool = False
    done: bool = False

    def next_chunk(self, c: CompletionOutput, num_top: int) -> ChatChunkChoice | None:
        """The chunk for the choice's new output (a delta), or None when there is nothing
        to send."""
        if self.done:
            return None
        self.token_ids += c.token_ids
        self.output_text += c.text
        finished = c.finish_reason is not None
        thought, delta = self.thinking.update(c.text, finished) if self.thinking is not None \
            else ("", c.text)
        thought = thought if self.include_reasoning else ""
        c, self.held = joined(self.held, c), None  # with a delta held back last time
        calls: list[DeltaToolCall] = []
        if self.tools is not None:
            self.text += delta
            delta, news = self.tools.update(self.text, finished)
            calls = [DeltaToolCall(index=n.index, id=n.id, type="function" if n.id else None,
                                   function=DeltaFunctionCall(name=n.name, arguments=n.arguments))
                     for n in news]
            self.made_calls = self.made_calls or bool(calls)
        if not delta and not thought and not calls and not finished:
            self.held = c
            return None
        choice = ChatChunkChoice(index=c.index,
                                 delta=DeltaMessage(content=delta or None,
                                                    reasoning=thought or None,
                                                    reasoning_content=thought or None,
                                                    tool_calls=calls or None),
                                 logprobs=choice_logprobs(c, num_top),
                                 finish_reason=finish_reason(c.finish_reason, self.made_calls,
                                                              self.named),
                                 stop_reason=c.stop_reason if finished else None)
        self.done = finished
        return choice

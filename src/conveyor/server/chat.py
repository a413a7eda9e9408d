"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from conveyor.engine.async_engine import RequestStream
from conveyor.outputs import CompletionOutput
from conveyor.sampling_params import (
    ANY_ANSWER,
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutputsParams,
)
from conveyor.server import reasoning
from conveyor.server.common import (
    EngineStreamingResponse,
    ServerState,
    bad_request,
    check_context,
    check_model,
    collect,
    continuous_usage,
    on_stream_error,
    sampling_params,
    sse,
    sse_failures,
    stream_usage,
    submit,
    unless_disconnected,
)
from conveyor.server.errors import APIError, request_id_of
from conveyor.server.logprobs import prompt_logprobs
from conveyor.server.output_plan import ChoiceStream, OutputPlan, choice_logprobs, finish_reason
from conveyor.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaMessage,
    FunctionCall,
    NamedToolChoice,
    TokenizeRequest,
    ToolCall,
)
from conveyor.server.structured import Constraint, check_constraint, request_constraint
from conveyor.server.tool_parsers import get_tool_parser
from conveyor.server.tools import (
    messages_for_template,
    template_supports_tools,
)
from conveyor.structured.compiler import lark_literal

# Names render_chat_template binds itself: chat_template_kwargs may not override them (the
# two flags they may set are read by ``template_flags``).
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt",
                                       "continue_final_message", "bos_token", "eos_token",
                                       "source", "tokenize"})
_TEMPLATE_FLAGS = ("add_generation_prompt", "continue_final_message")

# How errors about the rendered conversation name it (positions count in the rendered text).
_RENDERED = "messages, rendered by the chat template,"


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text content parts joined into a string."""
    result = []
    for i, message in enumerate(messages):
        data = message.model_dump(exclude_none=True)
        if "reasoning" in data:  # vLLM's name for the thinking; templates read the older one
            data.setdefault("reasoning_content", data.pop("reasoning"))
        calls = data.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(
                _is_tool_call(c) for c in calls)):
            raise bad_request(f"messages[{i}].tool_calls must be a list of "
                              '{"id", "type": "function", "function": {"name", "arguments"}} '
                              "(name a string, arguments JSON text)", "messages")
        if isinstance(message.content, list):
            texts = []
            for part in message.content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content: only text parts are supported, "
                                      f"got type {part.type!r}", "messages")
                texts.append(part.text)
            data["content"] = "\n".join(texts)
        result.append(data)
    return result


def _is_tool_call(call: object) -> bool:
    """An earlier assistant turn's call, as OpenAI's API writes one (arguments as an object
    are taken too: the template renders them the same)."""
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str) and \
        bool(function["name"]) and isinstance(function.get("arguments", "{}"), str | dict)


def render_prompt(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                  template_kwargs: dict[str, Any] | None,
                  tools: list[dict[str, Any]] | None = None,
                  continue_final_message: bool = False) -> list[int]:
    """Token ids of the rendered conversation (the template adds any special tokens)."""
    return render_conversation(state, messages, add_generation_prompt, template_kwargs, tools,
                               continue_final_message)[0]


def render_conversation(state: ServerState, messages: list[ChatMessage],
                        add_generation_prompt: bool, template_kwargs: dict[str, Any] | None,
                        tools: list[dict[str, Any]] | None = None,
                        continue_final_message: bool = False) -> tuple[list[int], str]:
    """(token ids, text) of the rendered conversation.

    Whatever is wrong with the messages (the template refuses them, the text is not valid
    Unicode or too long to fit) is a 400 on `messages`. Tools go to a template that renders
    them; otherwise the tool parser's own prompt is added (server/tool_parsers.py).
    """
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so no chat template", "messages")
    kwargs = {k: v for k, v in (template_kwargs or {}).items()
              if k not in _RESERVED_TEMPLATE_KWARGS}
    dicts = template_messages(messages)
    native = template_supports_tools(tokenizer.chat_template)
    if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in dicts):
        dicts = messages_for_template(dicts, tools, get_tool_parser(state.config.tool_call_parser),
                                      native)
    if tools and native:
        kwargs["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt,
                                             continue_final_message, **kwargs)
        state.engine.check_prompt_chars(text, _RENDERED)
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False, field=_RENDERED)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    return ids, text


def template_flags(add_generation_prompt: bool, continue_final_message: bool,
                   template_kwargs: dict[str, Any] | None) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) as the template gets them:
    chat_template_kwargs may set either, and win over the request's fields (as in vLLM)."""
    flags = {"add_generation_prompt": add_generation_prompt,
             "continue_final_message": continue_final_message}
    for name in _TEMPLATE_FLAGS:
        value = (template_kwargs or {}).get(name, flags[name])
        if not isinstance(value, bool):
            raise bad_request(f"chat_template_kwargs.{name} must be true or false, got "
                              f"{value!r:.40}", "chat_template_kwargs")
        flags[name] = value
    if flags["continue_final_message"] and flags["add_generation_prompt"]:
        raise bad_request("continue_final_message needs add_generation_prompt: false (the "
                          "final message is continued, not answered)", "continue_final_message")
    return flags["add_generation_prompt"], flags["continue_final_message"]


def _check_request(req: ChatCompletionRequest) -> int | None:
    """The engine's logprobs count (None: no logprobs); 400 for what is not supported."""
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                              f"{req.top_logprobs}", "top_logprobs")
        if req.top_logprobs and not req.logprobs:  # 0 asks for nothing (as vLLM takes it)
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def plan_tools(state: ServerState, req: ChatCompletionRequest) -> OutputPlan:
    """400 for a tool_choice without tools, a named function not in tools, or "auto"
    without --tool-call-parser (as vLLM)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            raise bad_request("tool_choice needs tools", "tool_choice")
        return OutputPlan(None, None, None)
    if choice == "none":
        return OutputPlan(tools, None, None)
    parser_name = state.config.tool_call_parser
    parser = get_tool_parser(parser_name, req.parallel_tool_calls, forced=choice != "auto")
    if choice == "auto":
        if parser_name is None:
            raise bad_request('tool_choice "auto" needs the server started with '
                              "--tool-call-parser (e.g. hermes)", "tool_choice")
        return OutputPlan(tools, parser, None)
    selected = tools
    if isinstance(choice, NamedToolChoice):
        selected = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not selected:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, "
                              "which is not in tools", "tool_choice")
    tokenizer = state.engine.tokenizer
    literal = functools.partial(lark_literal, tokenizer) if tokenizer else json.dumps
    try:
        grammar = parser.grammar(selected, literal=literal,
                                 parallel=choice == "required" and req.parallel_tool_calls)
    except ValueError as e:
        raise bad_request(str(e), "tools") from None
    return OutputPlan(tools, parser, Constraint(StructuredOutputsParams(grammar=grammar), "tools",
                                              "tools (their function parameters)"),
                    named=isinstance(choice, NamedToolChoice))


@dataclass(frozen=True)
class PreparedChat:
    """A chat request checked, rendered and turned into the engine's terms."""

    ids: list[int]  # the rendered conversation
    params: SamplingParams
    plan: OutputPlan


async def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> PreparedChat:
    """Every check of a chat request (400s naming the field), its sampling parameters, its
    tools and constraint, its conversation rendered (``/v1/responses`` runs through it too)."""
    check_model(state, req.model)
    num_logprobs = _check_request(req)
    add_generation_prompt, continue_final_message = template_flags(
        req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)
    max_tokens, max_tokens_param = (req.max_tokens, "max_tokens") \
        if req.max_completion_tokens is None else \
        (req.max_completion_tokens, "max_completion_tokens")
    plan = plan_tools(state, req)
    constraint = _constraint(req, plan)
    ids, text = await asyncio.to_thread(render_conversation, state, req.messages,
                                        add_generation_prompt, template_kwargs(req),
                                        plan.tools, continue_final_message)
    prefill = template_messages(req.messages[-1:])[0].get("content") or "" \
        if continue_final_message else None
    plan, constraint = _with_reasoning(state, req, plan, constraint, text, prefill)
    try:
        params = sampling_params(req, max_tokens, num_logprobs,
                                 constraint.params if constraint else None,
                                 state.engine.default_sampling)
    except ValueError as e:  # "max_tokens must be ...": name the field the request sent
        if not str(e).startswith("max_tokens") or max_tokens_param == "max_tokens":
            raise
        raise bad_request(max_tokens_param + str(e).removeprefix("max_tokens"),
                          max_tokens_param) from None
    if _keeps_special_tokens(state, plan):
        params = params.replace(skip_special_tokens=False)
    if constraint is not None:
        await check_constraint(state.engine, params, constraint)
    check_context(state, len(ids), max_tokens, "messages", max_tokens_param)
    return PreparedChat(ids, params, plan)


def template_kwargs(req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """chat_template_kwargs, after what reasoning_effort says (theirs win); /tokenize and
    /v1/messages/count_tokens render with the same, so their counts are the chat's."""
    effort = req.reasoning_effort
    kwargs: dict[str, Any] = {"reasoning_effort": effort} if effort else {}
    if effort == "none":
        kwargs["enable_thinking"] = False
    return {**kwargs, **(req.chat_template_kwargs or {})}


def _keeps_special_tokens(state: ServerState, plan: OutputPlan) -> bool:
    """The output's text must keep special tokens: the tool parser's tags are some
    (Mistral's), or the thinking's are (some vocabularies mark <think> special)."""
    if plan.parser is not None and plan.parser.keeps_special_tokens:
        return True
    section = plan.reasoning
    return section is not None and any(state.engine.tokenizer.is_special(tag)
                                       for tag in (section.start, section.end))


def _constraint(req: ChatCompletionRequest, plan: OutputPlan) -> Constraint | None:
    """The request's constraint, or its tool_choice's (400 for both)."""
    constraint = request_constraint(req)
    if plan.constraint is None:
        return constraint
    if constraint is not None:
        raise bad_request(f"tool_choice {req.tool_choice!r} already constrains the output; "
                          f"drop {constraint.param}", constraint.param)
    return plan.constraint


def _with_reasoning(state: ServerState, req: ChatCompletionRequest, plan: OutputPlan,
                    constraint: Constraint | None, prompt: str, prefill: str | None
                    ) -> tuple[OutputPlan, Constraint | None]:
    """The plan reading the thinking out of the output, and the constraint applying after
    it (unless --structured-outputs-in-reasoning), where the server has a reasoning parser;
    the section open or not as the rendered ``prompt`` (or the assistant message it
    continues, ``prefill``) leaves it. A thinking_token_budget is a grammar too (any answer
    after at most that many thinking tokens)."""
    budget = _thinking_budget(state, req)
    section = reasoning.for_prompt(state.reasoning, prompt, prefill) \
        if state.reasoning is not None else None
    if section is None:  # (the prompt closed the section: nothing to think, nor to budget)
        return plan, constraint
    section = dataclasses.replace(section, budget=budget)
    if budget is not None and constraint is None:
        constraint = Constraint(StructuredOutputsParams(grammar=ANY_ANSWER),
                                "thinking_token_budget", "thinking_token_budget")
    elif budget is not None and state.config.structured_outputs_in_reasoning:
        raise bad_request("thinking_token_budget cannot bound the thinking of a constrained "
                          "request on a server started with --structured-outputs-in-reasoning",
                          "thinking_token_budget")
    if constraint is not None and (budget is not None
                                   or not state.config.structured_outputs_in_reasoning):
        constraint = dataclasses.replace(constraint, params=dataclasses.replace(
            constraint.params, after_reasoning=section))
    return dataclasses.replace(
        plan, reasoning=section, include_reasoning=req.include_reasoning,
        reasoning_end_id=state.engine.tokenizer.token_to_id(section.end)), constraint


def _thinking_budget(state: ServerState, req: ChatCompletionRequest) -> int | None:
    """The request's thinking_token_budget (vLLM's); 400 where it cannot apply."""
    budget = req.thinking_token_budget
    if budget is None:
        return None
    if budget < 0:
        raise bad_request(f"thinking_token_budget must be at least 0, got {budget}",
                          "thinking_token_budget")
    if not can_budget_thinking(state):
        raise bad_request("thinking_token_budget needs a reasoning model whose vocabulary has "
                          "the thinking's tags as tokens, and --reasoning-parser",
                          "thinking_token_budget")
    return min(budget, state.engine.max_model_len)  # (more is no bound: the context is)


def can_budget_thinking(state: ServerState) -> bool:
    """The server reads thinking (a reasoning parser) and can bound it: its tags are tokens
    (the grammar allows only the end tag once the budget is spent)."""
    section = state.reasoning
    return section is not None and all(
        state.engine.tokenizer.token_to_id(tag) is not None
        for tag in (section.start, section.end))


def chat_request_of(body: dict[str, Any], names: dict[str, str]) -> ChatCompletionRequest:
    """The chat request another API's request runs as (/v1/responses, /v1/messages); a 400
    naming the caller's field (``names``: chat field -> theirs) when it does not validate.
    Those APIs answer once: an `n` other than 1 (passed on among their extra fields) is a
    400 too."""
    if body.get("n", 1) not in (1, None):
        raise bad_request("one answer per request here: n must be 1", "n")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        loc = [str(x) for x in error.get("loc", ())]
        if loc:  # the caller's name for the field
            loc[0] = names.get(loc[0], loc[0])
        raise bad_request(f"{'.'.join(loc)}: {error.get('msg')}", loc[0] if loc else None) \
            from None


async def prepare_chat_as(state: ServerState, req: ChatCompletionRequest,
                          names: dict[str, str]) -> PreparedChat:
    """``prepare_chat`` for another API's request: its 400s name the caller's fields."""
    try:
        return await prepare_chat(state, req)
    except APIError as e:
        e.param = names.get(e.param or "", e.param)
        raise
    except ValueError as e:  # "max_tokens must be at least 1": name the field sent
        name = str(e).split(" ", 1)[0]
        if name not in names:
            raise
        raise bad_request(names[name] + str(e).removeprefix(name), names[name]) from None


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest,
                                 raw: Request) -> Response | ChatCompletionResponse:
    include_usage = stream_usage(req)
    chat = await prepare_chat(state, req)
    plan = chat.plan
    request_id = f"chatcmpl-{request_id_of(raw)}"
    streams = await submit(state, [chat.ids], chat.params, request_id, req)
    num_top = req.top_logprobs or 0
    if req.stream:
        return EngineStreamingResponse(
            on_stream_error(lambda: _stream(state, request_id, streams[0], num_top,
                                            include_usage, plan, continuous_usage(req)),
                            request_id_of(raw)),
            streams)
    final = await unless_disconnected(raw, collect(streams[0]), streams)
    choices = [_choice(c, num_top, plan) for c in final.outputs]
    return ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices,
                                  usage=plan.usage(final, [(c.token_ids, c.text)
                                                           for c in final.outputs]),
                                  prompt_logprobs=prompt_logprobs(final.prompt_logprobs))


def _choice(c: CompletionOutput, num_top: int, plan: OutputPlan) -> ChatChoice:
    thinking, content, calls = plan.parse(c.text)
    message = AssistantMessage(content=content, reasoning=thinking, reasoning_content=thinking,
                               tool_calls=[
        ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
        for call in calls] or None)
    return ChatChoice(index=c.index, message=message, logprobs=choice_logprobs(c, num_top),
                      finish_reason=finish_reason(c.finish_reason, bool(calls), plan.named),
                      stop_reason=c.stop_reason)


async def _stream(state: ServerState, request_id: str, stream: RequestStream, num_top: int,
                  include_usage: bool, plan: OutputPlan, continuous: bool = False
                  ) -> AsyncIterator[str]:
    created = int(time.time())
    choices: dict[int, ChoiceStream] = {}

    def whole() -> list[tuple[list[int], str]]:  # each choice's output so far
        return [(c.token_ids, c.output_text) for c in choices.values()]

    def chunk(choice: ChatChunkChoice) -> str:
        so_far = plan.usage(final, whole()) if continuous and final is not None else None
        return sse(ChatCompletionChunk(id=request_id, created=created, model=state.model_name,
                                       choices=[choice], usage=so_far).model_dump_json())

    final = None
    async for output in stream:
        final = output
        for c in output.outputs:
            if c.index not in choices:  # the role comes first, alone (as OpenAI does)
                choices[c.index] = plan.choice_stream()
                yield chunk(ChatChunkChoice(index=c.index,
                                            delta=DeltaMessage(role="assistant", content="")))
            choice = choices[c.index].next_chunk(c, num_top)
            if choice is not None:
                yield chunk(choice)
    if include_usage and final is not None:
        yield sse(ChatCompletionChunk(id=request_id, created=created, model=state.model_name,
                                      choices=[], usage=plan.usage(final, whole())
                                      ).model_dump_json())
    if final is not None and (failures := sse_failures([final])):
        yield failures

"""Request and response bodies of the OpenAI-compatible API (pydantic; OpenAI's field names).

Requests check only JSON types and integer ranges here (so no value can overflow a tensor);
the sampling values themselves are validated once, by ``SamplingParams``, whose ``ValueError``
names the field and becomes an HTTP 400. Unknown request fields are ignored with a warning in
the log, as vLLM does, except the fields of vLLM's or OpenAI's API that would change the output
and that this server does not implement (``unsupported``): those are a 400 naming the field.
"""

from __future__ import annotations

import functools
import time
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

# Integers every request field fits in (a sampling seed must fit torch's 64-bit generator).
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """A field sent as null takes its default where null is not one of its values:
        OpenAI's API declares n, stream, logprobs, echo and most options nullable, and
        clients send null for options left unset. (A required field's null stays an error;
        a field that takes None keeps its meaning, e.g. max_tokens: null, as many as fit.)"""
        if not isinstance(data, dict):
            return data
        defaulted = _defaulted_on_null(cls)
        return {key: value for key, value in data.items()
                if value is not None or key not in defaulted}


@functools.cache
def _defaulted_on_null(model: type[BaseModel]) -> frozenset[str]:
    """The fields of ``model`` that have a default and do not take None."""
    return frozenset(name for name, field in model.model_fields.items()
                     if not field.is_required() and type(None) not in get_args(field.annotation))


class StreamOptions(_Request):
    include_usage: bool = True  # as vLLM takes stream_options: {} (OpenAI's clients send it)
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk


class JsonSchemaFormat(_Request):
    """response_format.json_schema (OpenAI's)."""

    name: str = "response"
    description: str | None = None
    # `schema` is a BaseModel attribute: stored as schema_, named "schema" in JSON
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` request field: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class _SamplingFields(_Request):
    """Fields /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # see `unsupported`

    # Fields of vLLM's or OpenAI's API that would change the output and that this server
    # does not implement, each with the value that asks for nothing: a request that sets one
    # to anything but that value, null, [] or {} is a 400 naming it, not an answer that
    # ignored it.
    unsupported: ClassVar[dict[str, Any]] = {
        "logits_processors": None,
        "truncate_prompt_tokens": None, "use_beam_search": False, "length_penalty": 1.0,
        "return_tokens_as_token_ids": False,
        "spaces_between_special_tokens": True, "structural_tag": None,
        "guided_whitespace_pattern": None, "chat_template": None, "documents": None,
        "functions": None, "function_call": None, "prediction": None,
        "mm_processor_kwargs": None,
    }

    model: str | None = None  # None: the served model
    n: Int64 = 1
    temperature: float | None = None  # None: 1.0
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Int64 = 0  # lower is more urgent (vLLM's convention); policies use it
    logit_bias: dict[str, float] | None = None  # {token id as a string: bias}
    allowed_token_ids: list[TokenId] | None = None  # vLLM's
    prompt_logprobs: Int64 | None = None  # vLLM's: the prompt's tokens scored, top N each
    bad_words: list[str] | None = None  # vLLM's
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (at most one of them per request; see server/structured.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    best_of: Int64 | None = None  # only best_of == n is supported
    suffix: str | None = None  # not supported

    unsupported: ClassVar[dict[str, Any]] = {**_SamplingFields.unsupported,
                                             "add_special_tokens": True}


# OpenAI's message roles; an unknown one is a 400 that lists these.
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
# Messages one request may send: far more than a conversation at these context lengths
# holds, and cheap to render (~50 ms); a bound keeps a 100,000-message body from costing
# seconds of CPU (pydantic stops at the bound instead of validating every message).
MAX_MESSAGES_PER_REQUEST = 2048


# Tools one request may define (OpenAI's limit).
MAX_TOOLS = 128


class TextContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message; extra keys (e.g. tool_calls) are passed to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: ChatRole
    content: str | list[TextContentPart] | None = None
    name: str | None = None


# A conversation: not empty (OpenAI and vLLM refuse that; the model would otherwise generate
# from a bare assistant prompt up to the whole context), at most MAX_MESSAGES_PER_REQUEST.
Messages = Annotated[list[ChatMessage],
                     Field(min_length=1, max_length=MAX_MESSAGES_PER_REQUEST)]


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Messages
    max_tokens: Int64 | None = None  # None: up to the context length
    max_completion_tokens: Int64 | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # continue the last (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM's: False drops a reasoning model's thinking
    # OpenAI's: to the chat template as reasoning_effort (as vLLM); "none" also sends
    # enable_thinking false (Qwen3's template reads it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's: at most this many thinking tokens, then the end tag is forced (a grammar)
    thinking_token_budget: Int64 | None = None

    unsupported: ClassVar[dict[str, Any]] = {**_SamplingFields.unsupported, "echo": False,
                                             "best_of": 1, "add_special_tokens": False}


class EmbeddingRequest(_Request):
    """POST /v1/embeddings (OpenAI's): one input or many, text or token ids."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None  # the first N components, normalized again
    user: str | None = None
    priority: Int64 = 0  # (vLLM's)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: little-endian float32s


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class TokenizeRequest(_Request):
    """POST /tokenize: a prompt, or chat messages rendered through the template (with the
    tools and template kwargs a chat request would send: the same count)."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    return_token_strs: bool = False  # vLLM's: each token as the vocabulary writes it


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------------- responses
def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # a reasoning model's thinking, its tags included


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    # Where the server reads thinking (and its end tag is a token): left out otherwise
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default=None, exclude_if=lambda v: v is None)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class PromptLogprob(BaseModel):
    """One candidate of a prompt position, as vLLM's prompt_logprobs give it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token (None for the first): {token id as a string: its logprob}
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Delta(BaseModel):
    """A stream's delta: what it does not carry is left out, not sent as null (as OpenAI's
    and vLLM's streams do: a client testing `"tool_calls" in delta` must not find None)."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Delta):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Delta):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # A reasoning model's thinking (server/reasoning.py): vLLM's name, and llama.cpp's
    # (which many clients read); left out when there is none
    reasoning: str | None = Field(default=None, exclude_if=lambda v: v is None)
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    # Left out of the answer when the model made no call (as OpenAI does)
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked


class DeltaMessage(_Delta):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # as AssistantMessage's
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "conveyor"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------- /v1/responses
class ResponsesContentPart(_Request):
    """A text part of an input message (input_text; output_text in an earlier answer)."""

    type: str
    text: str | None = None


class ResponsesInputItem(_Request):
    """One input item: a message (``type`` "message", or left out with a ``role``), an
    earlier answer's function call, or a function call's output."""

    type: str | None = None
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[ResponsesContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ResponsesContentPart] | None = None


class ResponsesTool(_Request):
    """A tool as the Responses API writes it: the function's fields at the top level."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedTool(_Request):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Request):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(_Request):
    """POST /v1/responses (stateless: no stored responses). Fields it does not name go to the
    chat request it runs as (vLLM's sampling extras: top_k, seed, stop, ...)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    input: str | Annotated[list[ResponsesInputItem],
                           Field(min_length=1, max_length=MAX_MESSAGES_PER_REQUEST)]
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: ResponsesText | None = None
    tools: Annotated[list[ResponsesTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: bool = True
    store: bool = True  # nothing is stored: answered with store false
    previous_response_id: str | None = None  # needs stored responses: a 400
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: Int64 | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None  # its "effort": the chat's reasoning_effort


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class ResponseOutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[ResponseOutputText]


class ResponseReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ResponseReasoningItem(BaseModel):
    """A reasoning model's thinking (server/reasoning.py), as its text (no summary)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ResponseReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


ResponseOutputItem = ResponseReasoningItem | ResponseOutputMessage | ResponseFunctionCall


class ResponseInputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class ResponseOutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails = Field(
        default_factory=ResponseOutputTokensDetails)
    total_tokens: int


class ResponseIncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """A response, as OpenAI's Responses API answers (and streams in its events)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=_now)
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[ResponseOutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: ResponseIncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    store: bool = False
    previous_response_id: None = None
    background: bool = False
    truncation: Literal["disabled"] = "disabled"
    reasoning: dict[str, Any] | None = None


# ---------------------------------------------------------------------- /v1/messages
class AnthropicTextBlock(_Request):
    type: str = "text"
    text: str | None = None


class AnthropicBlock(_Request):
    """A content block of a message: text, tool_use (an assistant's call), tool_result (its
    answer, in a user message), thinking; others (image, document) are refused."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[AnthropicTextBlock] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # a thinking block's (its signature is not read)


class AnthropicMessage(_Request):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[AnthropicBlock], Field(max_length=MAX_MESSAGES_PER_REQUEST)]


class AnthropicTool(_Request):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # a server tool's (web_search_...): refused


class AnthropicToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    messages: Annotated[list[AnthropicMessage],
                        Field(min_length=1, max_length=MAX_MESSAGES_PER_REQUEST)]
    system: str | list[AnthropicTextBlock] | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    # {"type": "disabled"}: enable_thinking false to the chat template; "enabled" with
    # budget_tokens: thinking_token_budget where the server can bound thinking (else
    # ignored: the template decides whether a reasoning model thinks)
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages (Anthropic's Messages API). Fields it does not name go to the chat
    request it runs as (vLLM's sampling extras)."""

    max_tokens: Int64
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    metadata: dict[str, Any] | None = None


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicTextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class AnthropicThinkingOut(BaseModel):
    """A reasoning model's thinking (server/reasoning.py); no signature to verify here."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class AnthropicToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(BaseModel):
    input_tokens: int  # not read from the prefix cache (Anthropic's meaning)
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[AnthropicThinkingOut | AnthropicTextOut | AnthropicToolUseOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: AnthropicUsage

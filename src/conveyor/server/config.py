"""The HTTP server's settings: one frozen dataclass, each field a `conveyor serve` flag of the
same name (the engine's own arguments are `EngineArgs`)."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config import _require
from conveyor.server.reasoning import REASONING_PARSERS
from conveyor.server.tool_parsers import TOOL_PARSERS

DEFAULT_MAX_BODY_BYTES = 8 << 20
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerConfig:
    """What `conveyor serve` adds around the engine: address, guards, timeouts, logging."""

    host: str = "127.0.0.1"  # loopback unless asked: no accidental exposure
    port: int = 8000
    # None: no key; else 'Authorization: Bearer KEY' (or 'X-Api-Key: KEY') on /v1/*,
    # /tokenize, /detokenize, /stats
    api_key: str | None = None
    # Requests that may wait beyond those that can run at once (free slots under
    # max_num_seqs); past it new requests get 429 with Retry-After. None: unbounded.
    max_queued_requests: int | None = None
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # After the first SIGTERM/SIGINT: how long in-flight requests may take to finish before
    # they end with an error (streams: an SSE error event and [DONE]).
    shutdown_timeout: float = 30.0
    # An open connection with no request in progress is closed after this many seconds
    # (uvicorn's keep-alive timeout, applied to fresh connections too).
    timeout_keep_alive: int = 5  # whole seconds, as uvicorn takes it
    # A request's headers must arrive within this many seconds of its first byte (slowloris).
    timeout_read_headers: float = 15.0
    # A request's body must arrive within this many seconds of its headers (a declared
    # Content-Length never sent in full): 408, then the connection closes.
    timeout_read_body: float = 60.0
    disable_log_requests: bool = False  # no access log line per request
    # The page at / (chat, live engine view) and /v1/engine/events, /v1/engine/load.
    web_ui: bool = True
    uvicorn_log_level: str = "warning"  # uvicorn's own messages (ours are at --log-level)
    # How tool calls are read out of the model's text (vLLM's names; None: tool_choice
    # "auto" is refused, "required" and named functions use hermes's syntax)
    tool_call_parser: str | None = None
    # How a reasoning model's thinking is read out of its text (server/reasoning.py): auto
    # (<think>...</think> where the vocabulary and the chat template have them), none, or
    # vLLM's names deepseek_r1 and qwen3 (both <think>...</think> here)
    reasoning_parser: str = "auto"
    # A constraint (response_format, a forced tool call) applies to the thinking too (vLLM's
    # enable_in_reasoning); by default it applies to the answer after it
    structured_outputs_in_reasoning: bool = False

    def __post_init__(self) -> None:
        _require(0 <= self.port < 65536, "port", "in [0, 65535]", self.port)
        _require(self.max_queued_requests is None or self.max_queued_requests >= 1,
                 "max_queued_requests", ">= 1 (or unset)", self.max_queued_requests)
        _require(self.max_request_body_bytes >= 1, "max_request_body_bytes", ">= 1",
                 self.max_request_body_bytes)
        # An empty key (CONVEYOR_API_KEY="" in a compose file) would lock every client out:
        # refused, so that no key is meant by leaving it unset.
        _require(self.api_key is None or self.api_key.strip() != "", "api_key",
                 "a non-empty key (or unset, also $CONVEYOR_API_KEY, for none)", self.api_key)
        _require(self.uvicorn_log_level.lower() in UVICORN_LOG_LEVELS, "uvicorn_log_level",
                 f"one of {', '.join(UVICORN_LOG_LEVELS)}", self.uvicorn_log_level)
        _require(self.tool_call_parser is None or self.tool_call_parser in TOOL_PARSERS,
                 "tool_call_parser", f"one of {', '.join(TOOL_PARSERS)}", self.tool_call_parser)
        _require(self.reasoning_parser in REASONING_PARSERS, "reasoning_parser",
                 f"one of {', '.join(REASONING_PARSERS)}", self.reasoning_parser)
        for name in ("shutdown_timeout", "timeout_keep_alive", "timeout_read_headers",
                     "timeout_read_body"):
            value = getattr(self, name)
            _require(value > 0, name, "> 0 seconds", value)

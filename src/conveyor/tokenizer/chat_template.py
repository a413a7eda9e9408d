"""Render a model's Jinja chat template the way transformers' apply_chat_template does."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The template itself raised (raise_exception) or failed to render."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; HF templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlocks(Extension):
    """``{% generation %}...{% endgeneration %}``, transformers' mark of the assistant's
    tokens (for training masks, ``return_assistant_tokens_mask``): rendered as its body, as
    transformers renders it when it does not track them."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return str(caller())


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    # trim_blocks + lstrip_blocks, loop controls, {% generation %}, and these helpers: as
    # transformers sets up.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationBlocks])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja: {e}") from e


def validate_messages(messages: object) -> None:
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role'")
        if "content" not in message and "tool_calls" not in message:
            raise ValueError(f"messages[{i}] needs a 'content'")


def render_chat_template(source: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                         **variables: Any) -> str:
    """The prompt text; ValueError when the messages are malformed or the template fails."""
    validate_messages(messages)
    template = compile_template(source)
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **variables)
    except TemplateError as e:
        raise ValueError(f"the chat template rejected the messages: {e}") from e
    except (jinja2.TemplateError, TypeError, KeyError, AttributeError, IndexError) as e:
        raise ValueError(f"the chat template failed to render: {type(e).__name__}: {e}") from e


def open_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """The rendered conversation cut right after the final message's text, so that the model
    continues that message (``continue_final_message``, an assistant reply's start given by
    the user), as transformers' apply_chat_template does: the text's last occurrence of the
    message, or of the message stripped (some templates strip what they render)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a final message with text content")
    for piece in (final, final.strip()):
        start = text.rfind(piece)
        if start != -1:
            return text[:start + len(piece)]
    raise ValueError("continue_final_message: the chat template does not render the final "
                     "message's text")

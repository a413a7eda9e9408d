"""vLLM's prompt dicts, for type checkers: ``LLM.generate`` takes them (and plain strings or
token-id lists)."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]

"""A request's structured-output fields -> StructuredOutputsParams, and its compile check.

Accepted (at most one per request): OpenAI's `response_format` (`json_object`,
`json_schema`), vLLM's `structured_outputs` {json, regex, choice, grammar, json_object} and
its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. Every error is a
400 whose `param` is the field the client sent and whose message names the path inside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.engine.async_engine import AsyncEngine
from conveyor.sampling_params import SamplingParams, StructuredOutputsParams
from conveyor.server.errors import bad_request
from conveyor.server.protocol import _SamplingFields
from conveyor.structured.compiler import GrammarError

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    """A request's constraint and where it came from (for error messages)."""

    params: StructuredOutputsParams
    param: str  # the request field: response_format, structured_outputs, guided_json...
    path: str  # where the constraint sits in the body, e.g. response_format.json_schema.schema


def request_constraint(req: _SamplingFields) -> Constraint | None:
    """The request's constraint, or None for free text; 400 when malformed or ambiguous."""
    found: list[tuple[str, str, dict[str, Any]]] = []  # (param, path, kwargs)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", "response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format.json_schema.schema is required with type "
                              "json_schema", "response_format")
        found.append(("response_format", "response_format.json_schema.schema",
                      {"json": fmt.json_schema.schema_}))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        kwargs: dict[str, Any] = {k: v for k, v in (("json", so.json_), ("regex", so.regex),
                                    ("choice", so.choice), ("grammar", so.grammar),
                                    ("json_object", so.json_object)) if v}
        kind = next(iter(kwargs), "")
        found.append(("structured_outputs", f"structured_outputs.{kind}".rstrip("."), kwargs))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, name, {kind: value}))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"send one constraint, not {len(found)}: "
                          f"{', '.join(p for p, _, _ in found)}", found[1][0])
    param, path, kwargs = found[0]
    try:
        return Constraint(StructuredOutputsParams(**kwargs), param, path)
    except ValueError as e:
        raise bad_request(f"{path}: {e}", param) from None


async def check_constraint(engine: AsyncEngine, params: SamplingParams,
                           constraint: Constraint) -> None:
    """Compile the constraint in a worker thread (cached for the engine); 400 when the
    grammar engine refuses it, is too slow (compile timeout) or it is too large."""
    try:
        await engine.compile_grammar(params)
    except GrammarError as e:
        raise bad_request(f"{constraint.path}: {e.detail}", constraint.param) from None

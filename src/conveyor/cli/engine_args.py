"""Every EngineArgs field as a command-line flag of the same name (dashes or underscores),
grouped by the section that declares it; the same for any other frozen settings dataclass
(`add_dataclass_flags`). Help texts come from the fields' metadata (`config.setting`)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from conveyor.config import ENGINE_SECTIONS, EngineArgs

_GROUPS = {"LoadConfig": "model", "ParallelConfig": "parallelism", "CacheConfig": "KV cache",
           "SchedulerConfig": "scheduler", "StructuredOutputsConfig": "structured outputs"}


def _base_type(hint: Any) -> Any:
    """The flag's type: the annotation without None; str for real unions (parsed later)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0] if len(args) == 1 else str
    return hint


def _flag_type(f: dataclasses.Field[Any], hints: dict[str, Any]) -> Any:
    return f.metadata.get("flag_type") or _base_type(hints[f.name])


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """The engine's flags, one argument group per section, then the engine's own."""
    for section in ENGINE_SECTIONS:
        group = parser.add_argument_group(f"engine: {_GROUPS[section.__name__]}")
        add_dataclass_flags(group, section, skip=skip, defaults=EngineArgs())
    in_sections = {f.name for s in ENGINE_SECTIONS for f in dataclasses.fields(s)}
    add_dataclass_flags(parser.add_argument_group("engine"), EngineArgs,
                        skip=(*skip, *in_sections))


def add_dataclass_flags(group: Any, cls: type, helps: dict[str, str] | None = None,
                        skip: tuple[str, ...] = (), defaults: Any = None) -> None:
    """One flag per field of the dataclass `cls` (dashes or underscores), its default the
    field's (or that of `defaults`); booleans get --name / --no-name. The help is the
    field's metadata "help" (or `helps[name]`)."""
    defaults = cls() if defaults is None else defaults
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flags = [f"--{f.name.replace('_', '-')}"]
        if "_" in f.name:
            flags.append(f"--{f.name}")
        flags += f.metadata.get("aliases", ())
        default = getattr(defaults, f.name)
        kind = _flag_type(f, hints)
        text = f.metadata.get("help") or (helps or {}).get(f.name, "")
        help_text = text if "default:" in text else f"{text} (default: {default})"
        help_text = help_text.replace("%", "%%")  # argparse %-formats help ("+0.5 %")
        if kind is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=default, help=help_text)
        else:
            group.add_argument(*flags, dest=f.name, type=kind, default=default, help=help_text,
                               **({"nargs": f.metadata["nargs"]}
                                  if f.metadata.get("nargs") else {}))


def engine_args_from(ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
    values = {name: getattr(ns, name) for name in EngineArgs.field_names()
              if hasattr(ns, name)}
    values.update(overrides)
    return EngineArgs(**values)


def parse_engine_override(text: str) -> tuple[str, Any]:
    """"name=value" -> (an EngineArgs field, the value in its type), e.g. for a second engine
    that differs from the first in one argument. ValueError names what is wrong."""
    name, sep, raw = text.partition("=")
    name = name.strip().replace("-", "_")
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    if not sep or name not in fields:
        raise ValueError(f"expected NAME=VALUE with NAME an engine argument, got {text!r}")
    kind = _flag_type(fields[name], typing.get_type_hints(EngineArgs))
    if kind is bool:
        if raw.lower() not in ("true", "false", "1", "0", "on", "off"):
            raise ValueError(f"{name} takes true or false, got {raw!r}")
        return name, raw.lower() in ("true", "1", "on")
    return name, kind(raw)

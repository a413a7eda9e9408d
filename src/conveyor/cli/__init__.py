"""The `conveyor` command: generate, serve, bench, plan, simulate."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Any

# Sub-commands, each a module with `register(subparsers)`; imported only when listed so that
# `conveyor plan` does not pay for torch.
_COMMANDS = ("conveyor.cli.generate", "conveyor.server.cli", "conveyor.bench.cli",
             "conveyor.planner.cli", "conveyor.sim.cli")


class _Parser(argparse.ArgumentParser):
    """No abbreviated flags (``--n`` is not ``--no-quantized-matmuls``'s start, and a flag
    added later cannot change what an abbreviation meant); sub-commands' parsers too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="conveyor", description=__doc__)
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in _COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue  # not built yet
        module.register(subparsers)
    return parser


def check_outputs(args: argparse.Namespace) -> None:
    """Where a command will write (--result-file, --output, --plot-dir) checked before it
    runs: a benchmark that fails to save after minutes of work wastes them."""
    for flag in ("result_file", "output"):
        path = getattr(args, flag, None)
        if not isinstance(path, str) or not path:
            continue
        name = "--" + flag.replace("_", "-")
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise ValueError(f"{name} {path!r} is a directory, not a file")
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK) or (
                os.path.exists(path) and not os.access(path, os.W_OK)):
            raise ValueError(f"{name} {path!r} cannot be written (is {folder!r} a writable "
                             "folder?)")
    plot_dir = getattr(args, "plot_dir", None)
    if isinstance(plot_dir, str) and os.path.exists(plot_dir) and not os.path.isdir(plot_dir):
        raise ValueError(f"--plot-dir {plot_dir!r} is a file, not a folder")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_outputs(args)
        return int(args.func(args) or 0)
    except (ValueError, OSError) as e:  # bad input, or a path that cannot be read or written
        print(f"conveyor: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: stop quietly, with the shell's status for it
        print("conveyor: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The `conveyor` command: generate, serve, bench, plan, simulate."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Sub-commands, each a module with `register(subparsers)`; imported only when listed so that
# `conveyor plan` does not pay for torch.
_COMMANDS = ("conveyor.cli.generate", "conveyor.server.cli", "conveyor.bench.cli",
             "conveyor.planner.cli", "conveyor.sim.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"conveyor: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

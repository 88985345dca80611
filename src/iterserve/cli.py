"""The `iterserve` console script. Each subcommand lives with the layer it drives.

A subcommand module exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int` as the handler. Modules are imported lazily so `iterserve lab` never
imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (subcommand, module that registers it)
SUBCOMMANDS = [
    ("serve", "iterserve.server.cli"),
    ("generate", "iterserve.engine.cli"),
    ("lab", "iterserve.lab.cli"),
    ("bench", "iterserve.bench.cli"),
]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iterserve",
        description="LLM serving with iteration-level (continuous) batching.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS:
        if only is not None and name != only:
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:     # the layer is not built yet
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Import only the module of the subcommand asked for (keeps `iterserve lab` torch-free).
    first = next((a for a in argv if not a.startswith("-")), None)
    known = {name for name, _ in SUBCOMMANDS}
    parser = build_parser(first if first in known else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

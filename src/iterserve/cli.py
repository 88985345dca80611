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

# Handlers a subcommand runs from a layer above its own, set as defaults of its parser
# (subcommand -> {default name: "module:function"}), imported only when called:
# `iterserve lab --serve` serves the server's app, and the lab imports nothing from the server.
HANDLERS = {"lab": {"serve_lab_page": "iterserve.server.lab_page:serve"}}


def _handler(target: str):
    module, name = target.split(":")

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)
    return call


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
        sub_parser = mod.register(sub)
        if name in HANDLERS:
            sub_parser.set_defaults(**{k: _handler(v) for k, v in HANDLERS[name].items()})
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

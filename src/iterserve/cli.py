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


def parse_args(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The command line parsed, `serve --config FILE` (vLLM's YAML) expanded into flags first;
    argparse exits 2 on a bad one, as it does for any unknown or malformed flag."""
    # Import only the module of the subcommand asked for (keeps `iterserve lab` torch-free).
    first = next((a for a in argv if not a.startswith("-")), None)
    known = {name for name, _ in SUBCOMMANDS}
    parser = build_parser(first if first in known else None)
    if first == "serve" and any(a == "--config" or a.startswith("--config=") for a in argv):
        from iterserve.server.cli import expand_config_file  # FastAPI: for serve only
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        try:
            argv = ["serve"] + expand_config_file(argv[argv.index("serve") + 1:],
                                                  sub.choices["serve"])
        except ValueError as e:
            parser.exit(2, f"iterserve serve: {e}\n")
    return parser, parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(sys.argv[1:] if argv is None else argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

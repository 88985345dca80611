"""Structured outputs: constrain generation to a JSON schema, regex, choice or grammar.

`params` is plain data (torch-free; core's SamplingParams can carry it). The grammar engine
(`backend`, llguidance) and the batched masks (`bitmask`, torch) are imported on first use,
so importing this package costs nothing for a process that never constrains a request.
"""

from iterserve.structured.params import KINDS, StructuredOutputsParams

_LAZY = {
    "StructuredOutputCompiler": "backend", "CompiledGrammar": "backend",
    "GrammarMatcher": "backend", "build_ll_tokenizer": "backend",
    "allocate_bitmask": "bitmask", "fill_bitmasks": "bitmask", "apply_bitmask": "bitmask",
    "GrammarBitmask": "bitmask",
}

__all__ = ["KINDS", "StructuredOutputsParams", *_LAZY]


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'iterserve.structured' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"iterserve.structured.{mod}"), name)

"""`tool_choice` "required" or a named function, as a structured-output constraint.

vLLM forces these choices with a grammar so the arguments are valid for the function's
`parameters` schema; so do we. The constraint reproduces the call format of the parser in
use, so the same parser then reads the calls back:

- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (one, or several
  joined by a newline when `parallel_tool_calls` and the choice is "required")
- llama3_json: `{"name": ..., "parameters": {...}}` (several joined by "; ")
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the special token by id
  when the tokenizer has it)

The call object is a JSON schema (an anyOf over the tools, "name" a const, the arguments
the tool's `parameters` closed to the keys it declares, tools/schema.py) embedded in an
llguidance Lark grammar (`%json`), written with ", " and ": " separators and no other
whitespace, as the chat templates show the format.

The call list is closed: at most `max_calls` calls (MAX_PARALLEL_CALLS by default, one
without parallel calls), after which the grammar allows only the end of the output, so a
model that would keep adding calls stops instead of running into max_tokens with a call cut
in half. (A call max_tokens still cuts is left out of the reply: tools/plan.py.)
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from iterserve.errors import ToolChoiceError
from iterserve.structured.params import StructuredOutputsParams
from iterserve.tools.schema import closed_schema


MAX_PARALLEL_CALLS = 8
"""Calls one forced reply may hold: more than parallel tool use asks of a model in practice
(a few independent look-ups), few enough that a model that never chooses to stop ends its
list within a few hundred tokens."""

_ARGS_KEY = {"hermes": "arguments", "llama3_json": "parameters", "mistral": "arguments"}
_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _as_dict(x: Any) -> Any:
    return x.model_dump(exclude_none=True) if hasattr(x, "model_dump") else x


def normalize_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]]:
    """Check OpenAI's `tools` list; returns the `function` objects."""
    out = []
    for i, tool in enumerate(tools or ()):
        tool = _as_dict(tool)
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise ToolChoiceError(f"{where} must be {{'type': 'function', 'function': {{...}}}}",
                                  where)
        fn = _as_dict(tool.get("function"))
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolChoiceError(f"{where}.function.name must be a non-empty string",
                                  f"{where}.function.name")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise ToolChoiceError(f"{where}.function.parameters must be a JSON schema object",
                                  f"{where}.function.parameters")
        out.append({**fn, "parameters": dict(params)})
    return out


def _call_schema(functions: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    options = [{"type": "object",
                "properties": {"name": {"const": f["name"]},
                               args_key: closed_schema(f["parameters"],
                                                       strict=f.get("strict") is True)},
                "required": ["name", args_key], "additionalProperties": False}
               for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": dict(_FORMAT)}


def tool_choice_constraint(tools: Sequence[Any] | None, tool_choice: Any,
                           parser: str = "hermes", *, parallel_tool_calls: bool = True,
                           tokenizer: Any = None, max_calls: int = MAX_PARALLEL_CALLS
                           ) -> StructuredOutputsParams | None:
    """The constraint that forces `tool_choice`, or None when nothing is forced ("auto",
    "none", or no choice). `tokenizer` lets the mistral format name its special token;
    `max_calls` bounds the calls of "required" with parallel calls."""
    tool_choice = _as_dict(tool_choice)
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    functions = normalize_tools(tools)
    if not functions:
        raise ToolChoiceError("tool_choice needs a non-empty tools list", "tools")
    if parser == "openai":                 # gpt-oss's harmony call (tools/harmony.py)
        from iterserve.tools.harmony import forced_call_constraint
        return forced_call_constraint(functions, tool_choice, tokenizer)
    if parser not in _ARGS_KEY:
        raise ValueError(f"no tool_choice format for parser {parser!r}; "
                         f"known: {', '.join(sorted(_ARGS_KEY))}")
    if tool_choice == "required":
        chosen, many = functions, bool(parallel_tool_calls)
    elif isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        name = (_as_dict(tool_choice.get("function")) or {}).get("name")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise ToolChoiceError(f"tool_choice names function {name!r}, which is not in tools",
                                  "tool_choice")
        many = False
    else:
        raise ToolChoiceError("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if max_calls < 1:
        raise ValueError(f"max_calls must be at least 1, got {max_calls}")
    schema = json.dumps(_call_schema(chosen, _ARGS_KEY[parser]), ensure_ascii=False)

    def more(sep: str, item: str) -> str:
        """The calls after the first: none, or up to max_calls - 1 more."""
        if not many or max_calls == 1:
            return ""
        return f' ({sep} {item}){{0,{max_calls - 1}}}'

    if parser == "hermes":
        body = 'start: call' + more('"\\n"', "call") + '\n' \
               'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
    elif parser == "llama3_json":
        body = 'start: body' + more('"; "', "body") + '\n'
    else:
        tid = tokenizer.token_to_id("[TOOL_CALLS]") if tokenizer is not None else None
        tag = f"<[{tid}]>" if tid is not None else '"[TOOL_CALLS]"'
        body = f'start: {tag} "[" body' + more('", "', "body") + ' "]"\n'
    return StructuredOutputsParams(grammar=body + f"body: %json {schema}\n", source="tool_choice")

"""Tool calling for the offline `LLM.chat(messages, tools=...)`: the same pieces the server
uses (iterserve.tools: the template's tool dicts, the forcing grammar of tool_choice
"required" / named, the hermes / llama3_json / mistral parsers), without HTTP.

vLLM's offline chat hands the template `tools` and leaves the output as text; here each
output of a request with tools is parsed too, so the caller gets
`CompletionOutput.tool_calls` and `.content` as the server's `message` would have them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Sequence

from iterserve.core.request import SamplingParams
from iterserve.engine.errors import InvalidRequestError

DEFAULT_TOOL_PARSER = "hermes"


def template_messages(conv: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates want them: an assistant's tool_calls with their arguments as
    objects (clients keep them as JSON text, as OpenAI sends them) and null content as "",
    like the server does."""
    out = []
    for m in conv:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            m = dict(m, tool_calls=[_with_object_arguments(c) for c in calls])
            if m.get("content") is None:
                m["content"] = ""            # OpenAI's null content of a call-only message
        out.append(m)
    return out


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass
    return dict(call, function=fn)


@dataclass
class OfflineToolPlan:
    tools: list[dict[str, Any]]
    choice: Any
    parser_name: str | None          # None: tool_choice "none", nothing parsed
    parallel: bool
    constraint: Any = None           # StructuredOutputsParams forcing the call

    @classmethod
    def make(cls, tools: Sequence[Any], tool_choice: Any, tool_parser: str | None,
             parallel: bool, tokenizer: Any) -> "OfflineToolPlan":
        from iterserve.tools import TOOL_PARSERS, tool_choice_constraint
        from iterserve.tools.choice import normalize_tools

        functions = normalize_tools(tools)       # raises ToolChoiceError on a bad tool
        tool_dicts = [{"type": "function", "function": f} for f in functions]
        parser = tool_parser or DEFAULT_TOOL_PARSER
        if parser not in TOOL_PARSERS:
            raise InvalidRequestError(f"unknown tool_parser {parser!r}; choose from "
                                      f"{', '.join(sorted(TOOL_PARSERS))}", "tool_parser")
        choice = "auto" if tool_choice is None else tool_choice
        if choice == "none":
            return cls(tool_dicts, choice, None, parallel)
        constraint = tool_choice_constraint(tool_dicts, choice, parser,
                                            parallel_tool_calls=parallel, tokenizer=tokenizer)
        return cls(tool_dicts, choice, parser, parallel, constraint)

    def params(self, sampling_params: Any) -> Any:
        """Sampling params with the forcing grammar (required / named) and the special
        tokens kept when the parser's markers are special (mistral)."""
        from iterserve.tools import get_tool_parser
        if self.parser_name is None:
            return sampling_params
        keep_special = get_tool_parser(self.parser_name).needs_special_tokens
        if self.constraint is None and not keep_special:
            return sampling_params
        base = sampling_params if sampling_params is not None else SamplingParams()
        many = not isinstance(base, SamplingParams)
        out = []
        for sp in (list(base) if many else [base]):
            if self.constraint is not None and sp.structured_outputs is not None:
                raise InvalidRequestError(
                    "tool_choice required / named forces the output's format; it cannot be "
                    "combined with structured_outputs", "tool_choice")
            changes: dict[str, Any] = {}
            if self.constraint is not None:
                changes["structured_outputs"] = self.constraint
            if keep_special:
                changes["skip_special_tokens"] = False
            out.append(dataclasses.replace(sp, **changes))
        return out if many else out[0]

    def parse(self, outputs: Sequence[Any]) -> None:
        """Fill each output's tool_calls / content (parallel False: the first call only)."""
        from iterserve.tools import get_tool_parser
        if self.parser_name is None:
            return
        for ro in outputs:
            for co in ro.outputs:
                ex = get_tool_parser(self.parser_name).extract(co.text)
                calls = ex.tool_calls if self.parallel else ex.tool_calls[:1]
                co.tool_calls = calls or None
                co.content = ex.content if calls else co.text

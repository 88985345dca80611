"""What one request does with its tools: the one mechanism behind the server's chat endpoint
(server/serving_tools.py) and the offline `LLM.chat(tools=...)` (engine/chat_tools.py).

A `ToolPlan` says which parser reads the output (none for tool_choice "none"), whether
parallel calls are kept, and, for "required" / a named function, the structured-output
constraint that forces the call in that parser's format. `sampling_params` puts the
constraint (and the special tokens a parser needs) on the request; `extract` reads the calls
back. The callers keep only their policy: the server refuses "auto" without
`--enable-auto-tool-choice`, the offline API defaults to hermes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Sequence

from iterserve.errors import ToolChoiceError
from iterserve.tools.choice import tool_choice_constraint
from iterserve.tools.parsers import ToolParser, get_tool_parser
from iterserve.tools.types import ExtractedToolCalls

__all__ = ["ToolPlan", "NO_TOOLS", "plan_tool_choice"]


@dataclass
class ToolPlan:
    """One request's tools: `plan_tool_choice` makes it."""

    choice: str                     # "none" | "auto" | "required" | "named"
    parser_name: str | None         # the parser that reads the output (None: no parsing)
    parallel: bool
    constraint: Any = None          # StructuredOutputsParams forcing the call (required/named)

    @property
    def parses(self) -> bool:
        return self.parser_name is not None

    def parser(self) -> ToolParser:
        assert self.parser_name is not None
        return get_tool_parser(self.parser_name)

    def apply(self, ex: ExtractedToolCalls) -> ExtractedToolCalls:
        """The calls a client can parse: a call whose JSON the output ended inside (cut by
        max_tokens) or whose arguments are not a JSON object is left out (the finish reason
        says "length" for a cut); with parallel_tool_calls false, the first call only."""
        calls = [c for c in ex.tool_calls if c.complete and _json_object(c.arguments)]
        if not self.parallel:
            calls = calls[:1]
        if len(calls) == len(ex.tool_calls):
            return ex
        return ExtractedToolCalls(ex.content, calls, ex.dropped + len(ex.tool_calls) - len(calls))

    def extract(self, text: str, cut: bool = False) -> ExtractedToolCalls | None:
        """The calls (and the remaining content) in a finished output (`cut`: max_tokens
        ended it); None: not parsed."""
        return self.apply(self.parser().extract(text, cut)) if self.parses else None

    def finish_reason(self, finish_reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" when "auto" / "required" called and the model stopped by
        itself (a named choice keeps "stop"; a call cut by max_tokens keeps "length")."""
        if called and finish_reason == "stop" and self.choice in ("auto", "required"):
            return "tool_calls"
        return finish_reason

    def sampling_params(self, params: Any) -> Any:
        """`params` (a SamplingParams) with the forcing constraint and, when the parser's
        markers are special tokens (mistral's [TOOL_CALLS]), those tokens kept in the text.
        A forced call cannot be combined with another structured output: ToolChoiceError."""
        changes: dict[str, Any] = {}
        if self.constraint is not None:
            if params.structured_outputs is not None:
                what = "required" if self.choice == "required" else "a named function"
                raise ToolChoiceError(
                    f"tool_choice {what} forces the output's format; it cannot be combined "
                    "with structured_outputs (response_format / guided_* on the server)",
                    "tool_choice")
            changes["structured_outputs"] = self.constraint
        if self.parses and self.parser().needs_special_tokens and params.skip_special_tokens:
            changes["skip_special_tokens"] = False
        return dataclasses.replace(params, **changes) if changes else params


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


NO_TOOLS = ToolPlan("none", None, True)


def plan_tool_choice(tools: Sequence[Any], choice: Any, *, parallel: bool,
                     auto_parser: str | None, forced_format: str,
                     tokenizer: Any = None) -> ToolPlan:
    """The plan for `tool_choice` `choice` ("none", "auto", "required" or OpenAI's named
    function) over `tools` (OpenAI tool dicts or models): "auto" is read by `auto_parser`;
    "required" / named are forced in, and read by, `forced_format`'s parser. Raises
    ToolChoiceError (a 400) for a bad tool or choice."""
    if choice == "none":
        return ToolPlan("none", None, parallel)
    if choice == "auto":
        return ToolPlan("auto", auto_parser, parallel)
    constraint = tool_choice_constraint(tools, choice, forced_format,
                                        parallel_tool_calls=parallel, tokenizer=tokenizer)
    return ToolPlan("required" if choice == "required" else "named", forced_format, parallel,
                    constraint)

"""Tool calling for the offline `LLM.chat(messages, tools=...)`: the same pieces the server
uses (iterserve.tools: the template's tool dicts, the forcing grammar of tool_choice
"required" / named, the hermes / llama3_json / mistral parsers), without HTTP.

vLLM's offline chat hands the template `tools` and leaves the output as text; here each
output of a request with tools is parsed too, so the caller gets
`CompletionOutput.tool_calls` and `.content` as the server's `message` would have them.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from iterserve.core.request import SamplingParams
from iterserve.errors import InvalidRequestError
from iterserve.tools import TOOL_PARSERS
from iterserve.tools.choice import normalize_tools
from iterserve.tools.plan import ToolPlan, plan_tool_choice

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


def plan_offline_tools(tools: Sequence[Any], tool_choice: Any, tool_parser: str | None,
                       parallel: bool, tokenizer: Any) -> tuple[list[dict[str, Any]], ToolPlan]:
    """(the tool dicts the template gets, the request's ToolPlan): the server's mechanism
    (iterserve.tools.plan) with the offline policy: `tool_parser` (default hermes) reads
    "auto" too, no server flag needed."""
    functions = normalize_tools(tools)       # raises ToolChoiceError on a bad tool
    tool_dicts = [{"type": "function", "function": f} for f in functions]
    parser = tool_parser or DEFAULT_TOOL_PARSER
    if parser not in TOOL_PARSERS:
        raise InvalidRequestError(f"unknown tool_parser {parser!r}; choose from "
                                  f"{', '.join(sorted(TOOL_PARSERS))}", "tool_parser")
    plan = plan_tool_choice(tool_dicts, "auto" if tool_choice is None else tool_choice,
                            parallel=parallel, auto_parser=parser, forced_format=parser,
                            tokenizer=tokenizer)
    return tool_dicts, plan


def tool_params(plan: ToolPlan, sampling_params: Any) -> Any:
    """`LLM.chat`'s sampling params (None, one, or one per conversation) under `plan`."""
    base = sampling_params if sampling_params is not None else SamplingParams()
    if isinstance(base, SamplingParams):
        return plan.sampling_params(base)
    return [plan.sampling_params(sp) for sp in base]


def parse_tool_calls(plan: ToolPlan, outputs: Sequence[Any]) -> None:
    """Fill each output's tool_calls / content, as the server's `message` has them."""
    if not plan.parses:
        return
    for ro in outputs:
        for co in ro.outputs:
            ex = plan.extract(co.text, co.finish_reason == "length")
            co.tool_calls = ex.tool_calls or None
            co.content = ex.content if (ex.tool_calls or ex.dropped) else co.text

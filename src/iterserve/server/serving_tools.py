"""Tool calling on the chat endpoint: what a request's `tools` / `tool_choice` make the
server do, and how the model's text becomes `tool_calls`.

The parsers and the forcing grammar live in `iterserve.tools` (torch-free, unit-tested);
this module is the server's policy around them, as vLLM's serving_chat has it:

- `tool_choice` "none": the tools are still shown to the template (vLLM's default), the
  output is plain content.
- "auto": needs a server started with `--enable-auto-tool-choice --tool-call-parser NAME`
  (else a 400 saying so, as vLLM answers); the named parser reads the output: calls become
  `tool_calls`, the rest stays content.
- "required" / a named function: the call is forced by a grammar on the structured-output
  path (`tool_choice_constraint`), in the format of the server's parser (hermes when none is
  set), so even a random-weight model writes a valid call whose arguments match the
  function's `parameters` schema; the same parser reads it back.
- `parallel_tool_calls` false: "required" forces exactly one call, "auto" keeps the first.

`finish_reason` is "tool_calls" when "auto" or "required" produced calls and the model
stopped by itself (a call cut by max_tokens keeps "length"); a named choice keeps "stop", as
OpenAI answers. Streaming sends OpenAI's deltas: the call's index, id, type and name once
the name is complete, then fragments of the arguments' JSON text (`ToolCallStream`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from iterserve.core.request import SamplingParams
from iterserve.engine.errors import InvalidRequestError
from iterserve.tools import ToolCallStream, ToolParser, get_tool_parser, tool_choice_constraint
from iterserve.tools.types import DeltaMessage, ExtractedToolCalls

DEFAULT_FORCED_FORMAT = "hermes"


@dataclass(frozen=True)
class ToolServerConfig:
    """The server's tool flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)          # ValueError for unknown names
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME "
                             "(hermes, llama3_json or mistral)")


@dataclass
class ToolPlan:
    """What one chat request does with tools (`plan_tools`)."""

    choice: str                     # "none" | "auto" | "required" | "named"
    parser_name: str | None         # the parser that reads the output (None: no parsing)
    parallel: bool

    @property
    def parses(self) -> bool:
        return self.parser_name is not None

    def parser(self) -> ToolParser:
        assert self.parser_name is not None
        return get_tool_parser(self.parser_name)

    def apply(self, ex: ExtractedToolCalls) -> ExtractedToolCalls:
        if not self.parallel and len(ex.tool_calls) > 1:
            return ExtractedToolCalls(ex.content, ex.tool_calls[:1])
        return ex

    def finish_reason(self, finish_reason: str | None, called: bool) -> str | None:
        if called and finish_reason == "stop" and self.choice in ("auto", "required"):
            return "tool_calls"
        return finish_reason


NO_TOOLS = ToolPlan("none", None, True)


def plan_tools(body: Any, config: ToolServerConfig, tokenizer: Any,
               params: SamplingParams) -> tuple[ToolPlan, SamplingParams]:
    """The request's ToolPlan and its sampling params (with the forcing grammar for
    "required" / named). Raises errors the server answers 400, naming the field."""
    if not body.tools:
        return NO_TOOLS, params
    choice = body.effective_tool_choice
    parallel = body.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none", None, parallel), params
    if choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise InvalidRequestError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set on the server (tool_choice \"auto\" is the default when tools are "
                'given; send "required", a named function or "none" instead)', "tool_choice")
        plan = ToolPlan("auto", config.tool_call_parser, parallel)
        return plan, _special_tokens(plan, params)
    fmt = config.tool_call_parser or DEFAULT_FORCED_FORMAT
    if params.structured_outputs is not None:
        raise InvalidRequestError(
            f"tool_choice {'required' if choice == 'required' else 'a named function'} forces "
            "the output's format; it cannot be combined with response_format / "
            "structured_outputs / guided_*", "tool_choice")
    constraint = tool_choice_constraint(
        [t.model_dump(exclude_none=True) for t in body.tools],
        choice if choice == "required" else choice.model_dump(), fmt,
        parallel_tool_calls=parallel, tokenizer=tokenizer)
    plan = ToolPlan("required" if choice == "required" else "named", fmt, parallel)
    params = dataclasses.replace(params, structured_outputs=constraint)
    return plan, _special_tokens(plan, params)


def _special_tokens(plan: ToolPlan, params: SamplingParams) -> SamplingParams:
    """A parser whose markers are special tokens (mistral's [TOOL_CALLS]) must see them."""
    if plan.parses and plan.parser().needs_special_tokens and params.skip_special_tokens:
        return dataclasses.replace(params, skip_special_tokens=False)
    return params


def message_with_tools(plan: ToolPlan, text: str) -> tuple[dict[str, Any], bool]:
    """The non-streamed `message` for `text` under `plan`, and whether tools were called."""
    if not plan.parses:
        return {"role": "assistant", "content": text}, False
    ex = plan.apply(plan.parser().extract(text))
    if not ex.tool_calls:
        return {"role": "assistant", "content": text}, False
    return {"role": "assistant", "content": ex.content,
            "tool_calls": [c.to_openai() for c in ex.tool_calls]}, True


class StreamedToolCalls:
    """Per choice: text deltas in, one OpenAI `delta` dict out per chunk."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.stream: ToolCallStream = plan.parser().stream()

    @property
    def called(self) -> bool:
        return self.stream.tools_called

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        msgs = self.stream.feed(text) if text else []
        if final:
            msgs += self.stream.finish()
        return _merge(msgs, self.plan.parallel)


def _merge(msgs: list[DeltaMessage], parallel: bool) -> dict[str, Any]:
    content = "".join(m.content for m in msgs if m.content)
    calls = [c for m in msgs for c in m.tool_calls if parallel or c.index == 0]
    d: dict[str, Any] = {}
    if content:
        d["content"] = content
    if calls:
        d["tool_calls"] = [c.to_openai() for c in calls]
    return d

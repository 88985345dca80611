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

- the forcing grammar closes the call list (at most `MAX_PARALLEL_CALLS` calls) and the
  arguments object (no keys the schema does not declare unless it allows them; OpenAI's
  strict mode with `strict: true`): iterserve.tools.choice / iterserve.tools.schema.

A reply holds only calls a client can parse: a call max_tokens cut in half is left out, the
completed ones are returned, with finish_reason "length". `finish_reason` is "tool_calls"
when "auto" or "required" produced calls and the model stopped by itself; a named choice
keeps "stop", as OpenAI answers. Streaming sends OpenAI's deltas: the call's index, id, type
and name once the name is complete, then fragments of the arguments' JSON text
(`ToolCallStream`); while the parser cannot yet tell what the text is (the `<tool_call>` tag
being written) no chunk is sent. A streamed call's fragments are sent as they are written,
so a call cut by max_tokens ends a stream unfinished, with finish_reason "length".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from iterserve.core.request import SamplingParams
from iterserve.errors import InvalidRequestError
from iterserve.tools import ToolCallStream, get_tool_parser
from iterserve.tools.plan import NO_TOOLS, ToolPlan, plan_tool_choice
from iterserve.tools.types import DeltaMessage

__all__ = ["ToolServerConfig", "ToolPlan", "NO_TOOLS", "plan_tools", "message_with_tools",
           "StreamedToolCalls"]

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


def plan_tools(body: Any, config: ToolServerConfig, tokenizer: Any,
               params: SamplingParams) -> tuple[ToolPlan, SamplingParams]:
    """The request's ToolPlan (iterserve.tools.plan, shared with the offline API) and its
    sampling params (with the forcing grammar for "required" / named). Raises errors the
    server answers 400, naming the field."""
    if not body.tools:
        return NO_TOOLS, params
    choice = body.effective_tool_choice
    if choice == "auto" and not (config.enable_auto_tool_choice and config.tool_call_parser):
        raise InvalidRequestError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            "to be set on the server (tool_choice \"auto\" is the default when tools are "
            'given; send "required", a named function or "none" instead)', "tool_choice")
    plan = plan_tool_choice(
        body.tool_dicts(), choice if isinstance(choice, str) else choice.model_dump(),
        parallel=body.parallel_tool_calls is not False, auto_parser=config.tool_call_parser,
        forced_format=config.tool_call_parser or DEFAULT_FORCED_FORMAT, tokenizer=tokenizer)
    return plan, plan.sampling_params(params)


def message_with_tools(plan: ToolPlan, text: str, cut: bool = False
                       ) -> tuple[dict[str, Any], bool]:
    """The non-streamed `message` for `text` under `plan` (`cut`: finish_reason "length"),
    and whether tools were called. Only calls a client can parse are returned
    (ToolPlan.apply): a call max_tokens cut is left out, and so is its text (the content is
    what surrounds the calls)."""
    ex = plan.extract(text, cut)
    if ex is None or not (ex.tool_calls or ex.dropped):
        return {"role": "assistant", "content": text}, False
    message: dict[str, Any] = {"role": "assistant", "content": ex.content}
    if ex.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in ex.tool_calls]
    return message, bool(ex.tool_calls)


class StreamedToolCalls:
    """Per choice: text deltas in, one OpenAI `delta` dict out per chunk."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.stream: ToolCallStream = plan.parser().stream()

    @property
    def called(self) -> bool:
        return self.stream.tools_called

    def delta(self, text: str, final: bool, cut: bool = False) -> dict[str, Any]:
        """`final`: the output ends here; `cut`: max_tokens ended it (what is undecided then
        is not sent as content)."""
        msgs = self.stream.feed(text) if text else []
        if final:
            msgs += self.stream.finish(cut)
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

"""Tool-call values in OpenAI's shapes: complete calls (non-streaming) and stream deltas."""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import Any

_ALPHABET = string.ascii_letters + string.digits


def make_tool_call_id() -> str:
    """An id in OpenAI's form: `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


@dataclass(slots=True)
class ToolCall:
    """One function call the model made; `arguments` is the JSON text of its arguments.
    `complete` is false for a call whose JSON the output ended inside (cut by max_tokens):
    its arguments are not valid JSON, so the server does not return it (ToolPlan.apply)."""

    id: str
    name: str
    arguments: str
    complete: bool = True

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ExtractedToolCalls:
    """A finished output split into the text that is not a call and the calls.
    `dropped` counts the calls left out (incomplete, or past parallel_tool_calls false): the
    output held calls even when `tool_calls` is empty, so its text is not plain content."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    dropped: int = 0

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass(slots=True)
class DeltaToolCall:
    """One piece of a streamed call: the first piece of call `index` has `id` and `name`,
    later ones carry argument fragments (concatenated, they are the arguments' JSON)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            d["id"] = self.id
            d["type"] = "function"
        fn: dict[str, Any] = {}
        if self.name is not None:
            fn["name"] = self.name
        if self.arguments is not None:
            fn["arguments"] = self.arguments
        d["function"] = fn
        return d


@dataclass(slots=True)
class DeltaMessage:
    """What one stream chunk's `choices[i].delta` holds: content text or call pieces."""

    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.content is not None:
            d["content"] = self.content
        if self.tool_calls:
            d["tool_calls"] = [t.to_openai() for t in self.tool_calls]
        return d

"""Tool-call parsers, by vLLM's `--tool-call-parser` names: hermes, llama3_json, mistral.

Each parser is one `_scan(text, final)` that splits a model's output into content pieces and
calls; both modes run it, so a stream reassembles to exactly the non-streaming result:

- `extract(text)` scans the finished text once.
- `stream()` returns a `ToolCallStream`; `feed(delta)` rescans the text so far and sends
  what became certain since the last feed: content, a call's id and name (once the name is
  complete), then its argument characters as they arrive (the raw JSON of the arguments
  value, so the fragments concatenate to the final `arguments`). Text that might still turn
  into a call (a partial `<tool_call>` tag, a `{` whose first key has not arrived) is held
  back until it is decided; `finish()` flushes it.

Content rules (both modes): text that is not a call is content. Whitespace between content
and a call is dropped (the model writes "Let me check.\n<tool_call>..."); an output with
calls and only whitespace besides has content None; an output without calls is returned as
it is. A call is recognised once its JSON object has a complete "name"; a tag or object that
turns out not to be a call stays in the content. A call cut off mid-arguments (max_tokens)
is still reported, with the arguments as far as they got and `complete` false, so a stream
and `extract` agree; the server's policy (tools/plan.py) leaves such a call out of a reply.

The formats:
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/3, Hermes,
  SmolLM-style templates), any number, content around them.
- llama3_json: the output is one or more `{"name": ..., "parameters": {...}}` objects
  separated by `;`, optionally after `<|python_tag|>`; an output that starts otherwise is
  content (as in vLLM).
- mistral: content, then `[TOOL_CALLS]` and a JSON array of calls (or `[TOOL_CALLS]` per
  call with the newer `name[ARGS]{...}` form). `[TOOL_CALLS]` is a special token, so the
  request must be detokenised with skip_special_tokens=False (`needs_special_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from iterserve.tools.jsonscan import INVALID, ObjectScan, scan_object, scan_value, skip_ws
from iterserve.tools.types import (
    DeltaMessage, DeltaToolCall, ExtractedToolCalls, ToolCall, make_tool_call_id)


@dataclass
class _Call:
    name: str
    arguments: str            # raw JSON text so far
    complete: bool


@dataclass
class _Content:
    text: str


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _call_from_object(text: str, obj: ObjectScan, args_keys=("arguments", "parameters")
                      ) -> _Call | None:
    """A call once the object's "name" is a complete string; None before that."""
    name = obj.complete_value(text, "name")
    if not isinstance(name, str):
        return None
    key = next((k for k in args_keys if k in obj.values), None)
    complete = obj.status == "complete"
    if key is None:
        args = "{}" if complete else ""
    else:
        raw = obj.value_text(text, key) or ""
        if raw.startswith('"'):          # arguments given as a JSON string of JSON
            val = obj.complete_value(text, key)
            args = val if isinstance(val, str) else ""
        else:
            args = raw
    return _Call(name, args, complete)


class ToolParser:
    """Base class: subclasses implement `_scan`. `id_factory` makes call ids."""

    name = "base"
    needs_special_tokens = False

    def __init__(self, id_factory: Callable[[], str] = make_tool_call_id) -> None:
        self.id_factory = id_factory

    def _scan(self, text: str, final: bool) -> list[_Content | _Call]:
        raise NotImplementedError

    def items(self, text: str, final: bool) -> tuple[list[str], list[_Call]]:
        """(content pieces with the whitespace rules applied, calls)."""
        raw = self._scan(text, final)
        merged: list[_Content | _Call] = []
        for it in raw:
            if isinstance(it, _Content) and merged and isinstance(merged[-1], _Content):
                merged[-1] = _Content(merged[-1].text + it.text)
            else:
                merged.append(it)
        calls = [it for it in merged if isinstance(it, _Call)]
        if not calls:
            body = "".join(it.text for it in merged)
            if not final:
                body = body.rstrip()     # it may yet be followed by a call
            return [body] if body else [], []
        pieces = []
        for i, it in enumerate(merged):
            if not isinstance(it, _Content):
                continue
            t = it.text
            if i > 0:
                t = t.lstrip()
            if i + 1 < len(merged) or not final:
                t = t.rstrip()
            if t:
                pieces.append(t)
        return pieces, calls

    def reply(self, text: str, final: bool, cut: bool = False) -> tuple[str, list[_Call]]:
        """(the content, the calls) of `text` so far, or at its end with `final`. A `cut`
        output (max_tokens ended it) keeps out what was still undecided when it stopped (a
        `<tool_call>` tag, a call whose name never arrived): it was not text the model meant
        to show, and not a call either."""
        if cut:
            pieces, calls = self.items(text, final=False)
            content = "".join(pieces)
            if not calls and content == text.rstrip():
                content = text                # nothing was held back
            return content, calls
        pieces, calls = self.items(text, final)
        return ("".join(pieces) if (calls or not final) else text), calls

    def extract(self, text: str, cut: bool = False) -> ExtractedToolCalls:
        content, calls = self.reply(text, True, cut)
        left_out = int(not calls and content != text)     # a cut output's undecided tail
        return ExtractedToolCalls(content or None, [
            ToolCall(self.id_factory(), c.name, c.arguments, c.complete) for c in calls],
            left_out)

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)


class ToolCallStream:
    """Feed text deltas, get OpenAI-style deltas (see the module docstring)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._content = ""
        self._ids: list[str] = []
        self._names_sent = 0
        self._args_sent: list[int] = []
        self.tool_calls: list[ToolCall] = []     # as far as streamed (complete at finish)

    def feed(self, delta: str) -> list[DeltaMessage]:
        self.text += delta
        return self._emit(final=False)

    def finish(self, cut: bool = False) -> list[DeltaMessage]:
        """The end of the output (`cut`: max_tokens ended it; see ToolParser.reply)."""
        return self._emit(final=True, cut=cut)

    @property
    def tools_called(self) -> bool:
        return bool(self._ids)

    @property
    def content(self) -> str | None:
        return self._content or None

    def _emit(self, final: bool, cut: bool = False) -> list[DeltaMessage]:
        content, calls = self.parser.reply(self.text, final, cut)
        out: list[DeltaMessage] = []
        # Content only grows (the scanner holds back anything undecided); the check keeps a
        # stream consistent even if a parser ever revised itself.
        if len(content) > len(self._content) and content.startswith(self._content):
            out.append(DeltaMessage(content=content[len(self._content):]))
            self._content = content
        for i, call in enumerate(calls):
            deltas: list[DeltaToolCall] = []
            if i >= len(self._ids):
                self._ids.append(self.parser.id_factory())
                self._args_sent.append(0)
                self.tool_calls.append(ToolCall(self._ids[i], call.name, ""))
                deltas.append(DeltaToolCall(i, id=self._ids[i], name=call.name, arguments=""))
            sent = self._args_sent[i]
            if len(call.arguments) > sent:
                frag = call.arguments[sent:]
                self._args_sent[i] = len(call.arguments)
                self.tool_calls[i].arguments = call.arguments
                if deltas:
                    deltas[0].arguments = frag
                else:
                    deltas.append(DeltaToolCall(i, arguments=frag))
            self.tool_calls[i].complete = call.complete
            if deltas:
                out.append(DeltaMessage(tool_calls=deltas))
        return out


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def _scan(self, text: str, final: bool) -> list[_Content | _Call]:
        items: list[_Content | _Call] = []
        pos = 0
        while True:
            k = text.find(self.START, pos)
            if k < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[:len(tail) - _held_prefix(tail, self.START)]
                items.append(_Content(tail))
                return items
            items.append(_Content(text[pos:k]))
            j = skip_ws(text, k + len(self.START))
            if j >= len(text):
                if final:
                    items.append(_Content(text[k:]))
                return items
            obj = scan_object(text, j)
            call = _call_from_object(text, obj) if obj.status != "invalid" or \
                obj.complete_value(text, "name") else None
            if call is None:
                if obj.status == "partial" and not final:
                    return items              # undecided: hold from the tag on
                items.append(_Content(self.START))   # not a call: the tag is just text
                pos = k + len(self.START)
                continue
            items.append(call)
            if obj.status != "complete":
                return items
            e = text.find(self.END, obj.end)
            if e < 0:
                return items                  # waiting for the closing tag (or cut off)
            pos = e + len(self.END)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    BOT = "<|python_tag|>"

    def _scan(self, text: str, final: bool) -> list[_Content | _Call]:
        items: list[_Content | _Call] = []
        pos = skip_ws(text, 0)
        lead = text[:pos]
        if text.startswith(self.BOT, pos):
            pos = skip_ws(text, pos + len(self.BOT))
        elif not final and self.BOT.startswith(text[pos:]) and pos < len(text):
            return []                          # maybe the tag
        if pos >= len(text):
            return [] if not final else [_Content(text)]
        if text[pos] != "{":
            return [_Content(text)]
        items.append(_Content(lead))
        first = True
        while True:
            if not first:
                j = skip_ws(text, pos)
                if j < len(text) and text[j] == ";":
                    j = skip_ws(text, j + 1)
                if j >= len(text):
                    if final:
                        items.append(_Content(text[pos:]))
                    return items
                if text[j] != "{":
                    items.append(_Content(text[pos:]))
                    return items
                pos = j
            first = False
            obj = scan_object(text, pos)
            call = _call_from_object(text, obj, ("parameters", "arguments")) \
                if obj.status != "invalid" else None
            if call is None:
                if obj.status == "partial" and not final:
                    return items
                items.append(_Content(text[pos:]))
                return items
            items.append(call)
            if obj.status != "complete":
                return items
            pos = obj.end


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True
    TOKEN, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def _scan(self, text: str, final: bool) -> list[_Content | _Call]:
        items: list[_Content | _Call] = []
        k = text.find(self.TOKEN)
        if k < 0:
            tail = text if final else text[:len(text) - _held_prefix(text, self.TOKEN)]
            return [_Content(tail)]
        items.append(_Content(text[:k]))
        pos = skip_ws(text, k + len(self.TOKEN))
        if pos >= len(text):
            return items
        if text[pos] == "[":
            return self._array(text, pos, final, items)
        return self._named(text, pos, final, items)

    def _array(self, text, pos, final, items):
        pos = skip_ws(text, pos + 1)
        while True:
            if pos >= len(text):
                return items
            if text[pos] == "]":
                items.append(_Content(text[pos + 1:]))
                return items
            obj = scan_object(text, pos)
            call = _call_from_object(text, obj) if obj.status != "invalid" else None
            if call is None:
                if obj.status == "partial" and not final:
                    return items
                items.append(_Content(text[pos:]))
                return items
            items.append(call)
            if obj.status != "complete":
                return items
            pos = skip_ws(text, obj.end)
            if pos < len(text) and text[pos] == ",":
                pos = skip_ws(text, pos + 1)

    def _named(self, text, pos, final, items):
        """`[TOOL_CALLS]name[ARGS]{...}` repeated (Mistral's v11+ tokenizers)."""
        while True:
            a = text.find(self.ARGS, pos)
            if a < 0:
                if final:
                    items.append(_Content(text[pos:]))
                return items
            name = text[pos:a].strip()
            if not name or any(c in name for c in "{}[]\" \n"):
                items.append(_Content(text[pos:]))
                return items
            j = skip_ws(text, a + len(self.ARGS))
            end = scan_value(text, j) if j < len(text) else None
            if end == INVALID:
                items.append(_Content(text[pos:]))
                return items
            items.append(_Call(name, text[j:end if end is not None else len(text)],
                               end is not None))
            if end is None:
                return items
            nxt = skip_ws(text, end)
            if text.startswith(self.TOKEN, nxt):
                pos = skip_ws(text, nxt + len(self.TOKEN))
                continue
            if not final and self.TOKEN.startswith(text[nxt:]):
                return items                  # maybe the next call's token
            items.append(_Content(text[end:]))
            return items


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str, **kwargs) -> ToolParser:
    """The parser vLLM's `--tool-call-parser NAME` selects; ValueError for unknown names."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; "
                         f"available: {', '.join(sorted(TOOL_PARSERS))}")
    return cls(**kwargs)

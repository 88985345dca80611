"""A tolerant scanner for the JSON object of a tool call, complete or still arriving.

Parsers need more than `json.loads`: while a call streams in they must know whether the
text so far can still become a call, whether the function name is complete, and which raw
characters belong to the arguments value (those are what the stream sends, so the streamed
fragments concatenate to exactly the non-streaming `arguments`). The scanner walks the
top-level keys of one object and records where each value starts and (once known) ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = " \t\r\n"
_LITERALS = ("true", "false", "null")
_NUMBER_CHARS = set("0123456789+-.eE")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def scan_string(text: str, i: int) -> int | None:
    """text[i] == '"'; the index after the closing quote, or None if not closed yet."""
    j = i + 1
    n = len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


INVALID = -1


def scan_value(text: str, i: int) -> int | None:
    """End index of the JSON value starting at text[i]; None if it is incomplete (text ran
    out), INVALID if it cannot be JSON. Structure only: `json.loads` checks the finished
    span."""
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        return scan_string(text, i)
    if c in "{[":
        stack = [c]
        j = i + 1
        while j < n:
            c = text[j]
            if c == '"':
                end = scan_string(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                stack.append(c)
            elif c in "}]":
                if (stack[-1] == "{") != (c == "}"):
                    return INVALID
                stack.pop()
                if not stack:
                    return j + 1
            j += 1
        return None
    for lit in _LITERALS:
        if text.startswith(lit, i):
            return i + len(lit)
        if lit.startswith(text[i:]):
            return None
    if c in "-0123456789":
        j = i
        while j < n and text[j] in _NUMBER_CHARS:
            j += 1
        return j if j < n else None      # a number at the end of text may go on
    return INVALID


@dataclass
class ObjectScan:
    """What is known of one `{...}` starting at `start`."""

    start: int
    status: str = "partial"            # "partial" | "complete" | "invalid"
    end: int | None = None             # after the closing brace, when complete
    values: dict[str, tuple[int, int | None]] = field(default_factory=dict)   # key -> span

    def value_text(self, text: str, key: str) -> str | None:
        span = self.values.get(key)
        if span is None:
            return None
        s, e = span
        return text[s:e if e is not None else len(text)]

    def complete_value(self, text: str, key: str):
        """The decoded value of `key` once its span is complete (else None, KeyError-free)."""
        span = self.values.get(key)
        if span is None or span[1] is None:
            return None
        try:
            return json.loads(text[span[0]:span[1]])
        except ValueError:
            return None


def scan_object(text: str, start: int) -> ObjectScan:
    """Scan the object at text[start] == '{' as far as the text goes."""
    out = ObjectScan(start)
    n = len(text)
    if start >= n or text[start] != "{":
        out.status = "invalid"
        return out
    i = skip_ws(text, start + 1)
    if i < n and text[i] == "}":
        out.status, out.end = "complete", i + 1
        return out
    while True:
        if i >= n:
            return out
        if text[i] != '"':
            out.status = "invalid"
            return out
        kend = scan_string(text, i)
        if kend is None:
            return out
        try:
            key = json.loads(text[i:kend])
        except ValueError:
            out.status = "invalid"
            return out
        i = skip_ws(text, kend)
        if i >= n:
            return out
        if text[i] != ":":
            out.status = "invalid"
            return out
        i = skip_ws(text, i + 1)
        if i >= n:
            return out
        vend = scan_value(text, i)
        if vend == INVALID:
            out.status = "invalid"
            return out
        out.values[key] = (i, vend)
        if vend is None:
            return out
        i = skip_ws(text, vend)
        if i >= n:
            return out
        if text[i] == "}":
            out.end = i + 1
            try:
                json.loads(text[start:out.end])
            except ValueError:
                out.status = "invalid"
                return out
            out.status = "complete"
            return out
        if text[i] != ",":
            out.status = "invalid"
            return out
        i = skip_ws(text, i + 1)

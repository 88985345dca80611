"""gpt-oss's harmony format: its messages, and the `openai` tool-call parser (vLLM's name).

gpt-oss writes its reply as messages (OpenAI's harmony format; each marker is one special
token, so the request keeps special tokens in the text):

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

(the prompt ends with `<|start|>assistant`, so the first message begins at its channel; the
recipient `to=...` may also stand before the channel). `parse_messages` reads them: channel,
recipient, constrain type, body, and the message's own markup. While streaming, a message
whose header is not complete is held back, as is a body's tail that could begin a marker; a
finished output that is not harmony at all is one message without a channel (plain content).

The `openai` parser: a `commentary` message to `functions.NAME` is a call (its body the
arguments' JSON, complete at `<|call|>` or at the end of a finished output); `final` and
other `commentary` text is content; `analysis` is the reasoning (`--reasoning-parser
openai_gptoss` returns it as `reasoning_content`), never content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from iterserve.tools.parsers import TOOL_PARSERS, ToolParser, _Call, _Content

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
TERMINATORS = (END, RETURN, CALL)
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclass
class Message:
    channel: str | None
    recipient: str | None           # "functions.get_weather" for a call
    constrain: str | None
    body: str
    terminator: str | None          # <|end|>, <|return|>, <|call|>, or None (not yet / cut)
    markup: str                     # the message as written (header, body, terminator)


def _held(text: str) -> int:
    return max(_held_prefix(text, m) for m in MARKERS)


def _held_prefix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _header(h: str) -> tuple[str | None, str | None, str | None]:
    channel = None
    if CHANNEL in h:
        rest = h.split(CHANNEL, 1)[1]
        channel = re.split(r"[\s<]", rest, maxsplit=1)[0] or None
    m = _RECIPIENT.search(h)
    constrain = None
    if CONSTRAIN in h:
        constrain = h.split(CONSTRAIN, 1)[1].strip() or None
    return channel, (m.group(1) if m else None), constrain


def parse_messages(text: str, final: bool) -> list[Message]:
    out: list[Message] = []
    pos = 0
    if not any(m in text for m in (CHANNEL, MESSAGE, START)):
        # not harmony (yet): plain text, holding back what could begin a marker
        body = text if final else text[:len(text) - _held(text)]
        if final or not text.lstrip().startswith("<"):
            return [Message(None, None, None, body, None, body)] if body else []
        return []
    while pos < len(text):
        m = text.find(MESSAGE, pos)
        if m < 0:
            if final and text[pos:].strip():
                tail = text[pos:]
                out.append(Message(None, None, None, tail, None, tail))
            return out                        # a header still arriving
        channel, recipient, constrain = _header(text[pos:m])
        b = m + len(MESSAGE)
        ends = [(text.find(t, b), t) for t in TERMINATORS]
        ends = [(i, t) for i, t in ends if i >= 0]
        nxt = text.find(START, b)
        if ends:
            i, t = min(ends)
            if 0 <= nxt < i:
                i, t = nxt, None
            out.append(Message(channel, recipient, constrain, text[b:i], t,
                               text[pos:i + (len(t) if t else 0)]))
            pos = i + (len(t) if t else 0)
            continue
        if nxt >= 0:
            out.append(Message(channel, recipient, constrain, text[b:nxt], None, text[pos:nxt]))
            pos = nxt
            continue
        body = text[b:] if final else text[b:len(text) - _held(text[b:])]
        out.append(Message(channel, recipient, constrain, body, None, text[pos:b] + body))
        return out
    return out


class OpenAIToolParser(ToolParser):
    """vLLM's `openai` parser: gpt-oss's harmony calls (see the module docstring)."""

    name = "openai"
    needs_special_tokens = True

    def _scan(self, text: str, final: bool) -> list[_Content | _Call]:
        items: list[_Content | _Call] = []
        for m in parse_messages(text, final):
            if m.channel == "analysis":
                continue
            if m.recipient and m.recipient.startswith("functions."):
                args = m.body.strip()
                complete = m.terminator == CALL or (final and _is_json(args))
                items.append(_Call(m.recipient[len("functions."):], args, complete))
            elif m.body:
                items.append(_Content(m.body))
        return items


def _is_json(s: str) -> bool:
    try:
        json.loads(s)
    except ValueError:
        return False
    return True


def forced_call_constraint(functions: list[dict], tool_choice, tokenizer):
    """tool_choice "required" / a named function in harmony's form: one commentary message
    to `functions.NAME` with `<|constrain|>json` and arguments matching the function's
    `parameters`, ended by `<|call|>` (harmony writes one call per message)."""
    from iterserve.structured.params import StructuredOutputsParams
    from iterserve.tools.choice import ToolChoiceError
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ToolChoiceError(f"tool_choice names function {name!r}, which is not in tools",
                                  "tool_choice")
    ids = {}
    for t in (CHANNEL, CONSTRAIN, MESSAGE, CALL):
        tid = tokenizer.token_to_id(t) if tokenizer is not None else None
        if tid is None:
            raise ToolChoiceError(f"the model's tokenizer has no {t} token: the openai "
                                  "(harmony) tool format needs gpt-oss's tokenizer", "tool_choice")
        ids[t] = f"<[{tid}]>"
    rules = []
    for i, f in enumerate(functions):
        schema = {**f["parameters"], "x-guidance": {"whitespace_flexible": False,
                                                    "item_separator": ", ",
                                                    "key_separator": ": "}}
        rules.append(f'call{i}: {ids[CHANNEL]} {json.dumps("commentary to=functions." + f["name"] + " ")} '
                     f'{ids[CONSTRAIN]} "json" {ids[MESSAGE]} args{i} {ids[CALL]}\n'
                     f'args{i}: %json {json.dumps(schema, ensure_ascii=False)}\n')
    start = "start: " + " | ".join(f"call{i}" for i in range(len(functions))) + "\n"
    return StructuredOutputsParams(grammar=start + "".join(rules), source="tool_choice")


TOOL_PARSERS.setdefault(OpenAIToolParser.name, OpenAIToolParser)

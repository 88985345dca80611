"""Reasoning parsers, by vLLM's `--reasoning-parser` names: deepseek_r1, qwen3, openai_gptoss.

A reasoning model writes its thinking before its answer; the API returns the thinking as
`message.reasoning_content` (streamed as `delta.reasoning_content`) and the answer as
`content`. Each parser is one `split(text, final)` that both modes run, so a stream
reassembles to exactly the non-streaming result: `extract(text)` splits a finished output;
`stream()` gives a `ReasoningStream` whose `feed(delta)` sends what became certain since the
last feed (a partial `</think>` or an undecided channel header is held back until decided).

- deepseek_r1: the template ends the prompt with `<think>\\n`, so the output starts in the
  thinking; it ends at `</think>` (a leading `<think>` the model repeats is dropped). An
  output that never closes it is all reasoning (cut off by max_tokens while thinking).
- qwen3: thinking is an output that starts with `<think>`, up to `</think>`; an output that
  does not start with it is all content (Qwen3 with `chat_template_kwargs:
  {"enable_thinking": false}`: the template writes an empty think block into the prompt).
- openai_gptoss: gpt-oss's harmony format, messages `<|channel|>NAME<|message|>BODY<|end|>`
  (each after the first opened by `<|start|>assistant`): the `analysis` channel is the
  reasoning, the `final` channel (and `commentary` text that is not a function call) the
  content. Its markers are special tokens, so the request keeps them in the text
  (`needs_special_tokens`); function calls in the `commentary` channel are the `openai`
  tool parser's (iterserve/tools/harmony.py), which reads `answer_text`.

Whitespace: the newline after `<think>` and the blank line after `</think>` are the
template's, not the model's words: reasoning loses its leading and trailing newlines and
content its leading ones (held back while streaming until something else follows).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Split:
    reasoning: str          # the thinking so far (certain)
    content: str            # the answer so far (certain)
    answer_text: str        # what a tool parser reads: content, or harmony's markup of it
    ended: bool             # the thinking is over (the answer may follow)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    name = "base"
    needs_special_tokens = False

    def split(self, text: str, final: bool) -> Split:
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a finished output; None where empty."""
        s = self.split(text, final=True)
        return s.reasoning or None, s.content or None

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)

    def thinking_closed_by(self, prompt: str | None) -> bool:
        """Whether the prompt already ended the thinking (Qwen3's template with
        enable_thinking false writes an empty think block): the output is then all answer."""
        return False


class NoThinking(ReasoningParser):
    """A parser's view of an output whose prompt closed the thinking: all content."""

    def __init__(self, of: ReasoningParser) -> None:
        self.name, self.needs_special_tokens = of.name, of.needs_special_tokens

    def split(self, text: str, final: bool) -> Split:
        return Split("", text, text, True)


class ThinkTagParser(ReasoningParser):
    """`<think>` ... `</think>` then the answer (see the module docstring)."""

    START, END = "<think>", "</think>"
    starts_in_reasoning = True

    def thinking_closed_by(self, prompt: str | None) -> bool:
        return prompt is not None and prompt.rstrip().endswith(self.END)

    def split(self, text: str, final: bool) -> Split:
        lead = len(text) - len(text.lstrip())
        body = text[lead:]
        if body.startswith(self.START):
            body = body[len(self.START):]
        elif not final and body and self.START.startswith(body):
            return Split("", "", "", False)              # maybe the opening tag
        elif not self.starts_in_reasoning:
            return Split("", text, text, True)
        k = body.find(self.END)
        if k < 0:
            if not final:
                body = body[:len(body) - _held_prefix(body, self.END)].rstrip("\n")
            return Split(body.strip("\n"), "", "", False)
        reasoning = body[:k].strip("\n")
        content = body[k + len(self.END):].lstrip("\n")
        return Split(reasoning, content, content, True)


class DeepSeekR1ReasoningParser(ThinkTagParser):
    name = "deepseek_r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ThinkTagParser):
    name = "qwen3"
    starts_in_reasoning = False


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss's harmony messages (see the module docstring)."""

    name = "openai_gptoss"
    needs_special_tokens = True

    def split(self, text: str, final: bool) -> Split:
        from iterserve.tools.harmony import parse_messages
        reasoning, content, answer = [], [], []
        ended = False
        for m in parse_messages(text, final):
            if m.channel == "analysis":
                reasoning.append(m.body)
                continue
            ended = True
            answer.append(m.markup)
            if m.recipient is None and m.body:
                content.append(m.body)
        return Split("\n".join(r for r in reasoning if r), "".join(content), "".join(answer),
                     ended)


class ReasoningStream:
    """Feed text deltas, get (reasoning delta, content delta, answer-text delta) triples."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.reasoning = self.content = self.answer_text = ""

    def feed(self, delta: str) -> tuple[str, str, str]:
        self.text += delta
        return self._emit(final=False)

    def finish(self) -> tuple[str, str, str]:
        return self._emit(final=True)

    def _emit(self, final: bool) -> tuple[str, str, str]:
        s = self.parser.split(self.text, final)
        out = []
        for attr, now in (("reasoning", s.reasoning), ("content", s.content),
                          ("answer_text", s.answer_text)):
            before = getattr(self, attr)
            # certain text only grows; a longer one that does not extend it is not sent
            if len(now) > len(before) and now.startswith(before):
                out.append(now[len(before):])
                setattr(self, attr, now)
            else:
                out.append("")
        return out[0], out[1], out[2]


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, GptOssReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser vLLM's `--reasoning-parser NAME` selects; ValueError for unknown names."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown reasoning parser {name!r}; "
                         f"available: {', '.join(sorted(REASONING_PARSERS))}")
    return cls()

"""Turn a request's output tokens into streamed text, one token at a time, and catch stops.

Decoding token by token and concatenating is wrong in two ways: a multi-byte UTF-8
character split over tokens decodes to "\ufffd" pieces, and tokenizers whose decoders look
at neighbours (SentencePiece's leading-space rule, byte-level merges) spell a token
differently alone than in context. Decoding the whole output every step is right but costs
O(length) per token. vLLM's incremental detokenizer is right *and* cheap: keep two offsets
into the token list and decode only the window between them:

    prefix_text = decode(ids[prefix_offset:read_offset])   # already emitted
    new_text    = decode(ids[prefix_offset:])               # with the new token(s)

and emit `new_text[len(prefix_text):]` once it no longer ends in "\ufffd" (an incomplete
character). The window only spans the tokens not yet emitted plus the last emitted ones.
The prompt's last few tokens seed the window so the first output token is decoded in
context.

Stop strings: text that could still be the start of a stop string is held back; when a stop
string appears, everything before it is emitted and the stop string itself never is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# Prompt tokens used as decoding context for the first output token (as vLLM).
_CONTEXT_TOKENS = 5


@dataclass(slots=True)
class DetokenizerDelta:
    text: str                         # new text safe to stream now (may be "")
    stopped: bool = False             # a stop string matched; `text` ends right before it
    stop_string: str | None = None    # which one (OpenAI's `stop_reason`)


class IncrementalDetokenizer:
    """Per-request streaming state: `add(token_id)` each step, `flush()` at the end."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 min_tokens: int = 0) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = tuple(stop)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        # vLLM's min_tokens rule: stop strings are looked for only once more than min_tokens
        # tokens are out, in the text that is new (a stop string inside the first min_tokens
        # tokens' text never stops; one that ends in a later token's text does).
        self._min_tokens = min_tokens
        self._num_tokens = 0
        # Only the context the window can reach is kept: earlier prompt tokens never matter.
        context = list(prompt_token_ids)[-_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._base = 0                   # absolute index of self._ids[0]; ids before are dropped
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pending = ""               # released by decoding, held for a possible stop string
        self.output_text = ""
        self.stopped = False
        self.finished = False

    # --- decoding window ----------------------------------------------------------------
    def _decode_new(self) -> str:
        """Text the window gained since the last emit; "" while a character is incomplete."""
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset],
                                  skip_special_tokens=self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset:], skip_special_tokens=self._skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        # Drop ids left of the window so memory, like time, stays bounded per request.
        if self._prefix_offset > 64:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return full[len(prefix):]

    # --- stop strings --------------------------------------------------------------------
    def _release(self, text: str) -> DetokenizerDelta:
        buf = self._pending + text
        if not self._stops:
            self._pending = ""
            return self._emit(buf)
        hit, hit_at = None, -1
        if self._num_tokens > self._min_tokens:
            held = len(self._pending)
            for s in self._stops:
                # a match must reach the new text: the held part alone never completes one
                i = buf.find(s, max(0, held - len(s) + 1))
                if i != -1 and (hit is None or i < hit_at):
                    hit, hit_at = s, i
        if hit is not None:
            self._pending = ""
            self.stopped = self.finished = True
            delta = self._emit(buf[:hit_at])
            delta.stopped, delta.stop_string = True, hit
            return delta
        hold = self._stop_prefix_len(buf)
        self._pending = buf[len(buf) - hold:] if hold else ""
        return self._emit(buf[:len(buf) - hold])

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that some stop string starts with."""
        for n in range(min(len(buf), self._max_stop - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def _emit(self, text: str) -> DetokenizerDelta:
        self.output_text += text
        return DetokenizerDelta(text)

    # --- public --------------------------------------------------------------------------
    def add(self, token_id: int) -> DetokenizerDelta:
        """Feed one output token; returns the text that can be streamed now."""
        if self.finished:
            return DetokenizerDelta("", stopped=self.stopped)
        self._ids.append(int(token_id))
        self._num_tokens += 1
        return self._release(self._decode_new())

    def flush(self) -> str:
        """At the end (eos, length): release held text. Nothing is released after a stop;
        a stop string completed by the held text still ends the output before it."""
        if self.finished:
            return ""
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset],
                                  skip_special_tokens=self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset:], skip_special_tokens=self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        delta = self._release(full[len(prefix):])
        self.finished = True
        if delta.stopped:
            return delta.text
        rest, self._pending = self._pending, ""
        self.output_text += rest
        return delta.text + rest

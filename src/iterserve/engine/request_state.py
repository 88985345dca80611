"""The engine's per-request state: one RequestState per user request, one SequenceState per
each of its n sequences.

The scheduler knows only `Request`s (one per sequence, ids `<id>-n<i>` when n > 1); this is
what the engine keeps next to them: the text side (detokenizer, stop strings, logprobs) and
what has changed since the last RequestOutput. The input processor decides what the
sequences are; the output processor creates and updates this state; the tracer reads it.

Per-sequence output state has one home: `SequenceState`. A structured-output matcher or a
tool-call parser follows a sequence's tokens exactly as the detokenizer does, so it becomes
a field here, created in `OutputProcessor.add_request` and fed in
`OutputProcessor._process_token`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from iterserve.core.request import FinishReason, Request, SamplingParams
from iterserve.engine.metrics import RequestMetrics
from iterserve.engine.outputs import TokenLogprob


@dataclass(eq=False)
class SequenceState:
    """One of a request's n sequences: its scheduler Request and its text state."""

    index: int
    request: Request
    detokenizer: Any                         # model.detokenizer.IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None      # None unless the request asked for logprobs
    matcher: Any = None                      # structured.backend.GrammarMatcher, if constrained
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_tokens: int = 0                      # output tokens handled here so far
    metrics: RequestMetrics | None = None    # fixed once the finish is reported
    # Since the last output: what to stream, and whether this sequence is listed in it.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)
    changed: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def reported(self) -> bool:
        """Its finish has been emitted in a RequestOutput."""
        return self.metrics is not None


@dataclass(eq=False)
class RequestState:
    """One user request: the unit of RequestOutputs, traces and request ids."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float              # on the engine's clock
    arrival_wall_time: float         # time.time(), for traces
    seqs: list[SequenceState] = field(default_factory=list)
    error: str | None = None
    error_code: str | None = None    # the error's class for the HTTP answer (None: a fault)
    counted_prompt: bool = False     # its prompt tokens went into a StepStats
    num_finished: int = 0            # sequences with a finish reason (kept, not counted: n may be large)
    num_cached_tokens: int = 0       # prompt tokens any of its sequences got from the prefix cache
    prompt_logprobs: Any = None      # outputs.PromptLogprobs, once the runner has sent them
    pooling: bool = False            # a pooling request: no text, one vector
    embedding: Any = None            # its vector (core.scheduler_output.PoolingOutput.data)
    changed: list[SequenceState] = field(default_factory=list)   # since the last output

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.seqs)

    def end(self, seq: SequenceState, reason: FinishReason) -> None:
        """Set (or, for a stop string seen late, correct) a sequence's finish reason."""
        if seq.finish_reason is None:
            self.num_finished += 1
        seq.finish_reason = reason

    def mark(self, seq: SequenceState) -> None:
        """List `seq` in the next RequestOutput (each sequence once)."""
        if not seq.changed:
            seq.changed = True
            self.changed.append(seq)

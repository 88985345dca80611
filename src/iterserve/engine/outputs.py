"""What the engine hands back per step and per request (vLLM's RequestOutput shape).

A `RequestOutput` is emitted for a request in every step in which one of its sequences
advanced or finished. It carries the cumulative state (text and token ids so far, as the
offline API wants) *and* the delta of this step (as a streaming server wants), so neither
consumer has to diff. `outputs` lists, by index, the sequences that advanced or finished in
this step; the final output (`finished`) lists all n (with n = 1: always the one). So a
step's outputs cost what changed in it, not n per request (vLLM streams n > 1 the same way).
`metrics` (the whole request's, merged over its sequences) comes with the final output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from iterserve.engine.metrics import RequestMetrics


@dataclass(slots=True)
class TokenLogprob:
    """One generated token's logprob and, when asked for, the top alternatives."""

    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None = None   # (token id, logprob), best first


@dataclass(slots=True)
class Logprob:
    """vLLM's Logprob: one token's logprob, its rank in the vocabulary (1 = the best) and its
    text (a prompt_logprobs entry)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list["dict[int, Logprob] | None"]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None          # None unless the request asked
    finish_reason: str | None = None                    # "stop" | "length" | "abort" | ...
    stop_reason: str | int | None = None                # the stop string / token that ended it
    # This step's change (empty when this sequence did not advance in this step).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None
    finished_in_this_step: bool = False
    metrics: RequestMetrics | None = None
    # LLM.chat(..., tools=...) only: the calls parsed from `text` (iterserve.tools.ToolCall)
    # and the text that is not a call (None when the output is only calls).
    tool_calls: list | None = None
    content: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        if not self.logprobs:
            return None
        return sum(lp.logprob for lp in self.logprobs if lp.logprob is not None)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None   # on the final output
    error: str | None = None        # set when a sequence ended with finish_reason "error"
    # None: a server fault; "constraint_too_complex": the request's own constraint reached
    # the grammar engine's limits mid-generation (the server answers it as a 400)
    error_code: str | None = None
    num_cached_tokens: int = 0      # prompt tokens served from the prefix cache (most of any sequence)
    # vLLM's prompt_logprobs, when asked for (SamplingParams.prompt_logprobs = k): one entry
    # per prompt token, None for the first (nothing predicts it), else {token id: Logprob}
    # with the prompt's actual token and the top k. Set from the first sampled token on.
    prompt_logprobs: PromptLogprobs | None = None
    # A pooling request (PoolingParams): its vector, a float32 numpy array (vLLM's
    # PoolingRequestOutput.outputs.data), on the final output; `outputs` is then empty.
    embedding: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

"""Request state: everything the scheduler knows about one request, and nothing about tensors.

A request is a sequence of tokens (prompt + outputs so far) of which `num_computed_tokens`
have their K/V in the cache. Prefill, chunked prefill, prefix-cache hits, decode and
recompute after preemption are all the same loop: each step the scheduler picks how many of
the not-yet-computed tokens to compute; when a step computes up to the last known token, the
executor samples the next one. There is no phase flag to keep in sync (as in vLLM's v1 core).

Every lifecycle event is appended to `events` with its wall/virtual time and step number, so
one request can be traced from arrival to finish (the server's /v1/requests/{id}/trace and
the lab's Chrome trace both read this list).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import Any

from iterserve.errors import SamplingParamsError
from iterserve.structured.params import StructuredOutputsParams



class RequestStatus(enum.Enum):
    WAITING = "waiting"        # queued, never admitted
    RUNNING = "running"        # holds KV blocks, scheduled each step
    PREEMPTED = "preempted"    # evicted by recompute: blocks freed, back in the waiting queue
    SWAPPED = "swapped"        # evicted by swap: blocks live in the host pool
    FINISHED = "finished"

    @property
    def is_finished(self) -> bool:
        return self is RequestStatus.FINISHED


class FinishReason(enum.Enum):
    STOP = "stop"          # eos / stop token / stop string
    LENGTH = "length"      # max_tokens or max_model_len reached
    ABORT = "abort"        # the client went away or cancelled
    TIMEOUT = "timeout"    # deadline or queue-wait limit passed
    ERROR = "error"        # the executor failed on this request


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Field names and meanings follow vLLM/OpenAI."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    n: int = 1
    # vLLM V0's best_of: sample this many sequences, return the n with the highest
    # cumulative logprob (None: n). The engine computes the sampled tokens' logprobs to rank.
    best_of: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None    # number of top logprobs per token (0 = sampled token only)
    skip_special_tokens: bool = True
    # Constrained and edited sampling (vLLM's fields). `structured_outputs` is a
    # structured.params.StructuredOutputsParams (plain data; the engine compiles it).
    structured_outputs: Any = None
    logit_bias: dict[int, float] | None = None      # token id -> bias, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None     # sample only among these ids
    bad_words: list[str] | None = None             # words never completed in the output
    min_tokens: int = 0                            # no EOS / stop token before this many
    include_stop_str_in_output: bool = False       # keep the matched stop string in the text
    # vLLM's prompt_logprobs: the top-k logprobs (plus the actual token's) of every prompt
    # position; the runner computes the LM head over the prompt rows of such a request, and
    # the prefix cache is not used for it (vLLM does the same: cached rows have no logits).
    prompt_logprobs: int | None = None
    # Latency targets (extension fields, as vLLM-style extra body): the `slo`
    # scheduling policy orders, admits and refuses by them; None takes the server's
    # --slo-ttft-ms / --slo-tpot-ms. Any other policy refuses a request that sets them.
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    # Filled by the engine's input processor from the fields above (vLLM keeps the same
    # derived state on its SamplingParams): bad_words as token sequences, and the ids that
    # min_tokens holds back (EOS unless ignore_eos, plus stop_token_ids).
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    all_stop_token_ids: tuple[int, ...] | None = field(default=None, repr=False)

    @property
    def uses_logits_processors(self) -> bool:
        """Any of the per-row logits edits the sampler applies (model/logits_processors)."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids
                    or self.min_tokens)

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs: best_of when it is above n, else n."""
        return max(self.n, self.best_of or 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        def bad(msg: str, param: str) -> None:
            raise SamplingParamsError(msg, param)

        # NaN passes every range check below (all comparisons are false) and inf slips
        # through the one-sided ones, so non-finite floats are refused first, by name.
        for f in _FLOAT_FIELDS:
            v = getattr(self, f)
            if isinstance(v, float) and not math.isfinite(v):
                bad(f"{f} must be a finite number, got {v}", f)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            bad(f"top_k must be -1 (disabled) or at least 0, got {self.top_k}", "top_k")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be positive, got {self.repetition_penalty}", "repetition_penalty")
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be at least 1, got {self.n}", "n")
        if self.best_of is not None and (isinstance(self.best_of, bool)
                                         or not isinstance(self.best_of, int)
                                         or self.best_of < self.n):
            bad(f"best_of must be an integer at least n ({self.n}), got {self.best_of!r}",
                "best_of")
        if self.logprobs is not None and self.logprobs < 0:
            bad(f"logprobs must be non-negative, got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None and (
                isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
                or self.prompt_logprobs < 0):
            bad(f"prompt_logprobs must be a non-negative integer, got {self.prompt_logprobs!r}",
                "prompt_logprobs")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a list of non-empty strings", "stop")
        for f in ("ttft_slo_ms", "tpot_slo_ms"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or not 0 < v <= MAX_SLO_MS):
                bad(f"{f} must be a number of milliseconds in (0, {MAX_SLO_MS:g}], got {v!r}",
                    f)
        self._validate_constraints(bad)
        return self

    def _validate_constraints(self, bad) -> None:
        """Shapes of the constrained-sampling fields (the vocabulary checks need the model:
        the engine's input processor does them)."""
        so = self.structured_outputs
        if so is not None:
            if isinstance(so, dict):
                self.structured_outputs = so = StructuredOutputsParams.from_structured_outputs(so)
            if not isinstance(so, StructuredOutputsParams):
                bad("structured_outputs must be a StructuredOutputsParams, got "
                    f"{type(so).__name__}", "structured_outputs")
            so.validate()                    # a StructuredOutputsError (400) naming the field
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias must be a map of token id to bias", "logit_bias")
            for k, v in self.logit_bias.items():
                if isinstance(k, bool) or not isinstance(k, (int, str)):
                    bad(f"logit_bias keys must be token ids, got {k!r}", "logit_bias")
                if isinstance(v, bool) or not isinstance(v, (int, float)) \
                        or not math.isfinite(v):
                    bad(f"logit_bias[{k!r}] must be a finite number, got {v!r}", "logit_bias")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                bad("allowed_token_ids must be a non-empty list of token ids",
                    "allowed_token_ids")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or any(
                    not isinstance(w, str) or not w.strip() for w in self.bad_words):
                bad("bad_words must be a list of non-empty strings", "bad_words")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or self.min_tokens < 0:
            bad(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}",
                "min_tokens")
        if self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                f"({self.max_tokens})", "min_tokens")
        if not isinstance(self.include_stop_str_in_output, bool):
            bad("include_stop_str_in_output must be a boolean", "include_stop_str_in_output")


MAX_SLO_MS = 3_600_000.0    # an hour: a latency target beyond that is no target


@dataclass(slots=True)
class PoolingParams:
    """What a pooling request (an embedding) asks for; vLLM's PoolingParams.

    A pooling request is computed like a prompt and never samples: when its last prompt
    token is computed the executor pools the hidden states into one vector and the
    scheduler finishes it (its KV blocks freed). `dimensions` keeps the first that many
    values (Matryoshka truncation; the engine checks the model supports it), `normalize`
    overrides the model's pooling config (None: as the checkpoint says).
    `reads_every_row` is filled by the engine from the model's pooler: mean or CLS pooling
    reads rows a prefix-cache hit would not compute, so such a request takes no hits."""

    dimensions: int | None = None
    normalize: bool | None = None
    reads_every_row: bool = field(default=False, repr=False)

    def validate(self) -> "PoolingParams":
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise SamplingParamsError(f"dimensions must be a positive integer, got {d!r}",
                                      "dimensions")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise SamplingParamsError("normalize must be true or false", "normalize")
        return self


# What a pooling request's Request carries as its sampling params: one "output" position,
# so the scheduler's length and block arithmetic (prompt + max_tokens - 1 computed tokens)
# counts exactly its prompt.
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


_FLOAT_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.type in ("float", float))


@dataclass(slots=True)
class RequestEvent:
    """One point in a request's life. `step` is the scheduler step it happened in (or None)."""

    name: str              # arrived, queued, scheduled, prefill_chunk, first_token, preempted,
                           # swapped_out, swapped_in, resumed, finished, rejected
    time: float
    step: int | None = None
    detail: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"event": self.name, "time": self.time, "step": self.step}
        if self.detail:
            d.update(self.detail)
        return d


class Request:
    """One request's state. Mutated only by the scheduler (and the engine appending text).

    `priority`: lower value = more urgent (as in vLLM). `arrival_time` is on the scheduler's
    clock (wall time in the engine, virtual time in the lab). `deadline` is an absolute time
    after which the request ends with FinishReason.TIMEOUT, whatever its state;
    `queue_deadline` applies only while it has never been admitted. `ttft_slo_ms` /
    `tpot_slo_ms` are latency targets (the `slo` policy admits and orders by them).
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "output_token_ids", "all_token_ids",
        "sampling_params", "priority", "arrival_time", "status", "finish_reason",
        "num_computed_tokens", "num_cached_tokens", "num_preemptions", "events",
        "deadline", "queue_deadline", "eos_token_id", "first_token_time", "first_scheduled_time",
        "finished_time", "token_times", "user_data", "ttft_slo_ms", "tpot_slo_ms",
        "spec_token_ids", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
        "pooling_params",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float = 0.0,
        eos_token_id: int | None = None,
        deadline: float | None = None,
        queue_deadline: float | None = None,
        user_data: Any = None,
        ttft_slo_ms: float | None = None,
        tpot_slo_ms: float | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must have at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # prompt + outputs, kept as one list so "tokens to compute" is a slice of it.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # A pooling request (PoolingParams) computes its prompt and ends there, sampling
        # nothing; its sampling params are POOLING_SAMPLING.
        self.pooling_params = pooling_params
        if pooling_params is not None:
            sampling_params = POOLING_SAMPLING
        self.sampling_params = sampling_params or SamplingParams()
        self.priority = priority
        self.arrival_time = arrival_time
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0          # prompt tokens served from the prefix cache
        self.num_preemptions = 0
        self.events: list[RequestEvent] = []
        self.deadline = deadline
        self.queue_deadline = queue_deadline
        self.eos_token_id = eos_token_id
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.token_times: list[float] = []   # time each output token was produced
        self.user_data = user_data           # free slot for the engine/lab (e.g. a stream)
        # Speculative decoding (core/spec_decode): the drafts proposed for the next step
        # (vLLM's spec_token_ids: extra tokens of that step, never part of all_token_ids),
        # and this request's verifications so far.
        self.spec_token_ids: list[int] = []
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Latency targets for the `slo` policy: given here, else the sampling params' (a
        # request's own, over HTTP), else the scheduler's slo_ttft_ms / slo_tpot_ms defaults
        # (filled in by add_request); still None: no target.
        sp = self.sampling_params
        self.ttft_slo_ms = ttft_slo_ms if ttft_slo_ms is not None else sp.ttft_slo_ms
        self.tpot_slo_ms = tpot_slo_ms if tpot_slo_ms is not None else sp.tpot_slo_ms

    # --- sizes -------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose K/V are not yet cached (the whole prompt at first, then 1 per step)."""
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first `num_output_tokens` output tokens: a step that verified drafts
        appended several, and a stop string (or a completed grammar) ended the output inside
        them; the tokens after it were never the output. Only for a request that is ending."""
        drop = len(self.output_token_ids) - num_output_tokens
        if drop <= 0:
            return
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[len(self.all_token_ids) - drop:]
        del self.token_times[num_output_tokens:]

    def record(self, name: str, time: float, step: int | None = None, **detail: Any) -> None:
        self.events.append(RequestEvent(name, time, step, detail or None))

    def __lt__(self, other: "Request") -> bool:
        """Queue order: more urgent first, then earlier arrival (ties by id for determinism)."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority, other.arrival_time, other.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens}, "
                f"out={self.num_output_tokens}/{self.sampling_params.max_tokens})")

    def trace(self) -> dict[str, Any]:
        """The request's life as a JSON-ready dict (server trace endpoint, lab per-request)."""
        return {
            "request_id": self.request_id,
            "status": self.status.value,
            "finish_reason": self.finish_reason.value if self.finish_reason else None,
            "priority": self.priority,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "cached_tokens": self.num_cached_tokens,
            "num_preemptions": self.num_preemptions,
            **({"spec_decode": {
                "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens,
            }} if self.num_draft_tokens else {}),
            "events": [e.to_dict() for e in self.events],
        }

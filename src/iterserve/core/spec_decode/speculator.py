"""The scheduler's side of speculative decoding: proposals, the per-step plan, the books.

vLLM v1's shape: a request's drafts are extra tokens of its step. After a step gives a
request its tokens (`update_from_output`), `propose` stores up to k drafts on the request
(`Request.spec_token_ids`); the next `schedule()` asks `plan` how many of each request's
drafts to verify (core/spec_decode/adaptive.py), and the running part schedules 1 + that
many tokens, against the token budget and the KV blocks like any other tokens; the
executor verifies them and returns the accepted drafts plus one token of its own; the
scheduler keeps the accepted ones' KV, returns the blocks of the rejected ones at once, and
calls `verified` here. Drafts the plan leaves out, or that a preemption drops, are just
forgotten: the next step proposes again.

Proposals are bounded so that a fully accepted verification never passes `max_tokens` or
`max_model_len` (k <= tokens the request may still produce - 1), which also keeps every
verification inside the KV blocks `add_request` checked the request can ever need.

What it keeps per live request (its acceptance, the proposer's index) is dropped by
`forget`, called when the request finishes; `SpecDecodingStats` are the counters the
engine's metrics report (vLLM's names).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from iterserve.core.cost_model import load_cost_model
from iterserve.core.request import Request
from iterserve.core.spec_decode.adaptive import (
    ALL_DECAY, PROBE_EVERY, Acceptance, StepShape, plan_drafts)
from iterserve.core.spec_decode.config import SpeculativeConfig
from iterserve.core.spec_decode.ngram import (
    DraftModelProposer, NgramProposer, SyntheticProposer)
from iterserve.core.spec_decode.suffix import SuffixProposer
from iterserve.core.step_time import StepTimeModel, attention_pairs

DEFAULT_COST_MODEL = "smollm2-cpu"


@dataclass(slots=True)
class SpecDecodingStats:
    """Verification counters (vLLM's SpecDecodingStats): per step, or accumulated."""

    num_spec_tokens: int
    num_drafts: int = 0                # verifications (requests that verified drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for j in range(min(num_accepted, len(per_pos))):
            per_pos[j] += 1

    def add(self, other: "SpecDecodingStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for j, n in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[j] += n

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification, the target's own one included (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length}


def make_proposer(config: SpeculativeConfig):
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth,
                              config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor,
                              config.suffix_decoding_min_token_prob)
    if config.method == "synthetic":
        return SyntheticProposer()
    return DraftModelProposer()


def default_step_model(name: str | None) -> StepTimeModel:
    return StepTimeModel.from_cost_model(load_cost_model(name or DEFAULT_COST_MODEL))


class Speculator:
    """Owned by the Scheduler when `speculative_config` is set."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 clock: Callable[[], float], step_model: StepTimeModel | None = None,
                 proposer=None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.adaptive = config.adaptive
        self.model = (step_model if step_model is not None or not self.adaptive
                      else default_step_model(config.cost_model))
        self.clock = clock
        self.acceptance: dict[str, Acceptance] = {}
        self.recent = Acceptance(ALL_DECAY)   # every request's verifications: the prior
        self.total = SpecDecodingStats(self.k)
        self.last = SpecDecodingStats(self.k)     # the last update_from_output's
        self.step = 0
        self.cutoff = 0.0          # the last plan's: a first draft below it did not pay
        self.probe_every = PROBE_EVERY   # the last plan's: steps between a request's probes
        self._t0: float | None = None
        self._shape: StepShape | None = None

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Time steps on `clock` (the lab's simulated seconds) instead of the scheduler's."""
        self.clock = clock

    # --- proposals --------------------------------------------------------------------------
    def room(self, req: Request) -> int:
        """Drafts the request can take: a fully accepted verification plus the target's own
        token must stay within max_tokens and max_model_len."""
        left = min(req.sampling_params.max_tokens - len(req.output_token_ids),
                   self.max_model_len - len(req.all_token_ids))
        return min(self.k, left - 1)

    def propose(self, req: Request) -> None:
        """After `req` got its tokens of a step: its drafts for the next one (or none). A
        request whose speculation is off (its acceptance does not pay) is not asked until it
        is due for a probe."""
        k = self.room(req)
        if k > 0 and self.adaptive:
            acc = self.acceptance.get(req.request_id)
            if acc is not None and acc.rate(self.recent.rate(), self.step) <= self.cutoff and \
                    self.step - acc.last_step < self.probe_every:
                k = 0
        req.spec_token_ids = self.proposer.propose(req, k) if k > 0 else []

    # --- the step ---------------------------------------------------------------------------
    def plan(self, running: Iterable[Request], step: int, budget: int) -> dict[str, int]:
        """{request id: drafts to verify this step} for the running requests (see
        adaptive.py). Without `adaptive`: all of each request's drafts."""
        self.step = step
        if not self.adaptive:
            return {r.request_id: len(r.spec_token_ids) for r in running
                    if r.spec_token_ids and r.num_computed_tokens == len(r.all_token_ids) - 1}
        base = StepShape()
        expected = 0
        candidates: list[tuple[float, str, int, int]] = []
        acceptance = self.acceptance
        prior = self.recent.rate()
        # A probe is one more row in a step of len(running): its cost relative to the step
        # grows with the batch, so each request probes that many times less often (about
        # one probe every PROBE_EVERY steps over the batch: at 16 slots and a low
        # acceptance, a probe every 16 steps per request costs 2.6% in the lab).
        every = self.probe_every = PROBE_EVERY * max(1, len(running))
        for r in running:
            start = r.num_computed_tokens
            n = len(r.all_token_ids) - start
            if n == 1:
                base.tokens += 1
                base.seqs += 1
                base.kv += start + 1
                expected += 1
                drafts = r.spec_token_ids
                if not drafts:
                    continue
                acc = acceptance.get(r.request_id)
                if acc is None:             # not verified yet: probe its first draft now
                    acc = acceptance[r.request_id] = Acceptance()
                    acc.last_step = step - every
                a = acc.rate(prior, step)
                if step - acc.last_step >= every:
                    candidates.append((1.0, r.request_id, 1, start + 2))     # a probe
                    continue
                gain = 1.0
                for j in range(1, len(drafts) + 1):
                    gain *= a
                    candidates.append((gain, r.request_id, j, start + 1 + j))
            else:                           # a prefill chunk (at most what the budget has)
                c = min(n, max(budget - base.tokens, 0))
                if c:
                    base.tokens += c
                    base.seqs += 1
                    base.prefill += c
                    base.attn += attention_pairs(start, c)
                    expected += c == n
        counts, self.cutoff = plan_drafts(candidates, base, expected, self.model)
        return counts

    def begin_step(self, shape: StepShape) -> None:
        """The scheduled step's features, timed until `step_done` (the online refit)."""
        if self.adaptive:
            self._shape = shape
            self._t0 = self.clock()

    def step_done(self) -> None:
        shape, t0 = self._shape, self._t0
        self._shape = self._t0 = None
        if shape is None or t0 is None or not shape.seqs:
            return
        seconds = self.clock() - t0
        self.model.observe(shape.tokens, shape.seqs, shape.kv, shape.prefill, seconds,
                           shape.attn)

    def verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """A verification's outcome: the request's books, its acceptance, the counters."""
        req.num_drafts += 1
        req.num_draft_tokens += num_drafts
        req.num_accepted_tokens += num_accepted
        acc = self.acceptance.get(req.request_id)
        if acc is None:
            acc = self.acceptance[req.request_id] = Acceptance()
        acc.observe(num_drafts, num_accepted, self.step)
        self.recent.observe(num_drafts, num_accepted, self.step)
        self.last.observe(num_drafts, num_accepted)

    def end_update(self) -> SpecDecodingStats:
        """The counters of the update just applied (and fresh ones for the next)."""
        last = self.last
        self.total.add(last)
        self.last = SpecDecodingStats(self.k)
        return last

    def forget(self, req: Request) -> None:
        """The request finished: drop its state (suffix: cache its output)."""
        self.acceptance.pop(req.request_id, None)
        finish = getattr(self.proposer, "finish", None)
        if finish is not None:
            finish(req)
        else:
            self.proposer.drop(req.request_id)
        req.spec_token_ids = []

    def __len__(self) -> int:
        """Per-request entries held (for the bookkeeping checks): 0 when idle."""
        return len(self.acceptance) + len(self.proposer)

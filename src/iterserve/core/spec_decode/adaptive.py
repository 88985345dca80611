"""How many of its drafts each request verifies this step: where a draft token pays.

A verified draft costs what one more decode row costs (the runner verifies k drafts as k + 1
decode rows of the request); it pays only when it is likely to be accepted. With a request's
recent acceptance a (the chance that a draft is accepted given the one before it was), its
j-th draft yields a^j expected tokens. For the whole step, with G tokens expected from it so
far and T its predicted time, one more row at marginal cost c raises tokens per second iff

    (G + a^j) / (T + c) > G / T,   i.e.   a^j > G * c / T.

So the plan sorts every candidate draft of the step by a^j and takes them while that holds,
re-predicting T with each. At batch 1 a decode step is mostly fixed cost (reading the
weights) and G * c / T is small: drafts with modest acceptance pay. At a large batch G * c / T
approaches the share one row has of the step: only drafts that are nearly sure to be
accepted pay, and speculation turns itself off as the step stops being bandwidth-bound.

Step times come from the lab's cost model form (core/step_time.py `StepTimeModel`), seeded
from a fit (`cost_model` in the speculative config) and refitted online from the engine's
own steps, so the prediction follows the machine; the lab feeds it its simulated seconds.

Acceptance per request is a decayed count of accepted drafts over drafts tried (a geometric
model: a verification that accepts a of k drafts is a successes in a + (a < k) trials),
starting from a prior. A request whose acceptance fell below what pays verifies nothing, so
its estimate would never recover: every `PROBE_EVERY` steps without a verification it tries
one draft.
"""

from __future__ import annotations

from iterserve.core.step_time import StepTimeModel

PRIOR_ACCEPTANCE = 0.6       # before a request has been verified
PRIOR_WEIGHT = 2.0           # ... worth this many draft trials
DECAY = 0.8                  # per verification: the estimate follows ~5 recent verifications
PROBE_EVERY = 16             # steps without a verification before one draft is tried anyway


class Acceptance:
    """One request's recent acceptance (decayed successes / trials)."""

    __slots__ = ("accepted", "trials", "last_step")

    def __init__(self) -> None:
        self.accepted = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
        self.trials = PRIOR_WEIGHT
        self.last_step = -1

    @property
    def rate(self) -> float:
        return self.accepted / self.trials if self.trials > 0 else 0.0

    def observe(self, num_drafts: int, num_accepted: int, step: int) -> None:
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        self.accepted = self.accepted * DECAY + num_accepted
        self.trials = self.trials * DECAY + trials
        self.last_step = step


class StepShape:
    """The features of the step being planned (the cost model's: tokens, rows, K/V read,
    prefill tokens, attention pairs)."""

    __slots__ = ("tokens", "seqs", "kv", "prefill", "attn")

    def __init__(self) -> None:
        self.tokens = self.seqs = self.kv = self.prefill = self.attn = 0

    def predict(self, model: StepTimeModel) -> float:
        return model.predict(self.tokens, self.seqs, self.kv, self.prefill, self.attn)


def plan_drafts(candidates: list[tuple[float, str, int, int]], base: StepShape,
                expected_tokens: float, model: StepTimeModel) -> tuple[dict[str, int], float]:
    """The drafts to verify, {request id: how many of its drafts}, and the gain below which
    a draft did not pay in this step (0.0 when every candidate was taken).

    `candidates`: (gain a^j, request id, j, context length at draft j) for every draft
    position j = 1.. of every request with drafts (a request's gains fall with j, so a sort
    by gain keeps each request's positions in order). `base`: the step without drafts;
    `expected_tokens`: the tokens it yields (one per sampling request)."""
    if not candidates:
        return {}, 0.0
    candidates.sort(key=lambda c: (-c[0], c[2]))
    shape = base
    t = shape.predict(model)
    g = max(expected_tokens, 1.0)
    counts: dict[str, int] = {}
    cutoff = 0.0
    for gain, rid, j, ctx in candidates:
        if counts.get(rid, 0) != j - 1:
            continue                         # an earlier position of this request was refused
        shape.tokens += 1
        shape.seqs += 1
        shape.kv += ctx
        t2 = shape.predict(model)
        if (g + gain) * t <= g * t2:
            cutoff = gain
            break                            # gains only fall from here
        g += gain
        t = t2
        counts[rid] = j
    return counts, cutoff

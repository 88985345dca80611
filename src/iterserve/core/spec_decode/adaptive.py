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
pulled towards a prior: what the recent verifications of all requests accepted (the same
count over every request, itself pulled towards PRIOR_ACCEPTANCE). A request whose
acceptance fell below what pays verifies nothing, so its estimate would never recover: after
`PROBE_EVERY` steps per running request without a verification it tries one draft. A new
request tries one at its first decode, so it has an estimate of its own: a prior that does
not pay at the step's batch size would otherwise never be tested (at 8 slots no request
would be verified until the batch thinned).
"""

from __future__ import annotations

from iterserve.core.step_time import StepTimeModel

PRIOR_ACCEPTANCE = 0.6       # before a request has been verified
PRIOR_WEIGHT = 8.0           # ... worth this many draft trials (the prior: all requests' rate)
DECAY = 0.8                  # per verification: the estimate follows ~5 recent verifications
ALL_DECAY = 0.98             # ... and all requests' estimate (the prior) ~50
STALE_HALF_LIFE = 8          # steps without a verification that halve a request's own count
PROBE_EVERY = 16             # steps (x running requests) without a verification before one
                             # draft is tried anyway


class Acceptance:
    """Recent acceptance (decayed successes / trials) of one request, or of all of them."""

    __slots__ = ("accepted", "trials", "last_step", "decay")

    def __init__(self, decay: float = DECAY) -> None:
        self.accepted = 0.0
        self.trials = 0.0
        self.last_step = -1
        self.decay = decay

    def rate(self, prior: float = PRIOR_ACCEPTANCE, step: int | None = None) -> float:
        """The estimate, pulled towards `prior` by PRIOR_WEIGHT trials; at `step`, its own
        count weighs half as much every STALE_HALF_LIFE steps since its last verification.

        A request's prior is what all requests accepted recently: with ~5 verifications of
        1-4 drafts each, a request's own count alone is noisy, and the pull keeps it near
        the others' until its own trials say it differs. The ageing is what lets a request
        back in: one whose estimate dipped below what pays is not verified, so nothing
        would correct it (at a true 0.9 and 8 slots, one rejection in two verifications
        reads 0.68, and without ageing a third of the batch stays out of speculation)."""
        a, t = self.accepted, self.trials
        if step is not None and self.last_step >= 0 and step - self.last_step > 1:
            f = 0.5 ** ((step - self.last_step - 1) / STALE_HALF_LIFE)
            a, t = a * f, t * f
        return (a + PRIOR_WEIGHT * prior) / (t + PRIOR_WEIGHT)

    def observe(self, num_drafts: int, num_accepted: int, step: int) -> None:
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        self.accepted = self.accepted * self.decay + num_accepted
        self.trials = self.trials * self.decay + trials
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
    t = t0 = shape.predict(model)
    g = g0 = max(expected_tokens, 1.0)
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
            # The cutoff is what one draft must yield to pay in the step without the
            # others (the base step plus this row alone): a request below it would not pay
            # even verified alone, and stops proposing until its probe. Not this
            # candidate's own gain: it was refused because the drafts taken before it
            # raised the bar, and the other requests at that rate would then all go quiet
            # together for PROBE_EVERY steps (at 8 slots and acceptance 0.9, a sixth of the
            # steps would verify anything; the lab's `spec` sweep shows it).
            cutoff = min(gain, g0 * (t2 - t) / t0)
            break                            # gains only fall from here
        g += gain
        t = t2
        counts[rid] = j
    return counts, cutoff

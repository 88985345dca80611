"""An online model of how long one scheduler step takes, for the SLO-aware policy.

Why: to refuse a request that cannot meet its time-to-first-token target, or to hold
admission before one more decode pushes everyone past their time-per-output-token target,
the scheduler must predict step times on *this* machine with *this* model, now. The lab's
cost model (core/cost_model.py) has the right form, fitted once offline by `iterserve lab
calibrate`:

    step_s = c0 + c_tok * tokens + c_seq * seqs + c_kv * kv_tokens + c_prefill_tok * prefill_tokens
           + c_attn * attn_pairs

(`attn_pairs`: query-key pairs of the step's prefill chunks, `attention_pairs` summed over
them: causal, so a chunk of n tokens after s of context has n x s + n (n + 1) / 2; a chunk deep into a long prompt costs more than
the same chunk at its start, and only this term can say so.) This module keeps that form
(plus the fit's token corrections, below) and refits it online from every measured
step (features of the step, seconds it took): exponentially forgotten least squares (the
normal equations of recursive least squares, kept as sums so they cannot lose positive
definiteness), with a ridge pull towards the seed and a non-negative solve, so it follows
the machine (other load, thermal limits, a different model) within ~1 / (1 - FORGETTING)
steps. Design points, all about staying cheap and stable:

- Pure Python on fixed 7x7 lists (six terms and the correction's level): `observe` is 35
  multiply-adds and one bisect over the correction's knots; the 7x7 solve (~0.2k
  flops) runs only when a prediction is asked for after new observations.
- Features are scaled to O(1) (`_SCALE`) so the covariance stays well conditioned.
- Each observation is weighted by 1 / seconds^2, i.e. the fit minimises *relative* error, as
  the offline calibration does (a 10 ms decode step matters as much as a 500 ms prefill).
- A residual is clipped to `MAX_REL_RESIDUAL` of the measurement, so one outlier step (a GC
  pause, a page fault storm) moves the fit only a little.
- Some directions are never excited: decode-only traffic never separates `c_tok` from
  `c_seq` (tokens == seqs), and in any engine tokens = seqs + prefill tokens - prefill
  chunks. Plain forgetting would let such a direction drift freely ("windup"); the ridge
  term (worth PRIOR_WEIGHT observations) keeps it at the seed instead.
- Coefficients are non-negative (an active-set solve: time never decreases with work).
- The ridge pulls towards an *anchor* that follows the machine, not towards the seed as
  given: anchor_i = speed * shape_i. `speed` is a one-parameter fit of the recent steps to
  the shape's prediction (how much faster or slower this machine is now; any step informs
  it, computed from the same decayed sums), and `shape_i` is the coefficient's last *confident* value over the speed
  at that time (the seed's value until then). A term is confident when its decayed
  information, roughly the sum over recent steps of (its share of the step's time)^2, is at least
  CONFIDENT_INFO: e.g. a few dozen steps in which a prefill chunk took half the time. So a
  decode-only stretch on a machine twice as slow as the seed doubles the predicted prefill
  cost too (before, it kept the seed's), and a prefill cost once measured keeps its measured
  ratio to the rest while only decodes run, scaling with the machine's speed.
- `c_attn` seeded at 0 (every fit from before the term) is "never measured": its prior is
  weak (a whole step, not 5% of one) and it takes its anchor shape from the data as soon as
  chunks with context excite it, so the first long prompts teach it instead of being
  explained away as a slower machine.

Token corrections (cost model v3): the model runner's GEMMs change kernel with the number
of rows a step puts through them, which no linear term can say (a 16-token chunk costs what
16 decodes cost; a 2k-token prompt runs its GEMMs faster per token than a 256-token chunk).
The offline fit has a piecewise-linear correction by the step's token count for that
(`token_correction`, the one definition the lab's cost model uses too); seeded from such a
fit, this model carries the correction's *shape* as a seventh feature, corr_seed(tokens),
whose coefficient (the correction's level, 1.0 at the seed) is refitted online with the
rest: the same normal equations, ridge and speed anchor, so on a machine twice as slow the
correction doubles with everything else, and traffic that shows the shape is off shrinks or
grows it. Refitting the knots themselves online would take a dozen more unknowns that a
stretch of decode-only traffic never excites; the level is the one that every step informs.
A prediction is clamped like the lab's (`MIN_LINEAR_SHARE` of the linear terms at least),
so the simulated steps and the policy's predictions are the same function at the seed.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import Iterable, Mapping, Sequence


def token_correction(knots: Sequence[tuple[int, float]], tokens: float) -> float:
    """corr(tokens) of a cost model's `token_corrections` ((tokens, seconds) pairs, tokens
    strictly increasing): linear between the knots, the first value held below them, and
    *proportional* beyond the last (corr(last) * tokens / last: a per-token correction).

    Why proportional beyond the last knot: there the correction says how much cheaper (or
    dearer) per token a big step's GEMMs run than the linear terms' slope, and a bigger
    step keeps that per-token rate; holding the value instead priced a 2k-token prompt
    (the long-prompt presets with chunking off) at the 256-token step's correction, an
    eighth of it. Not the last segment's slope: one segment timed on a few points is a
    noisy slope, and extrapolated over 8x the tokens it can swing the step to the clamp.
    0 without knots."""
    if not knots:
        return 0.0
    i = bisect_right(knots, (tokens, math.inf))
    if i == 0:
        return knots[0][1]
    if i == len(knots):
        t1, v1 = knots[-1]
        return v1 * tokens / t1 if tokens > t1 else v1
    (t0, v0), (t1, v1) = knots[i - 1], knots[i]
    return v0 + (v1 - v0) * (tokens - t0) / (t1 - t0)


def attention_pairs(start: int, n: int) -> int:
    """Query-key pairs of a prefill chunk of `n` tokens after `start` cached ones: each of
    its tokens attends to the context and to the chunk's tokens up to itself (causal), as
    the paged prefill attention kernel computes them (it stops each query block at its last
    position). The one definition for the lab, the calibration and the SLO policy: a whole
    prompt of L tokens is ~L^2 / 2 pairs, the same as its chunks add up to."""
    return n * start + n * (n + 1) // 2

COEFFICIENTS = ("c0", "c_tok", "c_seq", "c_kv", "c_prefill_tok", "c_attn")
_N = len(COEFFICIENTS) + 1       # ... and the token correction's level (feature corr(tokens))
MIN_LINEAR_SHARE = 0.1      # a correction never takes a step below this share of the linear
# Typical magnitude of each feature (1, tokens, seqs, kv tokens, prefill tokens, attention
# pairs: a 128-token chunk at ~1k tokens of context).
_SCALE = (1.0, 256.0, 32.0, 16384.0, 256.0, 131072.0)
FORGETTING = 0.99           # memory ~100 steps: a few seconds of a busy engine
MAX_REL_RESIDUAL = 0.5      # a step more than 50% off the prediction counts as 50% off
PRIOR_WEIGHT = 1.0         # fixed pull of the seed (dominates only the first few steps)
RIDGE_SHARE = 0.001          # ... plus this share of the data's weight on each coefficient
TRUST_AFTER = 100           # observations before the outlier clip applies
REFIT_EVERY = 16            # refresh the fit the outlier clip compares against (~2 us/step)
MIN_PRIOR_SHARE = 0.05      # prior scale of a coefficient seeded at 0, as a share of a step
# ... except c_attn: every fit from before the term has none, so a 0 there means "never
# measured", not "free"; its prior scale is a whole step, and a few dozen chunks deep into a
# prompt decide it. (A tight prior would hold it near 0, leave the chunk steps unexplained,
# and the speed fit would blow up trying to explain them instead.)
_PRIOR_SHARE = (MIN_PRIOR_SHARE,) * 5 + (1.0, MIN_PRIOR_SHARE)
CONFIDENT_INFO = 4.0        # decayed sum of (term's share of the step)^2 to trust a term
SPEED_RANGE = (0.02, 50.0)  # the speed fit is clipped to this (a broken clock stays bounded)


def _solve(A: list[list[float]], b: list[float], free: list[int]) -> list[float]:
    """Solve A[free, free] x = b[free] by Gaussian elimination with partial pivoting."""
    n = len(free)
    M = [[A[i][j] for j in free] + [b[i]] for i in free]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(M[r][c]))
        if abs(M[p][c]) < 1e-300:
            raise ZeroDivisionError("singular")
        M[c], M[p] = M[p], M[c]
        piv = M[c]
        for r in range(c + 1, n):
            f = M[r][c] / piv[c]
            if f:
                row = M[r]
                for k in range(c, n + 1):
                    row[k] -= f * piv[k]
    x = [0.0] * n
    for c in range(n - 1, -1, -1):
        x[c] = (M[c][n] - sum(M[c][k] * x[k] for k in range(c + 1, n))) / M[c][c]
    return x


class StepTimeModel:
    """Predicts a step's seconds from its batch shape; `observe()` refits it online."""

    __slots__ = ("_theta", "_seed", "_ridge", "_A", "_b", "_dirty", "forgetting",
                 "num_observed", "last_seconds", "_fitted_at", "_shape", "_info", "_seen",
                 "_unmeasured", "corrections", "_corr_scale")

    def __init__(self, coefficients: Mapping[str, float] | Sequence[float],
                 forgetting: float = FORGETTING,
                 corrections: Sequence[tuple[int, float]] = ()) -> None:
        """`coefficients`: the six linear terms (a mapping, or a sequence in COEFFICIENTS
        order; five from before c_attn). `corrections`: the seed's token corrections
        ((tokens, seconds) pairs, see `token_correction`), whose level is refitted."""
        if isinstance(coefficients, Mapping):
            coefs = [float(coefficients.get(k, 0.0)) for k in COEFFICIENTS]
        else:
            coefs = [float(c) for c in coefficients]
        if len(coefs) == len(COEFFICIENTS) - 1:     # a seed from before c_attn: no attention
            coefs.append(0.0)
        if len(coefs) != len(COEFFICIENTS):
            raise ValueError(f"expected {len(COEFFICIENTS)} coefficients, got {len(coefs)}")
        if any(not math.isfinite(c) or c < 0 for c in coefs):
            raise ValueError(f"coefficients must be finite and non-negative, got {coefs}")
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        knots = tuple((int(t), float(v)) for t, v in corrections)
        if any(not math.isfinite(v) for _, v in knots) or any(
                b[0] <= a[0] for a, b in zip(knots, knots[1:])) or any(t < 1 for t, _ in knots):
            raise ValueError("corrections must be (tokens >= 1, finite seconds) pairs, tokens "
                             f"strictly increasing, got {corrections!r}")
        self.corrections = knots
        # The correction feature in units of its largest knot (O(1), as the others).
        self._corr_scale = max((abs(v) for _, v in knots), default=0.0) or 1.0
        # theta lives in scaled units: theta[i] = coef[i] * scale[i] (seconds at typical size);
        # the correction's level 1.0 is theta = its scale.
        self._seed = [c * s for c, s in zip(coefs, _SCALE)]
        self._seed.append(self._corr_scale if knots else 0.0)
        self._theta = list(self._seed)
        ref = max(sum(self._seed), 1e-6)
        # Ridge: (theta_i - seed_i) of one prior scale costs PRIOR_WEIGHT relative-error
        # observations (the fit is in relative units, see observe()).
        self._ridge = [PRIOR_WEIGHT / max(t, share * ref) ** 2
                       for t, share in zip(self._seed, _PRIOR_SHARE)]
        self._unmeasured = [t == 0.0 and share >= 1.0
                            for t, share in zip(self._seed, _PRIOR_SHARE)]
        self._A = [[0.0] * _N for _ in range(_N)]
        self._b = [0.0] * _N
        self._shape = list(self._seed)          # anchor_i = speed * shape_i
        self._info = [0.0] * _N
        self._seen = [False] * _N       # terms present in a step since the last refit
        self._dirty = False
        self.forgetting = forgetting
        self.num_observed = 0
        self._fitted_at = 0
        self.last_seconds = 0.0

    @classmethod
    def from_cost_model(cls, cost) -> "StepTimeModel":
        """Seed from anything with the lab cost model's attributes (a `CostModel`; a term
        it lacks is 0). Only the runner's terms: the serving overhead around a step is
        measured by the policy itself (`SloPolicy.overhead_s`). Its token
        corrections (cost model v3) come along: their level is refitted online."""
        return cls({k: getattr(cost, k, 0.0) for k in COEFFICIENTS},
                   corrections=tuple(getattr(cost, "token_corrections", ()) or ()))

    # --- use --------------------------------------------------------------------------------
    @property
    def coefficients(self) -> dict[str, float]:
        th = self._fit()
        return {k: t / s for k, t, s in zip(COEFFICIENTS, th, _SCALE)}

    @property
    def correction_level(self) -> float:
        """The token corrections' fitted level (1.0: the seed's corrections as given; 0
        without corrections)."""
        return self._fit()[6] / self._corr_scale if self.corrections else 0.0

    @property
    def speed(self) -> float:
        """How many times the anchor's shape this machine's recent steps take (1.0 before any
        step): the one-parameter fit of the data to `shape` (see the module docstring)."""
        return self._speed_of(self._shape)

    def _speed_of(self, shape: list[float]) -> float:
        A, b = self._A, self._b
        num = sum(shape[i] * b[i] for i in range(_N))
        den = sum(shape[i] * shape[j] * A[min(i, j)][max(i, j)]
                  for i in range(_N) for j in range(_N))
        if den <= 0.0 or num <= 0.0:
            return 1.0
        lo, hi = SPEED_RANGE
        return min(max(num / den, lo), hi)

    def confidence(self) -> dict[str, float]:
        """Per coefficient, its decayed information in units of its own size (see
        CONFIDENT_INFO): how much the recent steps say about it, rather than the anchor."""
        th = self._fit()
        return {k: self._info[i] * th[i] ** 2 for i, k in enumerate(COEFFICIENTS)}

    def _corr(self, tokens: float) -> float:
        """The correction feature: corr_seed(tokens) over its scale (0 without corrections)."""
        knots = self.corrections
        return token_correction(knots, tokens) / self._corr_scale if knots else 0.0

    def predict(self, tokens: float, seqs: float, kv_tokens: float,
                prefill_tokens: float = 0.0, attn_pairs: float = 0.0) -> float:
        """Seconds a step with this shape is expected to take (an empty step: c0).

        Uses the fit as of the last refit, at most REFIT_EVERY observations old (the solve
        costs ~30 us; the memory is ~100 steps, so a few steps' lag changes nothing)."""
        th = self._theta if self._fresh() else self._fit()
        linear = (th[0] + th[1] * tokens / 256.0 + th[2] * seqs / 32.0
                  + th[3] * kv_tokens / 16384.0 + th[4] * prefill_tokens / 256.0
                  + th[5] * attn_pairs / 131072.0)
        if not self.corrections:
            return linear
        return max(linear + th[6] * self._corr(tokens), MIN_LINEAR_SHARE * linear)

    # --- learn ------------------------------------------------------------------------------
    def observe(self, tokens: float, seqs: float, kv_tokens: float, prefill_tokens: float,
                seconds: float, attn_pairs: float = 0.0) -> None:
        """Fold one measured step into the fit (ignored unless 0 < seconds < inf).
        `attn_pairs` comes after `seconds` so callers from before the term still work."""
        if not (seconds > 0.0 and seconds < math.inf) or seqs <= 0:
            return
        self.last_seconds = seconds
        # Weighted by 1 / seconds: each step contributes (theta . f / y - 1)^2, a relative
        # error. A residual beyond MAX_REL_RESIDUAL is shrunk by moving the target (Huber-like).
        inv = 1.0 / seconds
        x = (inv, tokens / 256.0 * inv, seqs / 32.0 * inv, kv_tokens / 16384.0 * inv,
             prefill_tokens / 256.0 * inv, attn_pairs / 131072.0 * inv,
             self._corr(tokens) * inv if self.corrections else 0.0)
        th = self._theta if self._fresh() else self._fit()
        pred = (th[0] * x[0] + th[1] * x[1] + th[2] * x[2] + th[3] * x[3] + th[4] * x[4]
                + th[5] * x[5] + th[6] * x[6])
        target = 1.0
        if self.num_observed >= TRUST_AFTER:          # the fit is data now, not the seed
            if pred - 1.0 > MAX_REL_RESIDUAL * 2:     # measured far below the prediction
                target = pred - MAX_REL_RESIDUAL * 2
            elif 1.0 - pred > MAX_REL_RESIDUAL:
                target = pred + MAX_REL_RESIDUAL      # an outlier step (GC pause, ...)
        lam = self.forgetting
        seen = self._seen
        for i in range(_N):
            if x[i] != 0.0:              # the correction feature has either sign
                seen[i] = True
        A, b = self._A, self._b
        for i in range(_N):
            Ai, xi = A[i], x[i]
            for j in range(i, _N):
                Ai[j] = Ai[j] * lam + xi * x[j]
            b[i] = b[i] * lam + xi * target
        self._dirty = True
        self.num_observed += 1

    def observe_many(self, steps: Iterable[tuple[float, ...]]) -> None:
        """Each step: (tokens, seqs, kv_tokens, prefill_tokens, seconds[, attn_pairs])."""
        for s in steps:
            self.observe(*s)

    def _fresh(self) -> bool:
        return not self._dirty or (self.num_observed - self._fitted_at < REFIT_EVERY
                                   and self._fitted_at > 0)

    def _fit(self) -> list[float]:
        """Minimise sum of weighted residuals + ridge to the seed, with theta >= 0."""
        if not self._dirty:
            return self._theta
        A0, b0, r = self._A, self._b, self._ridge
        speed = self.speed
        anchor = [speed * c for c in self._shape]
        # The pull to the anchor: a fixed part (for the first steps; in units of the anchor,
        # so it is worth the same at any speed) plus RIDGE_SHARE of the data's own
        # curvature, so it stays a fixed small share however much data there is.
        inv_s2 = 1.0 / (speed * speed)
        rr = [r[i] * inv_s2 + RIDGE_SHARE * A0[i][i] for i in range(_N)]
        A = [[A0[min(i, j)][max(i, j)] + (rr[i] if i == j else 0.0) for j in range(_N)]
             for i in range(_N)]
        b = [b0[i] + rr[i] * anchor[i] for i in range(_N)]
        free = list(range(_N))
        theta = [0.0] * _N
        while free:                      # active set: pin negative coefficients at 0
            try:
                sol = _solve(A, b, free)
            except ZeroDivisionError:
                return self._theta
            worst = min(range(len(free)), key=lambda k: sol[k])
            if sol[worst] >= 0.0:
                for k, i in enumerate(free):
                    theta[i] = sol[k]
                break
            del free[worst]              # pin the most negative at 0, one at a time
        # A term the recent steps determine becomes the anchor's shape (over the speed now),
        # so it keeps its measured ratio to the rest when its kind of step stops coming.
        # Only a term present in the steps since the last refit: while its data only decay,
        # its fitted value drifts with the other terms' changes (the old steps are
        # re-explained), and that drift must not become its shape.
        info = [A0[i][i] for i in range(_N)]
        seen = self._seen
        for i in range(_N):
            # A weak-prior term never measured (c_attn from an old seed) takes its shape
            # from the data whenever they excite it: its 0 was a blank, not a measurement.
            weak = self._unmeasured[i]
            if seen[i] and (weak or info[i] * max(theta[i], anchor[i]) ** 2 >= CONFIDENT_INFO):
                if weak and info[i] * theta[i] ** 2 >= CONFIDENT_INFO:
                    self._unmeasured[i] = False
                self._shape[i] = theta[i] / speed
            seen[i] = False
        self._info = info
        self._theta = theta
        self._dirty = False
        self._fitted_at = self.num_observed
        return theta

    def __repr__(self) -> str:
        c = ", ".join(f"{k}={v:.3g}" for k, v in self.coefficients.items())
        if self.corrections:
            c += f", corrections x{self.correction_level:.3g}"
        return f"StepTimeModel({c}, observed={self.num_observed})"

"""The cost model's fit: batch shapes, their features, and non-negative least squares.

A cost model (core/cost_model.py) is linear in a step's features plus a correction by its
token count; `iterserve lab calibrate` times the model runner on a grid of batch shapes
(`GridPoint`) and solves for the coefficients here, and `CostModel.linear_equivalent`
refits a model's linear terms to its own predictions with the same solver. Pure numpy, no
timing and no model: the same numbers in give the same fit out, on any machine.

- Non-negativity (Lawson-Hanson NNLS): a negative cost has no meaning and would let the lab
  produce negative step times outside the grid.
- Relative error (each row divided by its measured time): small decode steps, which
  dominate a real run, would otherwise be fitted badly to suit the few large prefill steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from iterserve.core.step_time import COEFFICIENTS, attention_pairs
from iterserve.errors import CalibrationError


@dataclass(frozen=True, slots=True)
class GridPoint:
    """One batch shape: `num_decodes` decode sequences with `decode_kv` tokens of context
    each, plus `prefill_tokens` prompt tokens split evenly over `prefill_chunks` prompts,
    each chunk starting after `prefill_context` tokens of its prompt already computed (a
    later chunk of a chunked prefill: it attends to that context too)."""

    num_decodes: int = 0
    decode_kv: int = 0
    prefill_tokens: int = 0
    prefill_chunks: int = 0
    prefill_context: int = 0

    def chunk_shapes(self) -> list[tuple[int, int]]:
        """(start, num_tokens) per chunk: decodes first, then the prefill chunks."""
        shapes = [(self.decode_kv, 1)] * self.num_decodes
        if self.prefill_chunks:
            base, extra = divmod(self.prefill_tokens, self.prefill_chunks)
            shapes += [(self.prefill_context, base + (1 if i < extra else 0))
                       for i in range(self.prefill_chunks)]
        return shapes

    def features(self) -> tuple[int, int, int, int, int]:
        """(tokens, seqs, kv_tokens_read, prefill_tokens, attn_pairs): the cost model's
        inputs, counted as the lab counts them (kv read = start + tokens computed, summed
        over chunks; attention pairs = `attention_pairs(start, tokens)`, summed over
        prefill chunks)."""
        shapes = self.chunk_shapes()
        pre = shapes[self.num_decodes:]
        return (sum(n for _, n in shapes), len(shapes), sum(s + n for s, n in shapes),
                self.prefill_tokens, sum(attention_pairs(s, n) for s, n in pre))

    def label(self) -> str:
        parts = []
        if self.num_decodes:
            parts.append(f"{self.num_decodes} decode @kv {self.decode_kv}")
        if self.prefill_chunks:
            ctx = f" @ctx {self.prefill_context}" if self.prefill_context else ""
            parts.append(f"{self.prefill_tokens} prefill in {self.prefill_chunks}{ctx}")
        return " + ".join(parts)


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if a.ndim != 2 or b.shape != (a.shape[0],):
        raise CalibrationError(f"nnls: shapes {a.shape} and {b.shape} do not match")
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(m, n) * max(1.0, float(np.abs(a).max(initial=0)))
    w = a.T @ (b - a @ x)
    for _ in range(max_iter or 3 * n + 10):
        if passive.all() or w[~passive].max() <= tol:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if s[passive].min() > 0:
                break
            neg = passive & (s <= 0)
            alpha = np.min(x[neg] / (x[neg] - s[neg]))
            x = x + alpha * (s - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = s
        w = a.T @ (b - a @ x)
    return x


def design_matrix(features: Sequence[Sequence[float]]) -> np.ndarray:
    """Rows [1, tokens, seqs, kv_tokens_read, prefill_tokens, attn_pairs], columns in
    COEFFICIENTS order (4-wide feature rows, from before attn_pairs, mean no pairs)."""
    f = np.asarray(features, dtype=float)
    f = f.reshape(len(features), -1) if len(features) else f.reshape(0, len(COEFFICIENTS) - 1)
    if f.shape[1] == len(COEFFICIENTS) - 2:
        f = np.column_stack([f, np.zeros(len(f))])
    if f.shape[1] != len(COEFFICIENTS) - 1:
        raise CalibrationError(f"feature rows must have {len(COEFFICIENTS) - 1} entries, "
                               f"got {f.shape[1]}")
    return np.column_stack([np.ones(len(f)), f])


def fit_coefficients(features: Sequence[Sequence[float]], seconds: Sequence[float]
                     ) -> dict[str, float]:
    """Non-negative least squares on relative error: each row (and its time) is divided by
    the measured time, and the columns are scaled to unit norm so their very different
    magnitudes (1 vs. thousands of KV tokens) do not upset the solver. A coefficient whose
    feature is zero in every row (no chunk with context on the grid) comes back 0."""
    y = np.asarray(seconds, dtype=float)
    if len(y) != len(features):
        raise CalibrationError(f"{len(features)} feature rows but {len(y)} timings")
    need = len(COEFFICIENTS) - 1        # c_attn is only fitted when the grid has chunks
    if len(y) < need:
        raise CalibrationError(f"need at least {need} timed points to fit "
                               f"the coefficients, got {len(y)}")
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise CalibrationError("timings must be positive finite seconds")
    x = design_matrix(features) / y[:, None]
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    coef = nnls(x / scale, np.ones(len(y))) / scale
    return {k: float(v) for k, v in zip(COEFFICIENTS, coef)}


CORRECTION_RIDGE = 0.1     # a 100% correction at a token count costs like a 10% residual


def correction_knots(max_rows: int, max_tokens: int) -> list[int]:
    """The token counts the corrections are read off at: every count up to 8 (the decode
    kernels work in groups of rows), a few up to `max_rows` (the decode kernels' row limit,
    `layers.QUANT_MAX_ROWS`) and just past it (the panel GEMM takes over), then doubling up
    to `max_tokens` (the grid's largest step)."""
    ks = set(range(1, 9)) | {12, 16, 24, max_rows, max_rows + 1}
    t = 64
    while t < max_tokens:
        ks.add(t)
        t *= 2
    ks.add(max_tokens)
    return sorted(k for k in ks if 1 <= k <= max_tokens)


def _hats(tokens: np.ndarray, knots: Sequence[int]) -> np.ndarray:
    """Columns of the piecewise-linear basis: corr(t) = hats(t) @ values (CostModel.correction)."""
    k = np.asarray(knots, dtype=float)
    h = np.zeros((len(tokens), len(k)))
    for r, t in enumerate(tokens):
        if t <= k[0]:
            h[r, 0] = 1.0
        elif t >= k[-1]:
            h[r, -1] = 1.0
        else:
            i = int(np.searchsorted(k, t, side="right"))
            w = (t - k[i - 1]) / (k[i] - k[i - 1])
            h[r, i - 1], h[r, i] = 1.0 - w, w
    return h


def fit_with_corrections(features: Sequence[Sequence[float]], seconds: Sequence[float],
                         knots: Sequence[int], ridge: float = CORRECTION_RIDGE
                         ) -> tuple[dict[str, float], tuple[tuple[int, float], ...]]:
    """The runner coefficients (non-negative) and a token-count correction (either sign),
    fitted together on relative error. Each correction value is split into a positive and a
    negative part (both non-negative, so the one NNLS solve does it) and pulled towards 0 by
    ridge rows scaled by the times measured near its token count: the linear terms explain
    what they can, the correction only the shape they cannot (kernel changes by row count)."""
    y = np.asarray(seconds, dtype=float)
    lin = design_matrix(features)
    if len(y) != len(lin):
        raise CalibrationError(f"{len(lin)} feature rows but {len(y)} timings")
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise CalibrationError("timings must be positive finite seconds")
    tokens = lin[:, 1]
    knots = sorted(set(int(k) for k in knots))
    h = _hats(tokens, knots)
    # The scale of a correction at each knot: the median time of the points nearest to it.
    ref = np.empty(len(knots))
    for j, k in enumerate(knots):
        d = np.abs(np.log(tokens / k))
        ref[j] = float(np.median(y[d <= d.min() + 1e-9]))
    a = np.column_stack([lin, h, -h]) / y[:, None]
    nl, nk = lin.shape[1], len(knots)
    reg = np.zeros((2 * nk, nl + 2 * nk))
    for j in range(nk):
        reg[j, nl + j] = ridge / ref[j]
        reg[nk + j, nl + nk + j] = ridge / ref[j]
    a = np.vstack([a, reg])
    b = np.concatenate([np.ones(len(y)), np.zeros(2 * nk)])
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    x = nnls(a / scale, b) / scale
    coef = {k: float(v) for k, v in zip(COEFFICIENTS, x[:nl])}
    values = x[nl:nl + nk] - x[nl + nk:]
    return coef, tuple((k, float(v)) for k, v in zip(knots, values))

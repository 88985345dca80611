"""Presets that follow the shipped fit: arrival rates and time targets in the fit's speed.

Why: the presets (lab/options.py PRESETS, lab/slo.py PRESET) are experiments at a load
factor ("Poisson arrivals at ~1.5x capacity", "TPOT <= 100 ms at a full batch that decodes
in ~230 ms"), but their numbers are absolute: requests per second and milliseconds, chosen
on a reference fit of the bundled model (`REFERENCE_FIT`). A re-fitted `smollm2-cpu` (a
faster machine, a faster runner, an attention term) runs the same steps in different
time, and the same absolute rate would be a different experiment (below capacity, nothing
to see). So the presets are rescaled when this module is imported: arrival rates are
multiplied, and time targets divided, by `speed()`, how much faster the shipped fit runs a
step typical of the preset than the reference fit did (1.0 while the reference is shipped,
so nothing changes then). Each preset says which step is typical of it: decodes at a full
batch (of its own `max_num_seqs`) for the short-prompt presets, decodes next to a chunk deep
into a long prompt for `longprompt`.

Why the full batch at the preset's own slot count: a v3 fit's token corrections make the
step time non-linear in the batch (on the bundled model 32 decodes cost more than 33, where
the decode kernels hand over to a faster GEMM), so a 16-decode step said the v3 fit was
2.7x the reference and a 64-decode step 5.0x; `slo-overload` (64 slots) scaled by the
16-decode step was below capacity (fcfs p99 TTFT 84 ms), not at 1.5x.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from iterserve.core.cost_model import CostModel, load_cost_model

SHIPPED = "smollm2-cpu"
# The smollm2-cpu fit the presets' numbers were chosen on (a linear fit, no attention term).
REFERENCE_FIT = {"c0": 0.007143531336648523, "c_tok": 0.0, "c_seq": 0.002729768769403647,
                 "c_kv": 4.139487218200215e-06, "c_prefill_tok": 0.0020727318917856917}
# (tokens, seqs, kv_tokens_read, prefill_tokens, attn_pairs) of a typical step:
def decode_step(seqs: int) -> tuple[int, int, int, int, int]:
    """A full batch of `seqs` decodes at 256 tokens of context."""
    return (seqs, seqs, seqs * 257, 0, 0)


DECODE_STEP = decode_step(16)                   # 16 decodes at 256 tokens
FULL_BATCH_STEP = decode_step(64)               # slo-overload's and lab/slo.py's full batch
# ... and 16 decodes next to a 128-token chunk 1,000 tokens into a long prompt.
LONGPROMPT_STEP = (16 + 128, 17, 16 * 257 + 1128, 128, 128 * 1128)
_REFERENCE = CostModel.from_dict(REFERENCE_FIT)
RATE_KEYS = ("arrival_rate_s",)
TIME_KEYS = ("slo_ttft_ms", "slo_tpot_ms")


@functools.lru_cache(maxsize=None)
def _shipped() -> CostModel:
    """The shipped fit, parsed once (every preset asks for it at import)."""
    return load_cost_model(SHIPPED)


def speed(step: tuple[int, ...] = FULL_BATCH_STEP, cost: CostModel | None = None) -> float:
    """How many times faster `cost` (default: the shipped smollm2-cpu) runs `step` than
    the reference fit."""
    cur = cost if cost is not None else _shipped()
    t = cur.step_time(*step)
    return _REFERENCE.step_time(*step) / t if t > 0 else 1.0


def _round(v: float) -> float:
    """Three significant digits (a rate of 7.26 reads better than 7.2600831)."""
    if v == 0 or not math.isfinite(v):
        return v
    return round(v, 2 - int(math.floor(math.log10(abs(v)))))


def scale_options(options: dict[str, Any], s: float) -> dict[str, Any]:
    """`options` with its arrival rates x s and its time targets / s (unchanged at s == 1)."""
    if s == 1.0:
        return dict(options)
    out = dict(options)
    for k in RATE_KEYS:
        if out.get(k) is not None:
            out[k] = _round(out[k] * s)
    for k in TIME_KEYS:
        if out.get(k) is not None:
            out[k] = _round(out[k] / s)
    return out

"""`iterserve lab calibrate`: fit the lab's step-time model to the real model runner.

The lab turns scheduler steps into seconds with a linear cost model (core/cost_model.py):

    step_s = c0 + c_tok*tokens + c_seq*seqs + c_kv*kv_tokens_read + c_prefill_tok*prefill_tokens
           + c_attn*attn_pairs + overhead_s + overhead_seq_s*seqs

This module measures what those coefficients are for one model on one machine. It builds
SchedulerOutputs by hand over a grid of batch shapes (decode-only steps of D sequences at KV
length L, prefill-only steps of P prompt tokens in one or more chunks, chunks that start deep
into a prompt (context C before them, so their attention reads C + P positions per query:
what `c_attn` prices), and mixed steps), times `ModelRunner.execute` on each (the same call
the engine makes, sampler included), takes the median of several repeats, and fits the six
runner coefficients by non-negative least squares (core/fit.py). Then it serves a short
batch of requests on the real engine (`LLMEngine.step`, the same model in the same process)
and fits the time per step outside `execute` (scheduling, output processing, detokenisation) as
`overhead_s + overhead_seq_s * seqs`. The same run's forward steps (shapes of `mix`: a few
decodes and a short prompt admitted now and then) set the level: the runner terms are scaled
by their measured execute time over the grid fit's prediction (`engine_scale`), because the
engine's steps, each a new shape after the scheduler ran, measured 8-16% slower than the
back-to-back grid said. Since version 3 the model also has a piecewise-linear correction by
the step's token count (`token_corrections`, fitted with the linear terms): the GEMMs change
kernel with the row count. The fit's error per grid point is reported, and the
result is written in the cost model's JSON format with a `source` block saying what it was
fitted on.

Why these choices:
- Decode steps need a KV history but not a *correct* one: a request whose prompt is L + 1
  tokens with `num_computed_tokens = L` makes the runner read L positions of (zeroed) K/V and
  compute one token, exactly the work of a real decode at that length, with no prefill first.
- Repeats are interleaved (every point once, then every point again, in a shuffled order),
  so a burst of load from elsewhere on a shared machine spreads over all points instead of
  skewing a few; the median drops the bursts that remain.
- The fit minimises *relative* error (each row divided by its measured time): small decode
  steps, which dominate a real run, would otherwise be fitted badly to suit the few large
  prefill steps.
- Non-negativity (Lawson-Hanson NNLS, numpy only): a negative cost has no meaning and would
  let the lab produce negative step times outside the grid.
- The model is loaded by building the engine (`LLMEngine.from_engine_args`), so the runner
  timed is configured exactly as the engine's (kernel activation mode, KV dtype), and the
  overhead run needs no second copy of the weights.
- `idle_step_s` is the fit's time of one decode step (at least c0): the lab advances its
  clock by it while nothing is scheduled (waiting for arrivals; the last empty step ends at
  the arrival itself), so it sets how many empty steps a gap counts.

torch is imported only when timing runs, so `iterserve lab` stays torch-free.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from iterserve import envs
from iterserve.core.cost_model import COEFFICIENTS, FORMAT, VERSION, CostModel
from iterserve.core.fit import (CORRECTION_RIDGE, GridPoint, correction_knots, design_matrix,
                                fit_coefficients, fit_with_corrections, nnls)
from iterserve.core.request import SamplingParams
from iterserve.core.scheduler_output import NewRequestData, SchedulerOutput
from iterserve.core.step_time import attention_pairs
from iterserve.engine.args import EngineArgs
from iterserve.engine.llm_engine import LLMEngine
from iterserve.errors import CalibrationError


def check_point(p: GridPoint) -> GridPoint:
    for name in ("num_decodes", "decode_kv", "prefill_tokens", "prefill_chunks",
                 "prefill_context"):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CalibrationError(f"grid point {p}: {name} must be a non-negative integer")
    if p.num_decodes and p.decode_kv < 1:
        raise CalibrationError(f"grid point {p}: decodes need decode_kv >= 1")
    if (p.prefill_tokens > 0) != (p.prefill_chunks > 0) or p.prefill_tokens < p.prefill_chunks:
        raise CalibrationError(f"grid point {p}: prefill_tokens must be >= prefill_chunks, "
                               "both zero or both positive")
    if p.prefill_context and not p.prefill_chunks:
        raise CalibrationError(f"grid point {p}: prefill_context without prefill chunks")
    if not (p.num_decodes or p.prefill_chunks):
        raise CalibrationError(f"grid point {p} schedules nothing")
    return p


def default_grid(quick: bool = False) -> list[GridPoint]:
    """The shapes timed. The full grid covers what the engine's defaults produce (up to 32
    sequences, a 256-token budget, decode contexts up to ~1k, prefill chunks at contexts up
    to 1.9k: the long-prompt presets' chunked prefills) and whole prompts up to 2k tokens
    (those presets with chunking off); --quick is a dozen points that still
    separate every coefficient (decodes at two context lengths, chunks at context 0 and deep
    into a prompt, one step of each kind mixed), for a big model on a small machine."""
    if quick:
        return [GridPoint(1, 32), GridPoint(4, 64), GridPoint(8, 64), GridPoint(4, 512),
                GridPoint(prefill_tokens=32, prefill_chunks=1),
                GridPoint(prefill_tokens=64, prefill_chunks=2),
                GridPoint(prefill_tokens=64, prefill_chunks=1, prefill_context=512),
                GridPoint(prefill_tokens=64, prefill_chunks=1, prefill_context=896),
                GridPoint(4, 64, prefill_tokens=32, prefill_chunks=1),
                GridPoint(4, 64, prefill_tokens=32, prefill_chunks=1, prefill_context=768),
                GridPoint(2, 64), GridPoint(prefill_tokens=16, prefill_chunks=1),
                GridPoint(7, 64, prefill_tokens=26, prefill_chunks=1)]
    grid = [GridPoint(d, kv) for d in (1, 2, 4, 8, 16, 32) for kv in (32, 256, 1024)]
    # Every decode batch up to 8 (the int8 decode kernels work in groups of rows, so 3 or 5
    # rows are not the mean of their neighbours) and two between 8 and 32.
    grid += [GridPoint(d, kv) for d in (3, 5, 6, 7) for kv in (32, 256)]
    grid += [GridPoint(d, 64) for d in (12, 24)]
    # What a full batch runs when one request finishes and the next is admitted: a few
    # decodes and one short prompt, on both sides of the decode kernels' row limit (32).
    grid += [GridPoint(7, 128, prefill_tokens=p, prefill_chunks=1) for p in (8, 17, 25, 26, 40)]
    grid += [GridPoint(1, 128, prefill_tokens=p, prefill_chunks=1) for p in (15, 32)]
    grid += [GridPoint(3, 128, prefill_tokens=20, prefill_chunks=1),
             GridPoint(prefill_tokens=192, prefill_chunks=8)]
    grid += [GridPoint(prefill_tokens=p, prefill_chunks=1) for p in (16, 64, 128, 256)]
    grid += [GridPoint(prefill_tokens=p, prefill_chunks=c) for p, c in ((64, 2), (128, 4),
                                                                          (256, 2))]
    grid += [GridPoint(d, 256, prefill_tokens=p, prefill_chunks=1)
             for d in (4, 8) for p in (32, 128)]
    grid += [GridPoint(8, kv, prefill_tokens=64, prefill_chunks=2) for kv in (64, 512)]
    # Chunks deep into a long prompt (what chunked prefill of a 2k-token prompt runs).
    grid += [GridPoint(prefill_tokens=p, prefill_chunks=1, prefill_context=c)
             for p in (64, 128, 256) for c in (512, 1536)]
    grid += [GridPoint(8, 256, prefill_tokens=128, prefill_chunks=1, prefill_context=c)
             for c in (768, 1536)]
    # What a 128-token budget runs next to a full batch of 16 at the end of a 2k prompt.
    grid += [GridPoint(16, 512, prefill_tokens=112, prefill_chunks=1, prefill_context=1888)]
    # Whole prompts up to 2k tokens (chunking off, or a budget above the prompt), alone and
    # next to 16 decodes: the token corrections are read off up to here, so a whole-prompt
    # step is priced from its own timing, not extrapolated from 256 tokens (where the
    # GEMMs run slower per token than at 2k).
    grid += [GridPoint(prefill_tokens=p, prefill_chunks=1) for p in (512, 1024, 2048)]
    grid += [GridPoint(16, 256, prefill_tokens=2000, prefill_chunks=1)]
    return grid


# --- fitting (core/fit.py solves; this reports how well) -----------------------------------

def fit_errors(coefficients: dict[str, float], features: Sequence[Sequence[float]],
               seconds: Sequence[float],
               corrections: Sequence[tuple[int, float]] = ()) -> list[float]:
    """Relative error (predicted - measured) / measured per point."""
    model = CostModel(token_corrections=tuple(corrections),
                      **{k: coefficients[k] for k in COEFFICIENTS})
    y = np.asarray(seconds, dtype=float)
    f = design_matrix(features)[:, 1:]
    pred = np.array([model.runner_time(*row) for row in f])
    return [float(e) for e in (pred - y) / y]


# --- timing --------------------------------------------------------------------------------

def _build_outputs(grid: Sequence[GridPoint], block_size: int, vocab: int):
    """One SchedulerOutput per grid point; the sequences of one point have disjoint block
    tables, and every point starts at block 0. Points are timed one at a time and the K/V
    they read need not be correct (module docstring), so they can share one pool region: the
    pool is the largest point's, not the sum of all points' (a 1.7B model's KV for the whole
    default grid would be ~35 GB in float32)."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    outputs, pool_blocks = [], 0
    for i, point in enumerate(grid):
        new, num = [], {}
        next_block = 0
        for j, (start, n) in enumerate(point.chunk_shapes()):
            length = start + n
            prompt = [rng.randrange(3, vocab) for _ in range(length)]
            blocks = -(-length // block_size)
            # Sent whole every time (as after a recompute preemption): the runner rebuilds
            # the request from the data, so the same output can be timed again and again.
            rid = f"cal-{i}-{j}"
            new.append(NewRequestData(rid, prompt, params,
                                      tuple(range(next_block, next_block + blocks)), start))
            num[rid] = n
            next_block += blocks
        outputs.append(SchedulerOutput(step=i, scheduled_new_reqs=new, num_scheduled_tokens=num,
                                       num_batched_tokens=sum(num.values())))
        pool_blocks = max(pool_blocks, next_block)
    return outputs, pool_blocks


def kv_tokens(p: GridPoint, block_size: int = 16) -> int:
    """KV slots a point's block tables take (each chunk's context in whole blocks)."""
    return sum(-(-(s + n) // block_size) * block_size for s, n in p.chunk_shapes())


def fit_grid_to_memory(grid: Sequence[GridPoint], bytes_per_token: int, budget_bytes: int,
                       block_size: int = 16) -> tuple[list[GridPoint], list[GridPoint]]:
    """(kept, dropped): the points whose KV fits `budget_bytes` at `bytes_per_token`. A big
    model's KV per token is ~10x the bundled model's, so the default grid's largest points
    (32 sequences x 1k tokens) do not fit a small machine; the fit uses the rest."""
    kept = [p for p in grid if kv_tokens(p, block_size) * bytes_per_token <= budget_bytes]
    return kept, [p for p in grid if p not in kept]


def time_grid(loaded, grid: Sequence[GridPoint], *, repeats: int = 5, block_size: int = 16,
              seed: int = 0, progress: Callable[[str], None] | None = None
              ) -> list[list[float]]:
    """Seconds of `ModelRunner.execute` per grid point, `repeats` each (after one untimed
    warm-up pass), interleaved across points in a shuffled order per round."""
    from iterserve.model.runner import ModelRunner  # torch: only when timing runs

    outputs, num_blocks = _build_outputs(grid, block_size, loaded.config.vocab_size)
    runner = ModelRunner(loaded, num_blocks=max(1, num_blocks), block_size=block_size)
    order = list(range(len(grid)))
    for out in outputs:                          # warm-up: allocator, first-call paths
        runner.execute(out)
    times: list[list[float]] = [[] for _ in grid]
    rng = random.Random(seed)
    for r in range(repeats):
        rng.shuffle(order)
        for i in order:
            t = time.perf_counter()
            runner.execute(outputs[i])
            times[i].append(time.perf_counter() - t)
        if progress:
            progress(f"round {r + 1}/{repeats} done")
    return times


def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass
class CalibrationResult:
    cost_model: CostModel
    points: list[dict[str, Any]]        # per point: shape, features, median_s, predicted_s, rel_error
    mean_abs_rel_error: float
    max_abs_rel_error: float
    source: dict[str, Any]
    # the engine run's forward steps: (tokens, seqs, kv read, prefill tokens, attention
    # pairs, execute seconds), what engine_scale compared the grid's fit with
    engine_steps: list[tuple[int, int, int, int, int, float]] | None = None

    def to_json(self) -> dict[str, Any]:
        d = self.cost_model.to_dict()
        d["source"] = {**self.source, "points": self.points}
        return d


DEFAULT_KV_BUDGET_GIB = 2.0


OVERHEAD_REQUESTS = 24          # the engine run: 24 requests on 8 slots ...
OVERHEAD_SLOTS = 8
OVERHEAD_PROMPT = (8, 40)       # ... of 8-40-token prompts and 8-48 output tokens each (the
OVERHEAD_OUTPUT = (8, 48)       # shapes of `mix`: a few decodes, one short prompt admitted)
ENGINE_SCALE_RANGE = (0.5, 2.0)  # the engine-run level correction is clipped to this


class _ExecuteTimer:
    """Wraps the engine's executor: per forward step, the cost model's inputs (counted as the
    lab counts them) and `execute`'s time."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.last: tuple[int, float] | None = None
        self.steps: list[tuple[int, int, int, int, int, float]] = []

    def execute(self, output):
        t = time.perf_counter()
        try:
            return self.inner.execute(output)
        finally:
            dt = time.perf_counter() - t
            sched = output.num_scheduled_tokens
            n = len(sched)
            self.last = (n, dt) if n else None
            if n:
                data = output.scheduled_new_reqs + output.scheduled_cached_reqs
                plen = {rid: len(st.prompt_token_ids)
                        for rid, st in getattr(self.inner, "requests", {}).items()}
                chunks = [d for d in data if sched[d.req_id] > 1
                          or d.num_computed_tokens < plen.get(d.req_id, 0)]
                self.steps.append((
                    sum(sched.values()), n,
                    sum(d.num_computed_tokens + sched[d.req_id] for d in data),
                    sum(sched[d.req_id] for d in chunks),
                    sum(attention_pairs(d.num_computed_tokens, sched[d.req_id])
                        for d in chunks), dt))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def engine_scale(cost: CostModel, steps: Sequence[tuple[int, int, int, int, int, float]]
                 ) -> float | None:
    """How much longer the engine's own steps took than the grid's fit says (measured
    execute time over predicted, a time-weighted median over the steps), clipped to
    ENGINE_SCALE_RANGE;
    None without steps. The grid times one step shape at a time, back to back; in the
    engine every step is a new shape after the scheduler and the output processing ran,
    and on the CPU those steps measured 8-16% slower than the grid said."""
    pairs = sorted((s[5] / p, p) for s in steps if (p := cost.runner_time(*s[:5])) > 0
                   and s[5] > 0)
    if not pairs:
        return None
    # The median of measured / predicted weighted by the predicted time: each step counts
    # by its share of the run (as the total would), but one burst of load from elsewhere
    # during a few steps cannot move it as far as it moves the total.
    half, acc, ratio = sum(p for _, p in pairs) / 2, 0.0, pairs[-1][0]
    for r, p in pairs:
        acc += p
        if acc >= half:
            ratio = r
            break
    lo, hi = ENGINE_SCALE_RANGE
    return min(hi, max(lo, ratio))


def scaled(coef: dict[str, float], corrections: Sequence[tuple[int, float]], factor: float
           ) -> tuple[dict[str, float], tuple[tuple[int, float], ...]]:
    """The runner terms times `factor` (every runner prediction scales by it)."""
    return ({k: v * factor for k, v in coef.items()},
            tuple((t, v * factor) for t, v in corrections))


def fit_overhead(samples: Sequence[tuple[int, float]]) -> dict[str, float]:
    """overhead_s + overhead_seq_s * seqs from (seqs, seconds outside execute) per step:
    the median per batch size (one GC pause must not set the price), then non-negative
    least squares over the batch sizes (a single batch size gives a per-step cost only)."""
    by: dict[int, list[float]] = {}
    for n, o in samples:
        if n > 0 and o >= 0 and np.isfinite(o):
            by.setdefault(int(n), []).append(float(o))
    if not by:
        return {"overhead_s": 0.0, "overhead_seq_s": 0.0}
    ns = sorted(by)
    med = np.array([statistics.median(by[n]) for n in ns])
    if len(ns) == 1:
        return {"overhead_s": float(med[0]), "overhead_seq_s": 0.0}
    w = np.sqrt([len(by[n]) for n in ns])          # a batch size seen often counts more
    a = np.column_stack([np.ones(len(ns)), ns]) * w[:, None]
    o0, o1 = nnls(a, med * w)
    return {"overhead_s": float(o0), "overhead_seq_s": float(o1)}


def _draw(rng: random.Random, spec: int | tuple[int, int]) -> int:
    return spec if isinstance(spec, int) else rng.randint(*spec)


def measure_overhead(engine, *, num_requests: int = OVERHEAD_REQUESTS,
                     prompt_tokens: int | tuple[int, int] = OVERHEAD_PROMPT,
                     output_tokens: int | tuple[int, int] = OVERHEAD_OUTPUT,
                     seed: int = 0) -> tuple[dict[str, float], list[tuple[int, float]],
                                             list[tuple[int, int, int, int, int, float]]]:
    """Serve `num_requests` short requests (random token prompts, ignore_eos; lengths drawn
    from the (lo, hi) ranges) on `engine` and return (the fitted overhead terms, per step
    (seqs, seconds outside execute), per step the cost model's inputs and execute's
    seconds). A step's time is the loop iteration that ran it (`engine.step()` and the loop
    itself), so what a caller of the offline engine waits for between two forward passes is
    counted."""
    rng = random.Random(seed)
    vocab = engine.vocab_size
    timer = _ExecuteTimer(engine.executor)
    engine.executor = timer
    samples: list[tuple[int, float]] = []
    try:
        for i in range(num_requests):
            params = SamplingParams(temperature=0.0, max_tokens=_draw(rng, output_tokens),
                                    ignore_eos=True)
            engine.add_request(f"cal-overhead-{i}",
                               [rng.randrange(3, vocab)
                                for _ in range(_draw(rng, prompt_tokens))], params)
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            timer.last = None
            engine.step()
            now = time.perf_counter()
            if timer.last is not None:
                n, ex = timer.last
                samples.append((n, max(0.0, now - t - ex)))
            t = now
    finally:
        engine.executor = timer.inner
    return fit_overhead(samples), samples, timer.steps


def calibrate(model: str | None = None, *, quick: bool = False, repeats: int | None = None,
              grid: Sequence[GridPoint] | None = None, block_size: int = 16,
              kv_budget_gib: float = DEFAULT_KV_BUDGET_GIB, overhead: bool = True,
              corrections: bool = True, scale_to_engine: bool = True,
              progress: Callable[[str], None] | None = None) -> CalibrationResult:
    """Load the model (by building the engine), time the grid, fit; then, unless
    `overhead` is False, measure the serving overhead on a short engine run. `model` None is
    the bundled default. Grid points whose KV would exceed `kv_budget_gib` are left out (and
    listed in the source block)."""
    if repeats is None:
        repeats = 3 if quick else 7
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise CalibrationError(f"repeats must be a positive integer, got {repeats!r}")
    if block_size < 1:
        raise CalibrationError(f"block_size must be at least 1, got {block_size}")
    grid_name = ("quick" if quick else "default") if grid is None else "custom"
    grid = [check_point(p) for p in (default_grid(quick) if grid is None else grid)]
    if len(grid) < len(COEFFICIENTS):
        raise CalibrationError(f"the grid needs at least {len(COEFFICIENTS)} points")
    if not kv_budget_gib > 0:
        raise CalibrationError(f"kv_budget_gib must be positive, got {kv_budget_gib!r}")

    import torch

    from iterserve.model.runner import ModelRunner  # torch: only when timing runs

    t_load = time.perf_counter()
    # The engine's own KV pool only serves the overhead run (16 short requests); the grid
    # gets a runner of its own over the same weights.
    pool = -(-(OVERHEAD_PROMPT[1] + OVERHEAD_OUTPUT[1]) // block_size) * OVERHEAD_REQUESTS + 8
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, max_num_seqs=OVERHEAD_SLOTS, num_kv_blocks=pool, block_size=block_size))
    loaded = engine.loaded_model
    load_s = time.perf_counter() - t_load
    per_token = ModelRunner.kv_cache_bytes_per_block(loaded.config, block_size) // block_size
    grid, dropped = fit_grid_to_memory(grid, per_token, int(kv_budget_gib * (1 << 30)),
                                       block_size)
    if len(grid) < len(COEFFICIENTS):
        raise CalibrationError(
            f"only {len(grid)} grid points fit a {kv_budget_gib:g} GiB KV budget at "
            f"{per_token} bytes per token; the fit needs {len(COEFFICIENTS)}: raise "
            "--kv-budget-gib")
    if dropped and progress:
        progress(f"{len(dropped)} grid points left out (KV over {kv_budget_gib:g} GiB): "
                 + ", ".join(p.label() for p in dropped))
    limit = loaded.config.max_position_embeddings
    if limit:           # a short-context model: leave out the points it cannot hold
        too_long = [p for p in grid if max(s + n for s, n in p.chunk_shapes()) > limit]
        if too_long:
            grid = [p for p in grid if p not in too_long]
            dropped += too_long
            if progress:
                progress(f"{len(too_long)} grid points left out (context over the model's "
                         f"{limit}): " + ", ".join(p.label() for p in too_long))
        if len(grid) < len(COEFFICIENTS):
            raise CalibrationError(f"only {len(grid)} grid points fit the model's "
                                   f"{limit}-token context; the fit needs {len(COEFFICIENTS)}")
    load_before = load_average()
    t0 = time.perf_counter()
    times = time_grid(loaded, grid, repeats=repeats, block_size=block_size, progress=progress)
    elapsed = time.perf_counter() - t0
    over = {"overhead_s": 0.0, "overhead_seq_s": 0.0}
    over_samples: list[tuple[int, float]] = []
    engine_steps: list[tuple[int, int, int, int, int, float]] = []
    if overhead:
        t1 = time.perf_counter()
        over, over_samples, engine_steps = measure_overhead(engine)
        if progress:
            progress(f"serving overhead: {len(over_samples)} engine steps in "
                     f"{time.perf_counter() - t1:.1f} s")
    elapsed_all = time.perf_counter() - t0
    load_after = load_average()

    feats = [p.features() for p in grid]
    medians = [statistics.median(t) for t in times]
    knots: list[int] = []
    if corrections:
        from iterserve.model import layers  # torch: only when timing runs
        max_rows = int(getattr(layers, "QUANT_MAX_ROWS", 32))
        knots = correction_knots(max_rows, max(f[0] for f in feats))
        coef, corr = fit_with_corrections(feats, medians, knots)
    else:
        coef, corr = fit_coefficients(feats, medians), ()
    errors = fit_errors(coef, feats, medians, corr)
    # The grid gives the shape, the engine's own steps the level (see engine_scale).
    factor = None
    if engine_steps:
        factor = engine_scale(CostModel(token_corrections=tuple(corr), **coef), engine_steps)
    if factor is not None and scale_to_engine:
        coef, corr = scaled(coef, corr, factor)
    abs_err = [abs(e) for e in errors]
    mean_err, max_err = sum(abs_err) / len(abs_err), max(abs_err)
    points = []
    for p, f, med, t, e in zip(grid, feats, medians, times, errors):
        points.append({"shape": asdict(p), "label": p.label(),
                       "tokens": f[0], "seqs": f[1], "kv_tokens_read": f[2],
                       "prefill_tokens": f[3], "attn_pairs": f[4], "median_s": round(med, 6),
                       "min_s": round(min(t), 6), "max_s": round(max(t), 6),
                       "predicted_s": round(med * (1 + e), 6), "rel_error": round(e, 4)})
    scale_info: dict[str, Any] | str = "no engine run (--no-overhead)"
    if engine_steps:
        scale_info = {"engine_steps": len(engine_steps),
                      "measured_execute_s": round(sum(s[5] for s in engine_steps), 4),
                      "factor": round(factor, 4) if factor is not None else None,
                      "applied": bool(scale_to_engine and factor is not None),
                      "note": "runner terms x factor: grid fit error is before it"}
    model_name = (Path(model).name if model else
                  "SmolLM2-135M-Instruct.Q4_1.gguf (bundled default)")
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    from iterserve.model import kernels  # torch: only when timing runs
    machine = (f"{_cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
               f"({torch.get_num_threads()} threads), {loaded.config.dtype}")
    source = {
        "tool": "iterserve lab calibrate", "model": model_name, "machine": machine,
        "date": date, "grid": grid_name,
        "num_points": len(grid), "repeats": repeats, "statistic": "median",
        "block_size": block_size, "timing_s": round(elapsed, 1),
        "total_s": round(elapsed_all + load_s, 1), "load_s": round(load_s, 1),
        "kernel_activations": _activation_mode(kernels),
        "omp_wait_policy": envs.OMP_WAIT_POLICY,
        "kv_budget_gib": kv_budget_gib, "dropped_points": [p.label() for p in dropped],
        "load_average_before": load_before, "load_average_after": load_after,
        "fit": "non-negative least squares on relative error"
               + (f", token corrections at {knots} (ridge {CORRECTION_RIDGE})"
                  if corrections else ", no token corrections"),
        "mean_abs_rel_error": round(mean_err, 4), "max_abs_rel_error": round(max_err, 4),
        "engine_scale": scale_info,
        "overhead": ({"engine_steps": len(over_samples), "requests": OVERHEAD_REQUESTS,
                      "slots": OVERHEAD_SLOTS, "prompt_tokens": OVERHEAD_PROMPT,
                      "output_tokens": OVERHEAD_OUTPUT,
                      "median_ms": round(1e3 * statistics.median(o for _, o in over_samples), 4)
                      if over_samples else None,
                      "fit": "median per batch size, then non-negative least squares"}
                     if overhead else "not measured (--no-overhead)"),
    }
    over_txt = (f"; serving overhead {over['overhead_s'] * 1e3:.2f} ms + "
                f"{over['overhead_seq_s'] * 1e3:.3f} ms/seq per step" if overhead else "")
    description = (f"Fitted by `iterserve lab calibrate` to ModelRunner.execute of {model_name} "
                   f"on {machine}, {date}: {len(grid)} batch shapes x {repeats} repeats "
                   f"(median), fit error mean {mean_err:.1%} / max {max_err:.1%}"
                   + (f", x{factor:.3f} to the engine's own {len(engine_steps)} steps"
                      if factor is not None and scale_to_engine else "")
                   + f"{over_txt}; "
                   f"1-min load average {load_before[0] if load_before else '?'} before.")
    # The lab's clock step while nothing runs: the cheapest real step (one decode), not c0,
    # which a fit with corrections may leave at 0.
    idle = CostModel(token_corrections=tuple(corr), **coef).runner_time(1, 1, 33)
    cost = CostModel.from_dict({"format": FORMAT, "version": VERSION,
                                "description": description, **coef, **over,
                                "idle_step_s": max(idle, coef["c0"]),
                                "token_corrections": [list(c) for c in corr]})
    del engine
    return CalibrationResult(cost, points, mean_err, max_err, source, engine_steps)


def _activation_mode(kernels) -> str | None:
    try:
        return kernels.activations()
    except Exception:       # noqa: BLE001 - reporting only
        return None


def format_report(res: CalibrationResult) -> str:
    lines = [f"{'shape':46} {'median ms':>10} {'fit ms':>8} {'error':>7}"]
    for p in res.points:
        lines.append(f"{p['label']:46} {p['median_s'] * 1e3:>10.2f} "
                     f"{p['predicted_s'] * 1e3:>8.2f} {p['rel_error']:>+7.1%}")
    c = res.cost_model
    lines += ["", f"c0 = {c.c0:.4g} s   c_tok = {c.c_tok:.4g} s   c_seq = {c.c_seq:.4g} s   "
                  f"c_kv = {c.c_kv:.4g} s   c_prefill_tok = {c.c_prefill_tok:.4g} s   "
                  f"c_attn = {c.c_attn:.4g} s",
              "token corrections (tokens: ms): " + (", ".join(
                  f"{t}: {v * 1e3:+.2f}" for t, v in c.token_corrections) or "none"),
              f"serving overhead per step: {c.overhead_s * 1e3:.3f} ms + "
              f"{c.overhead_seq_s * 1e3:.4f} ms per sequence",
              f"fit error over {len(res.points)} points: mean {res.mean_abs_rel_error:.1%}, "
              f"max {res.max_abs_rel_error:.1%}",
              "engine steps vs the grid's fit: " + (
                  f"x{es['factor']:.3f} over {es['engine_steps']} steps"
                  + (" (applied)" if es["applied"] else " (not applied)")
                  if isinstance(es := res.source.get("engine_scale"), dict)
                  and es.get("factor") is not None else "not measured"),
              f"load average before/after: {res.source['load_average_before']} / "
              f"{res.source['load_average_after']}"]
    return "\n".join(lines)


# --- command line --------------------------------------------------------------------------

def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate", help="fit the lab's cost model to the real model runner",
        description="Time ModelRunner.execute over a grid of batch shapes and fit the lab's "
                    "linear step-time model (non-negative least squares); write it as a cost "
                    "model JSON usable with `iterserve lab --cost-model FILE`.")
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: the bundled SmolLM2)")
    p.add_argument("--out", metavar="FILE", default=None,
                   help="write the fitted cost model here (default: print it)")
    p.add_argument("--quick", action="store_true", help="a tiny grid and 3 repeats (tests)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs per grid point (default 7, --quick 3)")
    p.add_argument("--no-overhead", action="store_true",
                   help="skip the short engine run that measures the serving overhead per "
                        "step (overhead_s / overhead_seq_s stay 0: runner time only)")
    p.add_argument("--no-corrections", action="store_true",
                   help="fit the linear terms only (no piecewise correction by the step's "
                        "token count; the version-2 model)")
    p.add_argument("--no-engine-scale", action="store_true",
                   help="keep the grid's level: do not scale the runner terms to the "
                        "engine run's own steps (measured / predicted execute time)")
    p.add_argument("--kv-budget-gib", type=float, default=DEFAULT_KV_BUDGET_GIB,
                   help="leave out grid points whose KV cache would exceed this (default "
                        f"{DEFAULT_KV_BUDGET_GIB:g}; big models need it)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    def err(msg: str) -> int:
        print(f"iterserve lab calibrate: error: {msg}", file=sys.stderr)
        return 2

    if args.repeats is not None and args.repeats < 1:
        return err(f"--repeats must be at least 1, got {args.repeats}")
    if not args.kv_budget_gib > 0:
        return err(f"--kv-budget-gib must be positive, got {args.kv_budget_gib}")
    if args.out is not None:
        parent = Path(args.out).expanduser().resolve().parent
        if not parent.is_dir():
            return err(f"--out: directory {str(parent)!r} does not exist")
    try:
        res = calibrate(args.model, quick=args.quick, repeats=args.repeats,
                        kv_budget_gib=args.kv_budget_gib, overhead=not args.no_overhead,
                        corrections=not args.no_corrections,
                        scale_to_engine=not args.no_engine_scale,
                        progress=lambda m: print(m, file=sys.stderr, flush=True))
    except (CalibrationError, ValueError, FileNotFoundError) as e:   # ModelLoadError too
        return err(str(e))
    print(format_report(res), file=sys.stderr)
    text = json.dumps(res.to_json(), indent=2) + "\n"
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.out).expanduser().write_text(text, encoding="utf-8")
    except OSError as e:
        return err(f"cannot write {args.out}: {e.strerror or e}")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0

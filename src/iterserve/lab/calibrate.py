"""`iterserve lab calibrate`: fit the lab's step-time model to the real model runner.

The lab turns scheduler steps into seconds with a linear cost model (lab/cost_model.py):

    step_s = c0 + c_tok*tokens + c_seq*seqs + c_kv*kv_tokens_read + c_prefill_tok*prefill_tokens

This module measures what those coefficients are for one model on one machine. It builds
SchedulerOutputs by hand over a grid of batch shapes (decode-only steps of D sequences at KV
length L, prefill-only steps of P prompt tokens in one or two chunks, and mixed steps),
times `ModelRunner.execute` on each (the same call the engine makes, sampler included),
takes the median of several repeats, and fits the five coefficients by non-negative least
squares. The fit's error per grid point is reported, and the result is written in the cost
model's JSON format with a `source` block saying what it was fitted on.

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
- `idle_step_s` is left to default to c0: the lab advances its clock by it while nothing is
  scheduled (waiting for arrivals), so it is the lab's time resolution between arrivals.

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

from iterserve.lab.cost_model import COEFFICIENTS, FORMAT, VERSION, CostModel


class CalibrationError(ValueError):
    """Bad calibration input (options, grid, timings); the message says which."""


@dataclass(frozen=True, slots=True)
class GridPoint:
    """One batch shape: `num_decodes` decode sequences with `decode_kv` tokens of context
    each, plus `prefill_tokens` prompt tokens split evenly over `prefill_chunks` new prompts."""

    num_decodes: int = 0
    decode_kv: int = 0
    prefill_tokens: int = 0
    prefill_chunks: int = 0

    def chunk_shapes(self) -> list[tuple[int, int]]:
        """(start, num_tokens) per chunk: decodes first, then the prefill chunks."""
        shapes = [(self.decode_kv, 1)] * self.num_decodes
        if self.prefill_chunks:
            base, extra = divmod(self.prefill_tokens, self.prefill_chunks)
            shapes += [(0, base + (1 if i < extra else 0)) for i in range(self.prefill_chunks)]
        return shapes

    def features(self) -> tuple[int, int, int, int]:
        """(tokens, seqs, kv_tokens_read, prefill_tokens): the cost model's inputs, counted
        as the lab counts them (kv read = start + tokens computed, summed over chunks)."""
        shapes = self.chunk_shapes()
        return (sum(n for _, n in shapes), len(shapes), sum(s + n for s, n in shapes),
                self.prefill_tokens)

    def label(self) -> str:
        parts = []
        if self.num_decodes:
            parts.append(f"{self.num_decodes} decode @kv {self.decode_kv}")
        if self.prefill_chunks:
            parts.append(f"{self.prefill_tokens} prefill in {self.prefill_chunks}")
        return " + ".join(parts)


def check_point(p: GridPoint) -> GridPoint:
    for name in ("num_decodes", "decode_kv", "prefill_tokens", "prefill_chunks"):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CalibrationError(f"grid point {p}: {name} must be a non-negative integer")
    if p.num_decodes and p.decode_kv < 1:
        raise CalibrationError(f"grid point {p}: decodes need decode_kv >= 1")
    if (p.prefill_tokens > 0) != (p.prefill_chunks > 0) or p.prefill_tokens < p.prefill_chunks:
        raise CalibrationError(f"grid point {p}: prefill_tokens must be >= prefill_chunks, "
                               "both zero or both positive")
    if not (p.num_decodes or p.prefill_chunks):
        raise CalibrationError(f"grid point {p} schedules nothing")
    return p


def default_grid(quick: bool = False) -> list[GridPoint]:
    """The shapes timed. The full grid covers what the engine's defaults produce (up to 32
    sequences, a 256-token budget, contexts up to ~1k); --quick is a handful of points."""
    if quick:
        return [GridPoint(1, 16), GridPoint(4, 64), GridPoint(2, 32),
                GridPoint(prefill_tokens=16, prefill_chunks=1),
                GridPoint(prefill_tokens=32, prefill_chunks=2),
                GridPoint(2, 16, prefill_tokens=16, prefill_chunks=1)]
    grid = [GridPoint(d, kv) for d in (1, 2, 4, 8, 16, 32) for kv in (32, 256, 1024)]
    grid += [GridPoint(prefill_tokens=p, prefill_chunks=1) for p in (16, 64, 128, 256)]
    grid += [GridPoint(prefill_tokens=p, prefill_chunks=c) for p, c in ((64, 2), (128, 4),
                                                                          (256, 2))]
    grid += [GridPoint(d, 256, prefill_tokens=p, prefill_chunks=1)
             for d in (4, 8) for p in (32, 128)]
    grid += [GridPoint(8, kv, prefill_tokens=64, prefill_chunks=2) for kv in (64, 512)]
    return grid


# --- fitting -------------------------------------------------------------------------------

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
    """Rows [1, tokens, seqs, kv_tokens_read, prefill_tokens], columns in COEFFICIENTS order."""
    f = np.asarray(features, dtype=float).reshape(len(features), 4)
    return np.column_stack([np.ones(len(f)), f])


def fit_coefficients(features: Sequence[Sequence[float]], seconds: Sequence[float]
                     ) -> dict[str, float]:
    """Non-negative least squares on relative error: each row (and its time) is divided by
    the measured time, and the columns are scaled to unit norm so their very different
    magnitudes (1 vs. thousands of KV tokens) do not upset the solver."""
    y = np.asarray(seconds, dtype=float)
    if len(y) != len(features):
        raise CalibrationError(f"{len(features)} feature rows but {len(y)} timings")
    if len(y) < len(COEFFICIENTS):
        raise CalibrationError(f"need at least {len(COEFFICIENTS)} timed points to fit "
                               f"{len(COEFFICIENTS)} coefficients, got {len(y)}")
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise CalibrationError("timings must be positive finite seconds")
    x = design_matrix(features) / y[:, None]
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    coef = nnls(x / scale, np.ones(len(y))) / scale
    return {k: float(v) for k, v in zip(COEFFICIENTS, coef)}


def fit_errors(coefficients: dict[str, float], features: Sequence[Sequence[float]],
               seconds: Sequence[float]) -> list[float]:
    """Relative error (predicted - measured) / measured per point."""
    coef = np.array([coefficients[k] for k in COEFFICIENTS])
    pred = design_matrix(features) @ coef
    y = np.asarray(seconds, dtype=float)
    return [float(e) for e in (pred - y) / y]


# --- timing --------------------------------------------------------------------------------

def _build_outputs(grid: Sequence[GridPoint], block_size: int, vocab: int):
    """One SchedulerOutput per grid point; the sequences of one point have disjoint block
    tables, and every point starts at block 0. Points are timed one at a time and the K/V
    they read need not be correct (module docstring), so they can share one pool region: the
    pool is the largest point's, not the sum of all points' (a 1.7B model's KV for the whole
    default grid would be ~35 GB in float32)."""
    from iterserve.core.request import SamplingParams
    from iterserve.core.scheduler_output import NewRequestData, SchedulerOutput

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
    from iterserve.model.runner import ModelRunner

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

    def to_json(self) -> dict[str, Any]:
        d = self.cost_model.to_dict()
        d["source"] = {**self.source, "points": self.points}
        return d


DEFAULT_KV_BUDGET_GIB = 2.0


def calibrate(model: str | None = None, *, quick: bool = False, repeats: int | None = None,
              grid: Sequence[GridPoint] | None = None, block_size: int = 16,
              kv_budget_gib: float = DEFAULT_KV_BUDGET_GIB,
              progress: Callable[[str], None] | None = None) -> CalibrationResult:
    """Load the model, time the grid, fit; `model` None is the bundled default. Grid points
    whose KV would exceed `kv_budget_gib` are left out (and listed in the source block)."""
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

    from iterserve.model.loader import load_model
    from iterserve.model.runner import ModelRunner

    loaded = load_model(model)
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
    longest = max(max(s + n for s, n in p.chunk_shapes()) for p in grid)
    if limit and longest > limit:
        raise CalibrationError(f"the grid needs {longest}-token contexts; the model allows {limit}")
    load_before = load_average()
    t0 = time.perf_counter()
    times = time_grid(loaded, grid, repeats=repeats, block_size=block_size, progress=progress)
    elapsed = time.perf_counter() - t0
    load_after = load_average()

    feats = [p.features() for p in grid]
    medians = [statistics.median(t) for t in times]
    coef = fit_coefficients(feats, medians)
    errors = fit_errors(coef, feats, medians)
    abs_err = [abs(e) for e in errors]
    mean_err, max_err = sum(abs_err) / len(abs_err), max(abs_err)
    points = []
    for p, f, med, t, e in zip(grid, feats, medians, times, errors):
        points.append({"shape": asdict(p), "label": p.label(),
                       "tokens": f[0], "seqs": f[1], "kv_tokens_read": f[2],
                       "prefill_tokens": f[3], "median_s": round(med, 6),
                       "min_s": round(min(t), 6), "max_s": round(max(t), 6),
                       "predicted_s": round(med * (1 + e), 6), "rel_error": round(e, 4)})
    model_name = (Path(model).name if model else
                  "SmolLM2-135M-Instruct.Q4_1.gguf (bundled default)")
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (f"{_cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
               f"({torch.get_num_threads()} threads), {loaded.config.dtype}")
    source = {
        "tool": "iterserve lab calibrate", "model": model_name, "machine": machine,
        "date": date, "grid": grid_name,
        "num_points": len(grid), "repeats": repeats, "statistic": "median",
        "block_size": block_size, "timing_s": round(elapsed, 1),
        "kv_budget_gib": kv_budget_gib, "dropped_points": [p.label() for p in dropped],
        "load_average_before": load_before, "load_average_after": load_after,
        "fit": "non-negative least squares on relative error",
        "mean_abs_rel_error": round(mean_err, 4), "max_abs_rel_error": round(max_err, 4),
    }
    description = (f"Fitted by `iterserve lab calibrate` to ModelRunner.execute of {model_name} "
                   f"on {machine}, {date}: {len(grid)} batch shapes x {repeats} repeats "
                   f"(median), fit error mean {mean_err:.1%} / max {max_err:.1%}; "
                   f"1-min load average {load_before[0] if load_before else '?'} before.")
    cost = CostModel.from_dict({"format": FORMAT, "version": VERSION,
                                "description": description, **coef})
    return CalibrationResult(cost, points, mean_err, max_err, source)


def format_report(res: CalibrationResult) -> str:
    lines = [f"{'shape':38} {'median ms':>10} {'fit ms':>8} {'error':>7}"]
    for p in res.points:
        lines.append(f"{p['label']:38} {p['median_s'] * 1e3:>10.2f} "
                     f"{p['predicted_s'] * 1e3:>8.2f} {p['rel_error']:>+7.1%}")
    c = res.cost_model
    lines += ["", f"c0 = {c.c0:.4g} s   c_tok = {c.c_tok:.4g} s   c_seq = {c.c_seq:.4g} s   "
                  f"c_kv = {c.c_kv:.4g} s   c_prefill_tok = {c.c_prefill_tok:.4g} s",
              f"fit error over {len(res.points)} points: mean {res.mean_abs_rel_error:.1%}, "
              f"max {res.max_abs_rel_error:.1%}",
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
                        kv_budget_gib=args.kv_budget_gib, progress=lambda m: print(m, file=sys.stderr, flush=True))
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

"""The scheduling trade-offs on the real engine, and the lab's error against it, per metric.

The lab presets `longprompt`, `priority-flood` and `kv-pressure` (lab/options.py PRESETS) are
run on `iterserve serve` (bundled model, real HTTP, the bench client) with the *same*
requests (`slo_workloads.py`: the lab's own seeded draw turned into prompts of exactly that
many tokens, ignore_eos) and the same scheduler/cache flags, and the lab simulates those
requests with a cost model fitted to this machine at the start (`iterserve lab calibrate`'s
grid, ~15-40 s). The presets' arrival rates are set for the shipped `smollm2-cpu` fit; they
are scaled by how much faster this machine's fit runs a reference step (16 decodes at 256
tokens of context), so each preset is at the same load factor here as in the lab.

First, the cost model's blind spot for `longprompt`: the lab's step time is linear in the
step's tokens, and a chunk's attention is charged as one read of its context, not one per
query token. A handful of steps with long prefills (2,000-token prompts, 64-512-token chunks
at context 1,500, next to 16 decodes) are timed on the model runner and compared with the
linear fit (`step_shapes`): the ratio real / lab says how much the lab understates a long
prefill's stall (and so the gain of chunking).

Cases (bounded; the request counts keep the whole run within ~8 min on a quiet 2-core
machine): longprompt with chunked prefill off and on at budgets 128, 256 and 512, and budget
512 with a 256-token long-prefill threshold, 2 partial prefills of which 1 long
(`max_long_partial_prefills`); longprompt-heavy (the stall-heavy variant, 70% long prompts;
run it alone with `--presets longprompt-heavy`, ~8-9 min quiet) with chunking off and
budgets 64 / 128 / 256 / 512, budget 256 with a 32-token threshold, budget 512 with a
256-token threshold and budget 384 with a 320-token one (2 partial / 1 long each), and budget
512 / threshold 256 with the long prompts' chunks capped at 256 per step together
(`max_long_prefill_tokens`); priority-flood under priority, under priority with the less
urgent class capped at 4 tokens per step while the urgent one is active
(`priority_less_urgent_tokens`), and fcfs, plus the interactive class alone (same server);
kv-pressure with recompute and swap. Per case: real and lab throughput, p99 ITL, p99 TTFT
overall and per class (interactive / batch, or long / short prompts; p99 latency for
kv-pressure), and lab / real - 1 for each. The `targets` block at the end states the
targets against these numbers (real and lab): the best chunked setting's p99 ITL gain and
throughput cost against chunking off, and the interactive p99 TTFT over its value alone.

Note on the lab's TTFT: the lab measures it from the start of the first step after the
arrival, so it does not see the wait for the step in flight when a request arrives (up to
one whole step); on the real engine that wait is most of the priority flood's extra TTFT
(benchmarks/slo_engine_priority_trace.py splits it up).

p99.9 and max ITL are reported next to p99 (a stall that is under 1% of the gaps shows
there and not at p99). `--repeats N` runs a preset's cases N times in ABBA order and pairs
each chunked case with chunking off of the same repeat (under load only same-run ratios
mean something); `--cases` runs a subset.

    PYTHONPATH=src .venv/bin/python benchmarks/slo_engine_tradeoffs.py
        [--presets longprompt,longprompt-heavy,priority-flood,kv-pressure] [--requests-scale 1.0]
        [--repeats 1] [--cases 'off,budget 64'] [--port 18620]
        [--out benchmarks/results/tradeoffs-engine.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import slo_engine  # noqa: E402
from slo_workloads import bench_workload, plan, preset_options, serve_args  # noqa: E402

import iterserve.bench.client as bench_client  # noqa: E402
from iterserve.bench.client import ClientOptions, machine_info, run_workload  # noqa: E402
from iterserve.bench.metrics import SLO  # noqa: E402
from iterserve.core.cost_model import load_cost_model  # noqa: E402
from iterserve.core.step_time import attention_pairs  # noqa: E402
from iterserve.lab.api import LONGPROMPT_SHORT, run_lab  # noqa: E402
# The one definition of the preset rate scale and its reference step: lab_vs_engine.py.
from lab_vs_engine import rate_scale as preset_rate_scale  # noqa: E402

# (preset, case name, option overrides, requests)
CASES: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "longprompt": [
        ("chunking off", {"enable_chunked_prefill": False, "max_num_batched_tokens": None}),
        ("chunked, budget 128", {"max_num_batched_tokens": 128}),
        ("chunked, budget 256", {"max_num_batched_tokens": 256}),
        ("chunked, budget 512", {"max_num_batched_tokens": 512}),
        ("chunked, budget 512, threshold 256, 2 partial / 1 long",
         {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 256,
          "max_num_partial_prefills": 2, "max_long_partial_prefills": 1}),
    ],
    # The stall-heavy variant (lab/options.py says why `longprompt` does not show the gain):
    # every budget from 64 to 512, and the long-prefill threshold with the partial-prefill cap.
    "longprompt-heavy": [
        ("chunking off", {"enable_chunked_prefill": False, "max_num_batched_tokens": None}),
        ("chunked, budget 64", {"max_num_batched_tokens": 64}),
        ("chunked, budget 128", {"max_num_batched_tokens": 128}),
        ("chunked, budget 256", {"max_num_batched_tokens": 256}),
        ("chunked, budget 512", {"max_num_batched_tokens": 512}),
        # The cheapest chunk step: a long prompt's chunk capped at 32 tokens, the rest of
        # the budget for the decodes and a short prompt alongside (the lab's best p99).
        ("chunked, budget 256, threshold 32, 2 partial / 1 long",
         {"max_num_batched_tokens": 256, "long_prefill_token_threshold": 32,
          "max_num_partial_prefills": 2, "max_long_partial_prefills": 1}),
        # A long prompt's chunk capped by the threshold, a larger budget around
        # it for the decodes and a short prompt (no short prompt waits behind a long one's
        # whole chunked prefill; fewer, larger steps than budget 128). The lab's p99 ITL
        # gains for these are 3.8-4.5x (budget 512 alone: 3.1x; real 2.4x).
        ("chunked, budget 512, threshold 256, 2 partial / 1 long",
         {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 256,
          "max_num_partial_prefills": 2, "max_long_partial_prefills": 1}),
        ("chunked, budget 384, threshold 320, 2 partial / 1 long",
         {"max_num_batched_tokens": 384, "long_prefill_token_threshold": 320,
          "max_num_partial_prefills": 2, "max_long_partial_prefills": 1}),
        # ... and the long prompts' chunks capped at 256 per step together
        # (max_long_prefill_tokens): the step that ends one long prefill starts the next
        # with what is left of the 256, not with a whole second chunk.
        ("chunked, budget 512, threshold 256, long cap 256, 2 partial / 1 long",
         {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 256,
          "max_long_prefill_tokens": 256,
          "max_num_partial_prefills": 2, "max_long_partial_prefills": 1}),
    ],
    "priority-flood": [
        ("priority", {"scheduling_policy": "priority"}),
        ("priority, less urgent <= 4 tokens/step", {"scheduling_policy": "priority",
                                                    "priority_less_urgent_tokens": 4}),
        ("fcfs", {"scheduling_policy": "fcfs"}),
    ],
    "kv-pressure": [
        ("recompute", {"preemption_mode": "recompute"}),
        ("swap", {"preemption_mode": "swap"}),
    ],
}
REQUESTS = {"longprompt": 32, "longprompt-heavy": 64, "priority-flood": 80, "kv-pressure": 48}
LONGPROMPT_PRESETS = ("longprompt", "longprompt-heavy")

# The priority of each request the bench client sends (it has no field for it).
_PRIORITIES: dict[int, int] = {}
_orig_payload = bench_client._payload


def _payload(req, model, opts):
    body = _orig_payload(req, model, opts)
    if req.index in _PRIORITIES:
        body["priority"] = _PRIORITIES[req.index]
    return body


bench_client._payload = _payload


def step_shapes(cost) -> list[dict[str, Any]]:
    """Long-prefill steps timed on the model runner vs the linear cost model."""
    import random

    from iterserve.core.request import SamplingParams
    from iterserve.core.scheduler_output import NewRequestData, SchedulerOutput
    from iterserve.model.loader import load_model
    from iterserve.model.runner import ModelRunner

    dec = [(256, 1)] * 16
    shapes = {"16 decodes @256": dec,
              "16 decodes + 128-token chunk @0": dec + [(0, 128)],
              "16 decodes + 128-token chunk @1500": dec + [(1500, 128)],
              "16 decodes + 512-token chunk @1500": dec + [(1500, 512)],
              "16 decodes + 2000-token prefill": dec + [(0, 2000)],
              "2000-token prefill": [(0, 2000)]}
    loaded = load_model(None)
    rng, bs = random.Random(0), 16
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    outs, nb = [], 0
    for i, (name, sh) in enumerate(shapes.items()):
        new, num = [], {}
        for j, (s, n) in enumerate(sh):
            length = s + n
            rid = f"s{i}-{j}"
            blocks = -(-length // bs)
            new.append(NewRequestData(rid, [rng.randrange(3, 1000) for _ in range(length)],
                                      params, tuple(range(nb, nb + blocks)), s))
            num[rid] = n
            nb += blocks
        outs.append((name, sh, SchedulerOutput(step=i, scheduled_new_reqs=new,
                                               num_scheduled_tokens=num,
                                               num_batched_tokens=sum(num.values()))))
    runner = ModelRunner(loaded, num_blocks=nb, block_size=bs)
    for _, _, o in outs:
        runner.execute(o)
    times: dict[str, list[float]] = {name: [] for name, _, _ in outs}
    for _ in range(3):
        for name, _, o in outs:
            t = time.perf_counter()
            runner.execute(o)
            times[name].append(time.perf_counter() - t)
    rows = []
    for name, sh, _ in outs:
        tok = sum(n for _, n in sh)
        pre = sum(n for _, n in sh if n > 1)
        pred = cost.step_time(tok, len(sh), sum(s + n for s, n in sh), pre,
                              sum(attention_pairs(s, n) for s, n in sh if n > 1))
        real = statistics.median(times[name])
        rows.append({"shape": name, "real_s": real, "lab_s": pred, "real_over_lab": real / pred})
        print(f"  {name:36s} real {real * 1e3:8.1f} ms, lab {pred * 1e3:8.1f} ms "
              f"(real/lab {real / pred:.2f})", flush=True)
    return rows


def _p99(values: list[float]) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))] if values else None


def _pct(values, q: float) -> float | None:
    """numpy's default (linear) percentile, as the lab's and the bench client's."""
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def itl_tail(gaps) -> dict[str, Any]:
    """p99.9 and max inter-token gap, and how many gaps (the stall shows there first)."""
    return {"p999_itl_s": _pct(gaps, 99.9), "max_itl_s": float(max(gaps)) if len(gaps) else None,
            "itl_count": len(gaps)}


def real_metrics(res: dict[str, Any], priorities: dict[int, int],
                 long_idx: set[int] = frozenset()) -> dict[str, Any]:
    s = res["summary"]
    done = [r for r in res["requests"] if r.get("ttft") is not None]
    ms = lambda v: None if v is None else v / 1e3  # noqa: E731
    gaps = [g for r in res["requests"] if r.get("success") for g in r.get("itl") or ()]
    out = {"throughput_tokens_per_s": s["output_throughput"],
           "p99_itl_s": ms(s["itl"]["p99_ms"]), **itl_tail(gaps),
           "p99_ttft_s": ms(s["ttft"]["p99_ms"]),
           "p99_latency_s": ms(s["e2e"]["p99_ms"]) if "e2e" in s else None,
           "p99_ttft_s_urgent": _p99([r["ttft"] for r in done
                                      if priorities.get(r["index"]) == 0]),
           "p99_ttft_s_normal": _p99([r["ttft"] for r in done
                                      if priorities.get(r["index"], 0) != 0]),
           "failed": s["failed"]}
    if priorities:      # the classes' own output throughput (what the cap costs the batch)
        dur = s.get("duration_s") or 0.0
        for cls, keep in (("urgent", lambda p: p == 0), ("normal", lambda p: p != 0)):
            tok = sum(r.get("output_tokens") or 0 for r in done
                      if keep(priorities.get(r["index"], 0)))
            out[f"throughput_tokens_per_s_{cls}"] = tok / dur if dur else None
    if long_idx:
        out["p99_ttft_s_long"] = _p99([r["ttft"] for r in done if r["index"] in long_idx])
        out["p99_ttft_s_short"] = _p99([r["ttft"] for r in done if r["index"] not in long_idx])
    return out


LAB_KEYS = ("throughput_tokens_per_s", "p99_itl_s", "p999_itl_s", "max_itl_s", "p99_ttft_s",
            "p99_latency_s", "p99_ttft_s_urgent", "p99_ttft_s_normal")


def lab_run(opts: dict[str, Any]) -> dict[str, Any]:
    """run_lab's continuous ModeResult plus p99.9 / max ITL from the simulated token gaps."""
    from iterserve.lab.api import plan_lab, simulate_plan
    from iterserve.lab.metrics import summarize

    p = plan_lab(opts)
    res = simulate_plan(p)["continuous"]
    out = summarize(res)
    if res.itl_prev is not None:
        S = res.step_start_s
        out.update(itl_tail(list(S[res.itl_next] - S[res.itl_prev])))
    return out


def run_case(args, preset: str, name: str, over: dict[str, Any], cost, rate_scale: float,
             port: int) -> dict[str, Any]:
    opts: dict[str, Any] = {"requests": max(4, round(REQUESTS[preset] * args.requests_scale)),
                            **over}
    base = plan(preset, **opts)
    rate = base.workload.arrival_rate_s
    if rate is not None:
        opts["arrival_rate_s"] = rate * rate_scale
    p = plan(preset, **opts)
    w = bench_workload(p, preset)
    classes = w.extra["priorities"] if preset == "priority-flood" else {}
    # The long *prompts* (the bench request's `kind` is the lab's long-output class).
    long_idx = ({r.index for r in w.requests if r.prompt_len > LONGPROMPT_SHORT[1]}
                if preset in LONGPROMPT_PRESETS else set())
    _PRIORITIES.clear()
    if over.get("scheduling_policy") == "priority":    # a fcfs server refuses the field
        _PRIORITIES.update(classes)
    lab_opts = {**preset_options(preset, **opts), "cost_model": cost, "batching": "continuous"}
    lab = lab_run(lab_opts)
    srv = slo_engine.Server(port, serve_args(p), args, f"{preset}-{port}")
    try:
        srv.wait_ready()
        slo_engine.warm_up(srv.url, args)
        res = asyncio.run(run_workload(srv.url, w, ClientOptions(
            request_timeout_s=args.request_timeout_s), SLO()))
        real = real_metrics(res, classes, long_idx)
        extra = {}
        if preset == "priority-flood" and over.get("scheduling_policy") == "priority" \
                and any(v == 0 for v in classes.values()):
            # The interactive class alone: its requests at their arrival times, nothing else.
            alone = type(w)(w.name, w.seed, w.rate, tuple(
                r for r in w.requests if classes.get(r.index) == 0), w.description, w.extra)
            ra = asyncio.run(run_workload(srv.url, alone, ClientOptions(
                request_timeout_s=args.request_timeout_s), SLO()))
            extra["alone_p99_ttft_s_urgent"] = real_metrics(ra, classes)["p99_ttft_s_urgent"]
            la = run_lab({**lab_opts, "priority_frac": 1.0,
                          "requests": len(alone.requests),
                          "arrival_rate_s": (opts.get("arrival_rate_s") or 1.0)
                          * len(alone.requests) / len(w.requests)})["continuous"]
            extra["lab_alone_p99_ttft_s_urgent"] = la["p99_ttft_s"]
    finally:
        srv.stop()
    lab_m = {k: lab.get(k) for k in LAB_KEYS}
    err = {k: (lab_m[k] / real[k] - 1 if lab_m.get(k) and real.get(k) else None)
           for k in LAB_KEYS}
    row = {"preset": preset, "case": name, "options": {k: v for k, v in opts.items()},
           "serve_flags": serve_args(p), "real": real, "lab": lab_m, "lab_error": err, **extra}
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"  {preset} / {name}: " + ", ".join(
        f"{k} real {fmt(real.get(k))} lab {fmt(lab_m.get(k))} ({'-' if err[k] is None else f'{err[k]:+.0%}'})"
        for k in LAB_KEYS if real.get(k) is not None), flush=True)
    return row


def chunking_target(cases: list[dict[str, Any]], preset: str) -> dict[str, Any]:
    """Each chunked case against chunking off of the same repeat (same-run ratios: under
    load only these mean something), medians over the repeats, real and lab."""
    import statistics as st

    rows_by: dict[str, dict[str, list[float]]] = {}
    cs = [c for c in cases if c["preset"] == preset]
    offs = {c.get("repeat", 0): c for c in cs if c["case"] == "chunking off"}
    for c in cs:
        off = offs.get(c.get("repeat", 0))
        if off is None or c is off:
            continue
        acc = rows_by.setdefault(c["case"], {})
        for src in ("real", "lab"):
            a, b = off[src], c[src]
            for key, name in (("p99_itl_s", "p99_itl_gain"), ("p999_itl_s", "p999_itl_gain"),
                              ("max_itl_s", "max_itl_gain")):
                if a.get(key) and b.get(key):
                    acc.setdefault(f"{src}_{name}", []).append(a[key] / b[key])
            if a.get("throughput_tokens_per_s") and b.get("throughput_tokens_per_s"):
                acc.setdefault(f"{src}_throughput_cost", []).append(
                    1 - b["throughput_tokens_per_s"] / a["throughput_tokens_per_s"])
    rows = []
    for name, acc in rows_by.items():
        row: dict[str, Any] = {"case": name}
        for k, v in acc.items():
            row[k] = st.median(v)
            if len(v) > 1:
                row[k + "_per_repeat"] = v
        rows.append(row)
    # Best: the cheapest setting that gains 3x (it meets the target if any does), else the
    # largest gain.
    ok = [r for r in rows if r.get("real_p99_itl_gain", 0) >= 3]
    best = (min(ok, key=lambda r: r.get("real_throughput_cost", 1)) if ok else
            max(rows, key=lambda r: r.get("real_p99_itl_gain", 0)) if rows else None)
    return {"target": "p99 ITL gain >= 3x at <= 5% throughput cost (chunked vs off, "
                      "same repeat; medians over repeats)",
            "repeats": len(offs), "cases": rows, "best": best,
            "met": bool(best and best.get("real_p99_itl_gain", 0) >= 3
                        and best.get("real_throughput_cost", 1) <= 0.05)}


def targets(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The trade-off targets against this run's numbers, real and lab."""
    out: dict[str, Any] = {}
    by = {(c["preset"], c["case"]): c for c in cases if not c.get("repeat")}
    for preset in LONGPROMPT_PRESETS:
        if any(c["preset"] == preset for c in cases):
            out[preset] = chunking_target(cases, preset)
    pf = [c for c in cases if c["preset"] == "priority-flood"
          and c.get("alone_p99_ttft_s_urgent")]
    if pf:
        base = by.get(("priority-flood", "priority"))
        rows = []
        for c in pf:
            r, alone = c["real"], c["alone_p99_ttft_s_urgent"]
            row = {"case": c["case"], "real_ratio": r["p99_ttft_s_urgent"] / alone,
                   "real_p99_ttft_s_urgent": r["p99_ttft_s_urgent"], "real_alone": alone}
            la, lu = c.get("lab_alone_p99_ttft_s_urgent"), c["lab"].get("p99_ttft_s_urgent")
            if la and lu:
                row["lab_ratio"] = lu / la
            if base is not None and base is not c:
                bt, ct = (base["real"].get("throughput_tokens_per_s_normal"),
                          c["real"].get("throughput_tokens_per_s_normal"))
                if bt and ct:
                    row["real_batch_throughput_vs_priority"] = ct / bt
            rows.append(row)
        fc = by.get(("priority-flood", "fcfs"))
        out["priority-flood"] = {
            "target": "interactive p99 TTFT under priority <= 1.2x its value alone",
            "cases": rows, "met": any(r["real_ratio"] <= 1.2 for r in rows),
            "fcfs_p99_ttft_s_urgent": fc["real"]["p99_ttft_s_urgent"] if fc else None}
    return out


def select_cases(cases: list[tuple[str, dict[str, Any]]], spec: str | None
                 ) -> list[tuple[str, dict[str, Any]]]:
    """`--cases`: comma-separated parts; a part equal to a case's whole name selects that
    case alone, any other part every case whose name contains it ("budget 256" also
    matches "chunked, budget 256, threshold 32, ..."; "chunked, budget 256" is only that)."""
    if not spec:
        return list(cases)
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    names = {n for n, _ in cases}
    # a whole name has commas of its own: rejoin the parts that make one up
    exact, loose, i = set(), [], 0
    while i < len(parts):
        for j in range(len(parts), i, -1):
            if ", ".join(parts[i:j]) in names:
                exact.add(", ".join(parts[i:j]))
                i = j
                break
        else:
            loose.append(parts[i])
            i += 1
    return [(n, o) for n, o in cases if n in exact or any(p in n for p in loose)]


def main() -> None:
    slo_engine.stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="longprompt,priority-flood,kv-pressure")
    ap.add_argument("--requests-scale", type=float, default=1.0)
    ap.add_argument("--no-shapes", action="store_true", help="skip the long-prefill steps")
    ap.add_argument("--cost-model", help="skip the calibration: use this fit (file or name)")
    ap.add_argument("--chunk-cost", action="store_true",
                    help="also time what chunking a 2000-token prompt adds on the model "
                         "runner (slo_chunk_cost.py; ~1 min quiet)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each preset's cases this many times, the order reversed every "
                         "other time (ABBA: same-run ratios under load); targets pair each "
                         "chunked case with chunking off of the same repeat")
    ap.add_argument("--cases", help="only the cases whose name contains one of these "
                                    "comma-separated strings (e.g. 'off,budget 64'); a "
                                    "whole case name selects only that case")
    ap.add_argument("--port", type=int, default=18620)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--serve-arg", action="append", help=argparse.SUPPRESS)
    ap.add_argument("--request-timeout-s", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--out", default="benchmarks/results/tradeoffs-engine.json")
    args = ap.parse_args()
    t0 = time.time()
    with open("/proc/loadavg") as fh:
        load_before = fh.read().split()[:3]
    if args.cost_model:
        cost = load_cost_model(args.cost_model)
        cal_source = args.cost_model
    else:
        from iterserve.lab.calibrate import calibrate

        print("calibrating the lab's cost model on this machine ...", flush=True)
        cal = calibrate(None)
        cost = cal.cost_model
        cal_source = {"mean_abs_rel_error": cal.mean_abs_rel_error,
                      "max_abs_rel_error": cal.max_abs_rel_error, **cal.cost_model.to_dict()}
    rate_scale = preset_rate_scale(cost)
    print(f"this machine runs the reference step {rate_scale:.2f}x as fast as the shipped "
          f"smollm2-cpu fit: preset rates x {rate_scale:.2f}", flush=True)
    doc: dict[str, Any] = {"benchmark": "slo_engine_tradeoffs", "machine": machine_info(),
                           "loadavg_before": load_before, "cost_model": cal_source,
                           "rate_scale": rate_scale, "cases": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.no_shapes:
        print("long-prefill steps, model runner vs the lab's linear cost model:", flush=True)
        doc["step_shapes"] = step_shapes(cost)
    if args.chunk_cost:
        import slo_chunk_cost

        print("chunking one long prompt, model runner (slo_chunk_cost.py's plans):", flush=True)
        doc["chunk_cost"] = slo_chunk_cost.measure(3, [], [], [128, 256, 512], 16, 2000)
        out.write_text(json.dumps(doc, indent=2) + "\n")
    port = args.port
    for preset in [p.strip() for p in args.presets.split(",") if p.strip()]:
        t_p = time.time()
        cases = select_cases(CASES[preset], args.cases)
        for r in range(args.repeats):
            for name, over in (cases if r % 2 == 0 else cases[::-1]):
                row = run_case(args, preset, name, over, cost, rate_scale, port)
                if args.repeats > 1:
                    row["repeat"] = r
                doc["cases"].append(row)
                port += 1
                out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"  ({preset}: {time.time() - t_p:.0f} s)", flush=True)
    doc["targets"] = targets(doc["cases"])
    print(json.dumps(doc["targets"], indent=1), flush=True)
    with open("/proc/loadavg") as fh:
        doc["loadavg_after"] = fh.read().split()[:3]
    doc["wall_s"] = time.time() - t0
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out} ({doc['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()

"""Issue 18's trade-offs on the real engine, and the lab's error against it, per metric.

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

Cases (bounded; the request counts keep each preset within ~3 min on a quiet 2-core
machine): longprompt with chunked prefill off and on at budgets 128 and 512; priority-flood
under priority and fcfs, plus the interactive class alone; kv-pressure with recompute and
swap. Per case: real and lab throughput, p99 ITL, p99 TTFT (and the interactive class's
p99 TTFT; p99 latency for kv-pressure), and lab / real - 1 for each.

    PYTHONPATH=src .venv/bin/python benchmarks/slo_engine_tradeoffs.py
        [--presets longprompt,priority-flood,kv-pressure] [--requests-scale 1.0]
        [--port 18620] [--out benchmarks/results/slo-engine-tradeoffs.json]
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
from iterserve.lab.api import run_lab  # noqa: E402
from iterserve.lab.cost_model import load_cost_model  # noqa: E402

REFERENCE_STEP = (16, 16, 16 * 257, 0)       # 16 decodes at 256 tokens of context

# (preset, case name, option overrides, requests)
CASES: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "longprompt": [
        ("chunking off", {"enable_chunked_prefill": False, "max_num_batched_tokens": None}),
        ("chunked, budget 128", {"max_num_batched_tokens": 128}),
        ("chunked, budget 512", {"max_num_batched_tokens": 512}),
    ],
    "priority-flood": [
        ("priority", {"scheduling_policy": "priority"}),
        ("fcfs", {"scheduling_policy": "fcfs"}),
    ],
    "kv-pressure": [
        ("recompute", {"preemption_mode": "recompute"}),
        ("swap", {"preemption_mode": "swap"}),
    ],
}
REQUESTS = {"longprompt": 40, "priority-flood": 80, "kv-pressure": 48}

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
                              sum(n * (s + n) for s, n in sh if n > 1))
        real = statistics.median(times[name])
        rows.append({"shape": name, "real_s": real, "lab_s": pred, "real_over_lab": real / pred})
        print(f"  {name:36s} real {real * 1e3:8.1f} ms, lab {pred * 1e3:8.1f} ms "
              f"(real/lab {real / pred:.2f})", flush=True)
    return rows


def real_metrics(res: dict[str, Any], priorities: dict[int, int]) -> dict[str, Any]:
    s = res["summary"]
    urgent = [r["ttft"] for r in res["requests"]
              if priorities.get(r["index"]) == 0 and r.get("ttft") is not None]
    urgent.sort()
    p99 = urgent[min(len(urgent) - 1, int(0.99 * len(urgent)))] if urgent else None
    ms = lambda v: None if v is None else v / 1e3  # noqa: E731
    return {"throughput_tokens_per_s": s["output_throughput"],
            "p99_itl_s": ms(s["itl"]["p99_ms"]), "p99_ttft_s": ms(s["ttft"]["p99_ms"]),
            "p99_latency_s": ms(s["e2e"]["p99_ms"]) if "e2e" in s else None,
            "p99_ttft_s_urgent": p99, "failed": s["failed"]}


LAB_KEYS = ("throughput_tokens_per_s", "p99_itl_s", "p99_ttft_s", "p99_latency_s",
            "p99_ttft_s_urgent")


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
    _PRIORITIES.clear()
    if over.get("scheduling_policy") == "priority":    # a fcfs server refuses the field
        _PRIORITIES.update(classes)
    lab_opts = {**preset_options(preset, **opts), "cost_model": cost, "batching": "continuous"}
    lab = run_lab(lab_opts)["continuous"]
    srv = slo_engine.Server(port, serve_args(p), args, f"{preset}-{port}")
    try:
        srv.wait_ready()
        slo_engine.warm_up(srv.url, args)
        res = asyncio.run(run_workload(srv.url, w, ClientOptions(
            request_timeout_s=args.request_timeout_s), SLO()))
        real = real_metrics(res, classes)
        extra = {}
        if preset == "priority-flood" and name == "priority":
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


def main() -> None:
    slo_engine.stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="longprompt,priority-flood,kv-pressure")
    ap.add_argument("--requests-scale", type=float, default=1.0)
    ap.add_argument("--no-shapes", action="store_true", help="skip the long-prefill steps")
    ap.add_argument("--cost-model", help="skip the calibration: use this fit (file or name)")
    ap.add_argument("--port", type=int, default=18620)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--serve-arg", action="append", help=argparse.SUPPRESS)
    ap.add_argument("--request-timeout-s", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--out", default="benchmarks/results/slo-engine-tradeoffs.json")
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
    shipped = load_cost_model("smollm2-cpu")
    rate_scale = shipped.step_time(*REFERENCE_STEP) / cost.step_time(*REFERENCE_STEP)
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
    port = args.port
    for preset in [p.strip() for p in args.presets.split(",") if p.strip()]:
        t_p = time.time()
        for name, over in CASES[preset]:
            doc["cases"].append(run_case(args, preset, name, over, cost, rate_scale, port))
            port += 1
            out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"  ({preset}: {time.time() - t_p:.0f} s)", flush=True)
    with open("/proc/loadavg") as fh:
        doc["loadavg_after"] = fh.read().split()[:3]
    doc["wall_s"] = time.time() - t0
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out} ({doc['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()

"""The scheduling trade-offs in the lab: chunked prefill, priority flood, recompute vs swap.

Each section starts from a lab preset (`iterserve.lab.options.PRESETS`, the same a user picks
on the /lab page or with `iterserve lab --preset NAME`) and sweeps the knob the trade-off is
about. Everything is simulated time on the shipped `smollm2-cpu` cost model (the bundled
model on the reference CPU), so the numbers are the same on any machine; `--seeds` repeats
each case over several workload draws and reports medians.

- longprompt: chunked prefill off, and on x token budget 64 / 128 / 256 / 512 x long-prefill
  threshold (none, budget / 2) x partial-prefill cap (1, 2). p99 inter-token latency on the
  preset's Poisson arrivals; throughput from the same requests all at t=0 (what the knobs
  sustain, not what arrives). Target: the best chunked setting lowers p99 ITL >= 3x against
  chunking off at <= 5% throughput cost.
- longprompt-heavy: the same sweep on the stall-heavy variant (half the prompts long, ~0.85x
  capacity), where chunking off's stalls are more than 1% of the gaps; per seed, also the
  stall share (gaps over 0.5 s with chunking off) and the best setting's gain, since p99 sees
  the stall only above a 1% share (`stall_share` below).
- priority flood: the interactive class's p99 TTFT under policy priority and under fcfs,
  against its value alone (the same class's share of requests and of the arrival rate,
  without the batch class). Target: priority <= 1.2x alone.
- kv pressure: recompute vs swap, throughput and p99 latency (the lab charges no time for a
  swap copy: its swap numbers are a best case).

    PYTHONPATH=src .venv/bin/python benchmarks/slo_tradeoffs.py [--seeds 3]
        [--sections longprompt,longprompt-heavy,priority-flood,kv-pressure]
        [--out benchmarks/results/tradeoffs-lab.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from iterserve.core.cost_model import load_cost_model
from iterserve.lab.api import plan_lab, run_lab, simulate_plan
from iterserve.lab.metrics import summarize
from iterserve.lab.options import PRESETS


STALL_S = 0.5     # a gap this long is a whole-prompt prefill stall, not a step


def lab(preset: str, seed: int, **over: Any) -> dict[str, Any]:
    """The preset with `over` on top; a None in `over` removes the preset's value. Adds
    p99.9 ITL and the stall share (gaps over STALL_S) from the simulated token gaps."""
    opts = {**PRESETS[preset]["options"], "seed": seed, **over}
    opts = {k: v for k, v in opts.items() if v is not None}
    opts["cost_model"] = load_cost_model(opts["cost_model"])
    if opts.get("arrival_rate_s") is None or not opts.get("mix"):
        return run_lab(opts)["continuous"]
    res = simulate_plan(plan_lab(opts))["continuous"]
    out = summarize(res)
    S = res.step_start_s
    gaps = S[res.itl_next] - S[res.itl_prev]
    out["p999_itl_s"] = float(np.percentile(gaps, 99.9)) if gaps.size else 0.0
    out["stall_share"] = float((gaps > STALL_S).mean()) if gaps.size else 0.0
    return out


def burst(preset: str, seed: int, **over: Any) -> dict[str, Any]:
    """The same requests all at t=0: what the knobs sustain."""
    return lab(preset, seed, **{**over, "arrival_rate_s": None})


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def longprompt(seeds: list[int], preset: str = "longprompt") -> dict[str, Any]:
    cases: list[tuple[str, dict[str, Any]]] = [("chunking off", {
        "enable_chunked_prefill": False, "max_num_batched_tokens": None})]
    for budget in (64, 128, 256, 512):
        for threshold in (0, budget // 2):
            for partial in (1, 2):
                cases.append((f"budget {budget}, threshold {threshold or 'none'}, "
                              f"partial {partial}", {
                                  "enable_chunked_prefill": True,
                                  "max_num_batched_tokens": budget,
                                  "long_prefill_token_threshold": threshold,
                                  "max_num_partial_prefills": partial}))
    rows = []
    for name, over in cases:
        poisson = [lab(preset, s, **over) for s in seeds]
        full = [burst(preset, s, **over) for s in seeds]
        rows.append({"case": name, **{k: v for k, v in over.items() if v is not None},
                     "p99_itl_s": _median(poisson, "p99_itl_s"),
                     "p999_itl_s": _median(poisson, "p999_itl_s"),
                     "max_itl_s": _median(poisson, "max_itl_s"),
                     "p99_itl_s_per_seed": [r["p99_itl_s"] for r in poisson],
                     "stall_share_per_seed": [r["stall_share"] for r in poisson],
                     "p99_ttft_s": _median(poisson, "p99_ttft_s"),
                     "throughput_tokens_per_s": _median(full, "throughput_tokens_per_s")})
    off = rows[0]
    for r in rows:
        r["itl_gain_vs_off"] = off["p99_itl_s"] / r["p99_itl_s"] if r["p99_itl_s"] else None
        r["max_itl_gain_vs_off"] = off["max_itl_s"] / r["max_itl_s"] if r["max_itl_s"] else None
        r["throughput_vs_off"] = r["throughput_tokens_per_s"] / off["throughput_tokens_per_s"]
        r["itl_gain_per_seed"] = [a / b if b else None for a, b in zip(
            off["p99_itl_s_per_seed"], r["p99_itl_s_per_seed"])]
    eligible = [r for r in rows[1:] if r["throughput_vs_off"] >= 0.95]
    best = min(eligible, key=lambda r: r["p99_itl_s"]) if eligible else None
    return {"preset": preset, "rows": rows, "best_within_5pct": best,
            "stall_share_off_per_seed": off["stall_share_per_seed"]}


def priority_flood(seeds: list[int]) -> dict[str, Any]:
    p = PRESETS["priority-flood"]["options"]
    frac, rate, n = p["priority_frac"], p["arrival_rate_s"], p["requests"]
    out: dict[str, Any] = {"preset": "priority-flood"}
    for policy in ("priority", "fcfs"):
        rs = [lab("priority-flood", s, scheduling_policy=policy) for s in seeds]
        out[policy] = {"p99_ttft_s_urgent": _median(rs, "p99_ttft_s_urgent"),
                       "p99_ttft_s_normal": _median(rs, "p99_ttft_s_normal"),
                       "throughput_tokens_per_s": _median(rs, "throughput_tokens_per_s")}
    # The interactive class alone: its share of the requests at its share of the rate.
    alone = [lab("priority-flood", s, scheduling_policy="fcfs", priority_frac=1.0,
                 requests=max(1, round(n * frac)), arrival_rate_s=rate * frac) for s in seeds]
    out["alone"] = {"p99_ttft_s_urgent": _median(alone, "p99_ttft_s")}
    a = out["alone"]["p99_ttft_s_urgent"]
    for policy in ("priority", "fcfs"):
        out[policy]["vs_alone"] = out[policy]["p99_ttft_s_urgent"] / a if a else None
    # How overloaded the flood is: the same requests at t=0 under fcfs.
    cap = [burst("priority-flood", s, scheduling_policy="fcfs") for s in seeds]
    out["capacity_rps"] = statistics.median(r["requests"] / r["time_s"] for r in cap)
    out["load_factor"] = rate / out["capacity_rps"]
    return out


def kv_pressure(seeds: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"preset": "kv-pressure"}
    for mode in ("recompute", "swap"):
        rs = [lab("kv-pressure", s, preemption_mode=mode) for s in seeds]
        out[mode] = {k: _median(rs, k) for k in (
            "throughput_tokens_per_s", "p99_latency_s", "p99_ttft_s", "p99_itl_s",
            "preemptions", "computed_tokens")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sections", default="longprompt,longprompt-heavy,priority-flood,kv-pressure")
    ap.add_argument("--out", default="benchmarks/results/tradeoffs-lab.json")
    args = ap.parse_args()
    sections = {x.strip() for x in args.sections.split(",")}
    seeds = [100 + i for i in range(args.seeds)]
    t0 = time.perf_counter()
    res = {"seeds": seeds, "cost_model": "smollm2-cpu",
           "presets": {k: v["options"] for k, v in PRESETS.items()}}
    for preset in ("longprompt", "longprompt-heavy"):
        if preset not in sections:
            continue
        res[preset.replace("-", "_")] = lp = longprompt(seeds, preset)
        print(f"{preset} (p99 ITL on Poisson arrivals, throughput at t=0; stall share with "
              f"chunking off per seed: "
              f"{', '.join(f'{v:.2%}' for v in lp['stall_share_off_per_seed'])}):")
        for r in lp["rows"]:
            print(f"  {r['case']:38s} p99 ITL {r['p99_itl_s'] * 1e3:7.1f} ms, p99.9 "
                  f"{r['p999_itl_s'] * 1e3:7.1f} ms, max {r['max_itl_s'] * 1e3:7.1f} ms, p99 "
                  f"TTFT {r['p99_ttft_s']:5.2f} s ({r['itl_gain_vs_off']:.2f}x better; per "
                  f"seed {', '.join(f'{g:.1f}' for g in r['itl_gain_per_seed'])})  throughput "
                  f"{r['throughput_tokens_per_s']:6.1f} tok/s ({r['throughput_vs_off']:.3f}x)")
        if lp["best_within_5pct"]:
            b = lp["best_within_5pct"]
            print(f"  best within 5% throughput: {b['case']}: {b['itl_gain_vs_off']:.2f}x "
                  f"lower p99 ITL at {b['throughput_vs_off']:.3f}x throughput")
    if "priority-flood" not in sections:
        res["wall_s"] = time.perf_counter() - t0
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.out}")
        return
    res["priority_flood"] = pf = priority_flood(seeds)
    print(f"priority flood ({pf['load_factor']:.2f}x capacity): interactive p99 TTFT alone "
          f"{pf['alone']['p99_ttft_s_urgent']:.3f} s; priority "
          f"{pf['priority']['p99_ttft_s_urgent']:.3f} s ({pf['priority']['vs_alone']:.2f}x); "
          f"fcfs {pf['fcfs']['p99_ttft_s_urgent']:.3f} s ({pf['fcfs']['vs_alone']:.2f}x)")
    res["kv_pressure"] = kv = kv_pressure(seeds)
    for mode in ("recompute", "swap"):
        m = kv[mode]
        print(f"kv pressure, {mode:9s}: {m['throughput_tokens_per_s']:.1f} tok/s, p99 latency "
              f"{m['p99_latency_s']:.1f} s, {m['preemptions']:.0f} preemptions, "
              f"{m['computed_tokens']:.0f} tokens computed")
    res["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()

"""Lab benchmark: goodput of fcfs vs slo at 0.8x, 1.5x and 2x the engine's capacity.

Not a test (tests/lab/test_slo_goodput.py asserts the target on one fixed seed). Runs the
preset of `iterserve.lab.slo` (the bench `poisson` mix on the shipped `smollm2-cpu` cost
model, 64 slots, TTFT <= 1 s, TPOT <= 100 ms) over several seeds and writes JSON to
benchmarks/results/slo-goodput-lab.json. Everything is simulated time: the numbers are the
same on any machine; only `wall_s` depends on it.

    PYTHONPATH=src .venv/bin/python benchmarks/slo_goodput.py [--seeds 5] [--requests 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from iterserve.lab.slo import LOAD_FACTORS, PRESET, goodput_comparison


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=PRESET["requests"])
    ap.add_argument("--out", default="benchmarks/results/slo-goodput-lab.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    runs = []
    for seed in range(args.seeds):
        r = goodput_comparison({"seed": 1000 + seed, "requests": args.requests})
        runs.append({"seed": 1000 + seed, **r})
        line = "  ".join(
            f"{row['load']}x: fcfs {row['fcfs']['goodput_rps']:.2f} slo "
            f"{row['slo']['goodput_rps']:.2f} ({row['goodput_ratio']:.2f}x)"
            for row in r["rows"])
        print(f"seed {1000 + seed}: capacity {r['capacity_rps']:.2f} req/s  {line}")
    summary = {}
    for i, f in enumerate(LOAD_FACTORS):
        ratios = [run["rows"][i]["goodput_ratio"] for run in runs]
        summary[f"{f}x"] = {
            "fcfs_goodput_rps_median": statistics.median(
                run["rows"][i]["fcfs"]["goodput_rps"] for run in runs),
            "slo_goodput_rps_median": statistics.median(
                run["rows"][i]["slo"]["goodput_rps"] for run in runs),
            "ratio_min": min(ratios), "ratio_median": statistics.median(ratios),
            "ratio_max": max(ratios)}
        s = summary[f"{f}x"]
        print(f"{f}x capacity: goodput fcfs {s['fcfs_goodput_rps_median']:.2f}, slo "
              f"{s['slo_goodput_rps_median']:.2f} req/s (median); slo/fcfs "
              f"{s['ratio_min']:.2f}-{s['ratio_max']:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"preset": {k: v for k, v in PRESET.items()}, "summary": summary,
                               "runs": runs, "wall_s": time.perf_counter() - t0},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

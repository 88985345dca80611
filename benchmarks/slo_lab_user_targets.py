"""Goodput of fcfs vs slo in the lab (simulated time) with the targets a user picks, at
0.5x-4x the measured capacity: the issue's table shape (bundled model's shipped fit, 16
slots, the bench poisson mix), per target pair, with the promise (the share of admitted
requests meeting both targets) next to the goodput.

    PYTHONPATH=src .venv/bin/python benchmarks/slo_lab_user_targets.py \
        [--out benchmarks/results/slo-goodput-lab-user-targets.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from iterserve.lab.slo import goodput_comparison

TARGETS = ((500.0, 100.0), (1000.0, 150.0), (2000.0, 150.0), (2000.0, 250.0))
LOADS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", type=Path,
                    default=Path("benchmarks/results/slo-goodput-lab-user-targets.json"))
    args = ap.parse_args()
    t0 = time.time()
    doc = {"what": "lab, simulated time: fcfs vs slo goodput at user targets",
           "requests": args.requests, "max_num_seqs": args.max_num_seqs, "cases": []}
    for ttft, tpot in TARGETS:
        for seed in (int(s) for s in args.seeds.split(",")):
            r = goodput_comparison({"seed": seed, "requests": args.requests,
                                    "max_num_seqs": args.max_num_seqs, "slo_ttft_ms": ttft,
                                    "slo_tpot_ms": tpot}, LOADS)
            case = {"ttft_ms": ttft, "tpot_ms": tpot, "seed": seed,
                    "capacity_rps": r["capacity_rps"], "rows": [
                        {"load": row["load"], "rate": row["arrival_rate_s"],
                         "fcfs_goodput": row["fcfs"]["goodput_rps"],
                         "slo_goodput": row["slo"]["goodput_rps"],
                         "ratio": row["goodput_ratio"], "slo_refused": row["slo"]["refused"],
                         "fcfs_admitted_met": row["fcfs"]["admitted_met"],
                         "slo_admitted_met": row["slo"]["admitted_met"]}
                        for row in r["rows"]]}
            doc["cases"].append(case)
            print(f"TTFT {ttft:g} / TPOT {tpot:g} ms, seed {seed}, capacity "
                  f"{r['capacity_rps']:.2f} req/s")
            for row in case["rows"]:
                print(f"  {row['load']:>4}x  fcfs {row['fcfs_goodput']:.2f}  slo "
                      f"{row['slo_goodput']:.2f}  {row['ratio']:.2f}x  refused "
                      f"{row['slo_refused']}  admitted met {row['fcfs_admitted_met']:.0%} / "
                      f"{row['slo_admitted_met']:.0%}", flush=True)
    doc["wall_s"] = time.time() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

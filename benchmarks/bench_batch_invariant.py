"""The cost of `--batch-invariant`: the offline engine on `mix`, default kernels against the
batch-invariant ones, in one process, rounds alternating so machine noise falls on both.

Two shapes of load, as the batch-invariance issue asks: `mix` at 8 slots (continuous
batching, decode rows 1-8 beside prefill chunks) and batch-1 decode (`mix` at one slot).
The figure is the ratio invariant / default of output tokens/s per round, and its median.

    .venv/bin/python benchmarks/bench_batch_invariant.py [--model FILE] [--rounds 3] \\
        [--num-requests 16] [--out benchmarks/results/batch-invariant-cost-bundled.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from iterserve.bench.client import machine_info
from iterserve.bench.offline import run_mode
from iterserve.bench.workloads import build_workload


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=16, help="mix requests per run")
    ap.add_argument("--batch1-requests", type=int, default=3, help="requests of the batch-1 run")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    shapes = {f"mix_{args.slots}_slots": (args.slots, args.num_requests),
              "batch1_decode": (1, args.batch1_requests)}
    runs: list[dict] = []
    for rnd in range(args.rounds):
        for shape, (slots, n) in shapes.items():
            w = build_workload("mix", seed=rnd, num_requests=n)
            order = (False, True) if rnd % 2 == 0 else (True, False)
            for invariant in order:
                r = run_mode(w, "continuous", slots, args.model, batch_invariant=invariant)
                r.update(round=rnd, shape=shape, batch_invariant=invariant)
                runs.append(r)
                print(json.dumps({k: r[k] for k in ("round", "shape", "batch_invariant",
                                                    "output_throughput", "wall_s")}),
                      file=sys.stderr, flush=True)
    summary = {}
    for shape in shapes:
        ratios = []
        for rnd in range(args.rounds):
            by = {r["batch_invariant"]: r["output_throughput"] for r in runs
                  if r["shape"] == shape and r["round"] == rnd}
            ratios.append(round(by[True] / by[False], 4))
        summary[shape] = {"invariant_over_default_per_round": ratios,
                          "median": statistics.median(ratios)}
    result = {"kind": "batch-invariant-cost", "model": args.model or "default",
              "commit": _commit(), "machine": machine_info(),
              "command": " ".join(["benchmarks/bench_batch_invariant.py", *(argv or sys.argv[1:])]),
              "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

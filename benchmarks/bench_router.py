"""Router overhead: `Router.route()` per call for 1k-token prompts (the bar: p50 <= 2 ms).

The prompts are the shared-prefix kind the prefix-aware policy is for (G system prompts of
S tokens, each followed by a unique question), so the index really is walked and updated;
every policy is timed on the same prompts, interleaved in rounds, medians per policy.
Prints a table and writes JSON (benchmarks/results/router-overhead.json by default).

    PYTHONPATH=src python benchmarks/bench_router.py --replicas 64 --calls 2000
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np

from iterserve.core.router import ReplicaLoad, Router

POLICIES = ("round_robin", "least_loaded", "prefix_aware")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--prefix-len", type=int, default=768)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/router-overhead.json")
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = []
    for k in range(a.calls):
        g = rng.randrange(a.groups)
        prompts.append([1000 + g] * a.prefix_len
                       + [rng.randrange(50_000) for _ in range(a.prompt_len - a.prefix_len)])
    times: dict[str, list[float]] = {p: [] for p in POLICIES}
    for _ in range(a.rounds):
        for policy in POLICIES:
            r = Router(policy, block_size=a.block_size, cache_capacity_blocks=4096)
            loads = [ReplicaLoad(f"r{i}", rng.randrange(8), rng.randrange(4), rng.random(), 16)
                     for i in range(a.replicas)]
            for p in prompts:
                t0 = time.perf_counter()
                i = r.route(p, loads)
                times[policy].append(time.perf_counter() - t0)
                loads[i].num_waiting += 1          # the replica reports its new request
                j = rng.randrange(a.replicas)      # ... and some other one finishes one
                if loads[j].num_waiting:
                    loads[j].num_waiting -= 1
    res = {"replicas": a.replicas, "calls_per_round": a.calls, "rounds": a.rounds,
           "prompt_len": a.prompt_len, "prefix_len": a.prefix_len, "groups": a.groups,
           "block_size": a.block_size, "note": "taken on a shared 2-core machine under load",
           "policies": {}}
    print(f"route() per call, {a.replicas} replicas, {a.prompt_len}-token prompts")
    for policy, ts in times.items():
        ms = np.asarray(ts) * 1e3
        row = {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
               "mean_ms": float(ms.mean())}
        res["policies"][policy] = row
        print(f"  {policy:14} p50 {row['p50_ms']:.3f} ms  p99 {row['p99_ms']:.3f} ms")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""How fast is the cluster lab? 64 replicas x 100,000 requests (the bar: under 5 minutes).

    PYTHONPATH=src python benchmarks/bench_lab_cluster.py [--replicas 64] [--requests 100000]
        [--router prefix_aware] [--out benchmarks/results/lab-cluster-64x100k.json]

The workload is the one a cluster of CPU replicas behind a prefix-aware router is for: the
bench `poisson` output mix (80% answers of 10-100 tokens, 20% of 250-500), each prompt one
of 256 shared system prompts of 512 tokens (Zipf-skewed, s = 0.8) followed by 20-100 tokens
of its own, prefix caching on, 32 slots per replica, the shipped `smollm2-cpu` cost model,
Poisson arrivals at --load x the cluster's capacity. Capacity is measured first, not assumed:
the same replicas and router serving a burst of 100 such requests per replica (requests /
simulated makespan).

Prints and writes one JSON object: wall and CPU seconds (time.process_time: on a shared
machine the wall clock also counts other processes' turns) of the timed run, the steps and
tokens simulated, microseconds per output token, and the run's report (throughput, TTFT /
ITL percentiles, hit rate, and per-replica utilisation as min / mean / max).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from iterserve.core.cost_model import load_cost_model
from iterserve.lab.cluster import plan_cluster, simulate_cluster, summarize_cluster

WORKLOAD = {"batching": "continuous", "max_num_seqs": 32, "prompt_len": [20, 100],
            "prefix_groups": 256, "prefix_len": 512, "prefix_zipf": 0.8,
            "enable_prefix_caching": True}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--router", default="prefix_aware")
    ap.add_argument("--load", type=float, default=0.8, help="arrival rate / capacity")
    ap.add_argument("--cost-model", default="smollm2-cpu")
    ap.add_argument("--out", default="benchmarks/results/lab-cluster-64x100k.json")
    a = ap.parse_args()
    cost = load_cost_model(a.cost_model)

    # Capacity: the same cluster and router serving a burst of 100 requests per replica
    # (with prefix-aware routing the prefix cache raises it, so it must be measured so).
    cap_plan = plan_cluster({**WORKLOAD, "requests": 100 * a.replicas,
                             "data_parallel_size": a.replicas, "router": a.router,
                             "cost_model": cost})
    capacity = summarize_cluster(simulate_cluster(cap_plan))["requests_per_s"]
    rate = a.load * capacity

    opts = {**WORKLOAD, "requests": a.requests, "data_parallel_size": a.replicas,
            "router": a.router, "arrival_rate_s": rate, "cost_model": cost}
    w0, c0 = time.perf_counter(), time.process_time()
    plan = plan_cluster(opts)
    w1, c1 = time.perf_counter(), time.process_time()
    res = simulate_cluster(plan)
    w2, c2 = time.perf_counter(), time.process_time()
    summary = summarize_cluster(res)
    w3, c3 = time.perf_counter(), time.process_time()

    per = summary.pop("per_replica")
    steps = sum(p["steps"] for p in per)

    def spread(key):
        vals = [p[key] for p in per]
        return {"min": min(vals), "mean": sum(vals) / len(vals), "max": max(vals)}

    out = {
        "bench": "lab_cluster",
        "replicas": a.replicas, "requests": a.requests, "router": a.router,
        "workload": {**WORKLOAD, "cost_model": a.cost_model, "load": a.load,
                     "capacity_rps": capacity, "arrival_rate_s": rate},
        "wall_s": {"plan": w1 - w0, "simulate": w2 - w1, "summarize": w3 - w2,
                   "total": w3 - w0},
        "cpu_s": {"plan": c1 - c0, "simulate": c2 - c1, "summarize": c3 - c2,
                  "total": c3 - c0},
        "steps": steps,
        "tokens": summary["tokens"],
        "us_per_output_token_cpu": 1e6 * (c2 - c1) / max(summary["tokens"], 1),
        "under_5_minutes": (w3 - w0) < 300,
        "report": summary,
        "per_replica": {k: spread(k) for k in ("requests", "busy_frac", "slot_utilization",
                                               "prefix_cache_hit_rate")},
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "load_average_before_after": list(os.getloadavg())},
        "note": "one process, one core; taken on a shared 2-core machine (see the load "
                "average): compare cpu_s, not wall_s, across runs",
    }
    text = json.dumps(out, indent=2)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does the cluster lab predict the real replicas? The same workload on both, side by side.

Real: `iterserve serve --data-parallel-size N --threads-per-replica 1 --router R` (Ray Serve
replicas of the bundled SmolLM2, or --model) in a subprocess on 127.0.0.1, driven over HTTP
by iterserve's own benchmark client (`iterserve.bench.client.run_workload`: open loop, every
request sent at its arrival time, streamed, timed on the client's clock). A warm-up of two
requests per replica runs first and is not counted. This is how benchmarks/bench_replicas.py
(the replicas' own benchmark) drives the server, with the same workloads
(bench/workloads.py), so its figures and these are comparable.

Lab: `lab.cluster.simulate_replicas` on the same requests (the prompt lengths the server
reported in its usage blocks, the same output lengths, the same arrival times) with the
server's own scheduler and KV knobs (built by the same EngineArgs), N replicas behind the
same router code, step times from a cost model fitted to one replica's thread count
(default benchmarks/results/cost-model-bundled-1thread.json, written by
`OMP_NUM_THREADS=1 iterserve lab calibrate --out ...`; else the shipped smollm2-cpu, fitted
on 2 threads).

Printed and written (--out): real and predicted throughput (output tokens / makespan,
first arrival to last finish) and median / p99 TTFT, the ratios lab / real, and whether
throughput and median TTFT are within 15% (the bar). What the lab does not model
and a 2-core machine adds: the HTTP server, Ray's handle and proxy, detokenisation and
streaming share the two cores with the replicas' own threads.

    PYTHONPATH=src python benchmarks/lab_vs_replicas.py [--replicas 2] [--router least_loaded]
        [--workload poisson] [--rate 1.0] [--num-requests 48] [--port 18510] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from iterserve.bench.client import ClientOptions, machine_info, run_workload
from iterserve.bench.workloads import BenchRequest, Workload, build_workload
from iterserve.core.cost_model import load_cost_model
from iterserve.engine.args import EngineArgs
from iterserve.lab.cluster import simulate_replicas
from iterserve.lab.simulator import SimSettings
from iterserve.lab.workload import RequestSpec

DEFAULT_COST = "benchmarks/results/cost-model-bundled-1thread.json"
MODEL_LIMIT = 8192          # SmolLM2's max_position_embeddings (max_model_len: min(it, 2048))
TARGET = 0.15


def engine_args(a: argparse.Namespace) -> EngineArgs:
    return EngineArgs(model=a.model, max_num_seqs=a.max_num_seqs, num_kv_blocks=a.num_kv_blocks,
                      enable_prefix_caching=a.enable_prefix_caching,
                      data_parallel_size=a.replicas, router=a.router, threads_per_replica=1)


def start_server(a: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--host", "127.0.0.1",
           "--port", str(a.port), "--max-num-seqs", str(a.max_num_seqs),
           "--num-kv-blocks", str(a.num_kv_blocks), "--router", a.router,
           "--data-parallel-size", str(a.replicas)]
    if a.replicas > 1:
        cmd += ["--threads-per-replica", "1"]
    if a.enable_prefix_caching:
        cmd.append("--enable-prefix-caching")
    if a.model:
        cmd += ["--model", a.model]
    env = dict(os.environ)
    if a.server_pythonpath:
        env["PYTHONPATH"] = a.server_pythonpath
    if a.replicas == 1:
        env["OMP_NUM_THREADS"] = "1"          # one replica of one thread, as in the pool
    return subprocess.Popen(cmd, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=open(a.server_log, "w"))


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(base + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def warm_up(base: str, w: Workload, n: int) -> None:
    reqs = tuple(BenchRequest(i, r.prompt, r.prompt_len, 8, 0.0, r.kind)
                 for i, r in enumerate(w.requests[:n]))
    asyncio.run(run_workload(base, Workload("warmup", 0, None, reqs, "warm-up")))


def engine_ttft(base: str) -> tuple[float, float]:
    """(sum, count) of the engines' own TTFT histogram on /metrics (all replicas): the time
    from a request's arrival in an engine to its first token, without HTTP or streaming."""
    text = httpx.get(base + "/metrics", timeout=30).text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("#") or "time_to_first_token_seconds" not in line:
            continue
        name, _, value = line.rpartition(" ")
        if 'replica="' in name:
            continue                      # the per-replica series; the sums come unlabelled
        if name.split("{")[0].endswith("_sum"):
            total += float(value)
        elif name.split("{")[0].endswith("_count"):
            count += float(value)
    return total, count


def real_figures(doc: dict) -> dict:
    recs = [r for r in doc["requests"] if r["success"]]
    finish = [r["start_s"] + r["e2e"] for r in recs]
    first = min(r["scheduled_s"] for r in doc["requests"])
    tokens = sum(r["output_tokens"] for r in recs)
    ttft = np.array([r["ttft"] + (r["start_s"] - r["scheduled_s"]) for r in recs])
    span = max(finish) - first
    return {"requests": len(doc["requests"]), "succeeded": len(recs), "tokens": tokens,
            "makespan_s": span, "throughput_tokens_per_s": tokens / span,
            "median_ttft_s": float(np.median(ttft)), "p99_ttft_s": float(np.percentile(ttft, 99))}


def lab_figures(w: Workload, doc: dict, a: argparse.Namespace) -> dict:
    reported = {r["index"]: r.get("prompt_tokens_reported") for r in doc["requests"]}
    specs = sorted((RequestSpec(i, 0, reported.get(r.index) or r.prompt_len, r.max_tokens,
                                r.kind == "long", 0, arrival_s=r.arrival_s)
                    for i, r in enumerate(w.requests)), key=lambda s: (s.arrival_s, s.index))
    ea = engine_args(a)
    settings = SimSettings(ea.create_scheduler_config(MODEL_LIMIT), ea.create_cache_config(),
                           prefill_ignored=False)
    cost = load_cost_model(a.cost_model)
    res = simulate_replicas(specs, settings, cost, replicas=a.replicas, router=a.router)
    ttft = res.first_token_s - res.arrival_s
    first = float(res.arrival_s.min())
    tokens = sum(s.output_len for s in specs)
    span = float(res.finish_s.max()) - first
    return {"requests": len(specs), "tokens": tokens, "makespan_s": span,
            "throughput_tokens_per_s": tokens / span,
            "median_ttft_s": float(np.median(ttft)), "p99_ttft_s": float(np.percentile(ttft, 99)),
            "mean_ttft_s": float(ttft.mean()),
            "per_replica_requests": [p["requests"] for p in res.per_replica],
            "prefix_cache_hit_rate": (res.cache_hits / res.cache_queries
                                      if res.cache_queries else 0.0),
            "cost_model": cost.description}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--router", default="least_loaded",
                    choices=("round_robin", "least_loaded", "prefix_aware"))
    ap.add_argument("--workload", default="poisson")
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson)")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--enable-prefix-caching", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--cost-model", default=None, metavar="FILE|NAME")
    ap.add_argument("--port", type=int, default=18510)
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--server-log", default="/tmp/lab_vs_replicas.server.log")
    ap.add_argument("--server-pythonpath", default=None, metavar="DIR",
                    help="PYTHONPATH of the server only (e.g. an export of another branch's "
                         "src); default: this process's")
    ap.add_argument("--out", default="benchmarks/results/lab-vs-replicas-dp2.json")
    a = ap.parse_args()
    if a.cost_model is None:
        a.cost_model = DEFAULT_COST if Path(DEFAULT_COST).exists() else "smollm2-cpu"

    w = build_workload(a.workload, seed=a.seed, rate=a.rate, num_requests=a.num_requests)
    base = f"http://127.0.0.1:{a.port}"
    load_before = os.getloadavg()
    proc = start_server(a)
    try:
        t0 = time.monotonic()
        wait_ready(base, proc, a.ready_timeout)
        startup_s = time.monotonic() - t0
        warm_up(base, w, 2 * a.replicas)
        before = engine_ttft(base)
        doc = asyncio.run(run_workload(base, w, ClientOptions()))
        after = engine_ttft(base)
    finally:
        stop_server(proc)
    real = real_figures(doc)
    n = after[1] - before[1]
    real["engine_mean_ttft_s"] = (after[0] - before[0]) / n if n else None
    real["client_mean_ttft_s"] = float(np.mean([r["ttft"] for r in doc["requests"]
                                                if r["success"]]))
    lab = lab_figures(w, doc, a)
    ratios = {"throughput": lab["throughput_tokens_per_s"] / real["throughput_tokens_per_s"],
              "median_ttft": lab["median_ttft_s"] / real["median_ttft_s"],
              "p99_ttft": lab["p99_ttft_s"] / real["p99_ttft_s"]}
    out = {
        "bench": "lab_vs_replicas", "replicas": a.replicas, "router": a.router,
        "workload": w.summary(), "knobs": {"max_num_seqs": a.max_num_seqs,
                                           "num_kv_blocks": a.num_kv_blocks,
                                           "enable_prefix_caching": a.enable_prefix_caching,
                                           "threads_per_replica": 1},
        "server_startup_s": startup_s, "real": real, "lab": lab, "ratio_lab_over_real": ratios,
        "within_15pct": {k: abs(ratios[k] - 1) <= TARGET for k in ("throughput", "median_ttft")},
        "machine": machine_info(), "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
    }
    print(f"{a.replicas} replica(s), router {a.router}, {w.name} {len(w.requests)} requests at "
          f"{a.rate:g}/s; cost model {Path(str(a.cost_model)).name}")
    print(f"{'':22}{'real':>12}{'lab':>12}{'lab/real':>10}")
    for label, key, r in (("throughput (tok/s)", "throughput_tokens_per_s", "throughput"),
                          ("median TTFT (s)", "median_ttft_s", "median_ttft"),
                          ("p99 TTFT (s)", "p99_ttft_s", "p99_ttft")):
        print(f"{label:22}{real[key]:>12.3f}{lab[key]:>12.3f}{ratios[r]:>10.3f}")
    if real["engine_mean_ttft_s"] is not None:
        print(f"mean TTFT: client {real['client_mean_ttft_s']:.3f} s, inside the engines "
              f"{real['engine_mean_ttft_s']:.3f} s, lab {lab['mean_ttft_s']:.3f} s")
    print(f"within 15%: {out['within_15pct']}; load average before {load_before[0]:.1f}, "
          f"after {out['load_average_after'][0]:.1f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

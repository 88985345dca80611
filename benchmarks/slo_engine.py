"""Real-engine goodput (issue 18): `iterserve serve` under fcfs vs slo, same client, same load.

The lab half (`benchmarks/slo_goodput.py`) runs the policy on simulated time; this drives the
real server, bundled model, over HTTP with the bench client (`iterserve.bench.client`, the one
that measures llama-server and vLLM too): the `poisson` mix (prompts 8-40 tokens, 80% answers
of 10-100 tokens, 20% of 250-500, ignore_eos) at `load` x the engine's capacity, the same
seeded arrivals for both policies. Goodput = requests per second (first arrival to last
answer) that met both targets, as the client measured them: TTFT <= --slo-ttft-ms and TPOT
<= --slo-tpot-ms ((e2e - ttft) / (tokens - 1), vLLM's definition). A request refused with
429 meets neither (it is counted, not retried).

Capacity is measured, not assumed (unless --capacity is given): the same mix, every request
at t=0, under fcfs, completed requests per second. Each policy gets a fresh server process
(same flags but the policy; the slo one gets the targets as --slo-ttft-ms / --slo-tpot-ms
server defaults) and the same warm-up; with --repeats > 1 the policy order alternates, and
the JSON keeps every run plus the medians. Timing on a shared machine is noisy: compare the
ratio of the same run, not absolute numbers.

    PYTHONPATH=src .venv/bin/python benchmarks/slo_engine.py [--loads 1.5,2] [--repeats 1]
        [--requests 60] [--max-num-seqs 32] [--slo-ttft-ms 2000] [--slo-tpot-ms 80]
        [--capacity R] [--port 18710] [--out benchmarks/results/slo-engine.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from iterserve.bench.client import ClientOptions, machine_info, run_workload
from iterserve.bench.metrics import SLO
from iterserve.bench.workloads import build_workload

POLICIES = ("fcfs", "slo")


class Server:
    """One `iterserve serve` process on 127.0.0.1:port, stopped on exit."""

    def __init__(self, port: int, policy: str, args: argparse.Namespace) -> None:
        cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--scheduling-policy", policy,
               "--max-num-seqs", str(args.max_num_seqs)]
        if args.model:
            cmd += ["--model", args.model]
        if policy == "slo":
            cmd += ["--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms)]
        cmd += list(args.serve_arg or [])
        self.cmd = cmd
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(Path(args.log_dir) / f"slo-engine-{policy}-{port}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=os.environ.copy())

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout:.0f} s: see {self.log.name}")

    def stats(self) -> dict[str, Any] | None:
        try:
            return httpx.get(self.url + "/v1/engine/stats", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def warm_up(url: str, args: argparse.Namespace) -> None:
    """The same warm-up for both policies: 8 concurrent mix requests (kernels, caches, and
    the slo policy's step-time model has its first measured steps)."""
    w = build_workload("mix", seed=args.seed + 7, rate=None, num_requests=8)
    asyncio.run(run_workload(url, w, ClientOptions(request_timeout_s=args.request_timeout_s)))


def one_run(url: str, rate: float | None, args: argparse.Namespace, slo: SLO) -> dict[str, Any]:
    w = build_workload("poisson" if rate else "mix", seed=args.seed, rate=rate,
                       num_requests=args.requests)
    res = asyncio.run(run_workload(url, w, ClientOptions(request_timeout_s=args.request_timeout_s),
                                   slo))
    s = res["summary"]
    refused = sum(1 for r in res["requests"] if (r.get("error") or "").startswith("HTTP 429"))
    other_failed = s["failed"] - refused
    keep = ("num_requests", "completed", "failed", "duration_s", "request_throughput",
            "output_throughput", "good_requests", "goodput", "ttft", "tpot", "itl")
    return {**{k: s[k] for k in keep}, "refused_429": refused, "failed_other": other_failed}


def measure_capacity(args: argparse.Namespace, port: int) -> float:
    srv = Server(port, "fcfs", args)
    try:
        srv.wait_ready()
        warm_up(srv.url, args)
        r = one_run(srv.url, None, args, SLO())
    finally:
        srv.stop()
    cap = r["completed"] / r["duration_s"]
    print(f"capacity (fcfs burst of {args.requests}): {cap:.3f} requests/s "
          f"({r['output_throughput']:.1f} output tok/s)", flush=True)
    return cap


def write(args, loads, cap, runs, t_start, load_before, *, final: bool) -> None:
    """The result JSON (rewritten after every run, so a cut-short session keeps its runs)."""
    summary = {}
    for f in loads:
        g = {p: [r["goodput"] for r in runs if r["policy"] == p and r["load"] == f]
             for p in POLICIES}
        if not (g["fcfs"] and g["slo"]):
            continue
        ratios = [s / fc if fc > 0 else float("inf")
                  for fc, s in zip(g["fcfs"], g["slo"])]
        summary[f"{f:g}x"] = {
            "fcfs_goodput_rps_median": statistics.median(g["fcfs"]),
            "slo_goodput_rps_median": statistics.median(g["slo"]),
            "ratio_per_repeat": ratios}
        if final:
            s = summary[f"{f:g}x"]
            print(f"{f:g}x capacity: goodput fcfs {s['fcfs_goodput_rps_median']:.3f}, slo "
                  f"{s['slo_goodput_rps_median']:.3f} req/s (median); slo/fcfs per repeat "
                  f"{', '.join(f'{x:.2f}x' for x in ratios)}", flush=True)
    with open("/proc/loadavg") as f:
        load_now = f.read().split()[:3]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "slo_engine", "complete": final, "started_at": t_start,
        "machine": machine_info(), "loadavg_before": load_before, "loadavg_after": load_now,
        "capacity_rps": cap, "capacity_measured": not args.capacity,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "options": {"requests": args.requests, "max_num_seqs": args.max_num_seqs,
                    "seed": args.seed, "loads": loads, "repeats": args.repeats,
                    "workload": "poisson (bench mix, ignore_eos)", "model": args.model or "bundled"},
        "summary": summary, "runs": runs, "wall_s": time.time() - t_start}, indent=2) + "\n")
    if final:
        print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="1.5,2", help="load factors x capacity (default 1.5,2)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=80.0)
    ap.add_argument("--capacity", type=float, help="requests/s (default: measured)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=18710)
    ap.add_argument("--model", help="model path (default: the bundled model)")
    ap.add_argument("--serve-arg", action="append", help="extra `iterserve serve` argument")
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--out", default="benchmarks/results/slo-engine.json")
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",") if x.strip()]
    slo = SLO(ttft_s=args.slo_ttft_ms / 1e3, itl_s=args.slo_tpot_ms / 1e3)
    t_start = time.time()
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    cap = args.capacity if args.capacity else measure_capacity(args, args.port)
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        order = POLICIES if rep % 2 == 0 else POLICIES[::-1]
        for policy in order:
            srv = Server(args.port + 1 + POLICIES.index(policy), policy, args)
            try:
                srv.wait_ready()
                warm_up(srv.url, args)
                for f in loads:
                    r = one_run(srv.url, f * cap, args, slo)
                    st = srv.stats()
                    runs.append({"repeat": rep, "policy": policy, "load": f,
                                 "rate_rps": f * cap, **r,
                                 "engine_slo": (st or {}).get("slo")})
                    write(args, loads, cap, runs, t_start, load_before, final=False)
                    print(f"repeat {rep} {policy:4s} {f:g}x ({f * cap:.2f} req/s): goodput "
                          f"{r['goodput']:.3f} req/s ({r['good_requests']}/{r['num_requests']}"
                          f" met both), 429 {r['refused_429']}, other failures "
                          f"{r['failed_other']}, p99 TTFT {r['ttft']['p99_ms']} ms, "
                          f"median TPOT {r['tpot']['median_ms']} ms", flush=True)
            finally:
                srv.stop()
    write(args, loads, cap, runs, t_start, load_before, final=True)


if __name__ == "__main__":
    main()

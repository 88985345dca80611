"""Real-engine goodput: `iterserve serve` under fcfs vs slo, same client, same load.

The lab half (`benchmarks/slo_goodput.py`, `iterserve lab slo`) runs the policy on simulated
time; this drives the real server, bundled model, over HTTP with the bench client
(`iterserve.bench.client`): the requests of the lab preset `slo-overload` (one definition,
`slo_workloads.py`: prompts 8-40 tokens, 80% answers of 10-100 tokens, 20% of 250-500,
ignore_eos; 64 slots) with Poisson arrivals at `load` x the engine's measured capacity, the
same seeded arrivals for both policies. Goodput = requests per second (first arrival to
last answer) that met both targets as the client measured them: TTFT <= ttft target and
TPOT <= tpot target ((e2e - ttft) / (tokens - 1), vLLM's definition). A request refused
with 429 meets neither (it is counted, not retried).

Measured, not assumed: the fcfs server serves the same requests all at t=0 (a burst):
capacity = completed / duration, and t_full = the median TPOT at that full batch. The
targets are the preset's (TTFT 1 s, TPOT 100 ms, set for the lab's reference CPU whose full
64-sequence decode step takes 0.23 s) scaled by t_full / 0.23 s, so the experiment is the
preset's on any machine, quiet or loaded: a full batch breaks the TPOT target, a batch of
~25 meets it, and TTFT allows ~4 full steps. `--slo-ttft-ms` / `--slo-tpot-ms` fix them.

Both servers run side by side (same flags but the policy; the slo one gets the targets as
--slo-ttft-ms / --slo-tpot-ms defaults) and are driven one at a time, alternating: at each
load of each repeat fcfs then slo, the order flipped every other repeat. The JSON keeps
every run and the per-repeat ratio (same load, adjacent in time); it is rewritten after
every run. Quiet 2-core machine: ~8-10 min with the defaults.

    PYTHONPATH=src .venv/bin/python benchmarks/slo_engine.py [--loads 0.8,1.5,2]
        [--repeats 2] [--requests 64] [--slo-ttft-ms MS --slo-tpot-ms MS]
        [--port 18610] [--out benchmarks/results/slo-goodput-engine.json]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slo_workloads import bench_workload, plan, serve_args  # noqa: E402

from iterserve.bench.client import ClientOptions, machine_info, run_workload  # noqa: E402
from iterserve.bench.metrics import SLO  # noqa: E402
from iterserve.bench.workloads import build_workload  # noqa: E402
from iterserve.lab.preset_scale import speed  # noqa: E402

POLICIES = ("fcfs", "slo")
PRESET = "slo-overload"
LAB_FULL_STEP_S = 0.23      # the preset's full 64-sequence decode step on the reference fit


class Server:
    """One `iterserve serve` process on 127.0.0.1:port, stopped on exit."""

    def __init__(self, port: int, flags: list[str], args: argparse.Namespace, tag: str) -> None:
        cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), *flags]
        if args.model:
            cmd += ["--model", args.model]
        cmd += list(args.serve_arg or [])
        self.cmd = cmd
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(Path(args.log_dir) / f"slo-engine-{tag}-{port}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=os.environ.copy())

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout:.0f} s: see {self.log.name}")

    def stats(self) -> dict[str, Any] | None:
        try:
            return httpx.get(self.url + "/v1/engine/stats", timeout=30).json()
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


def policy_flags(base: list[str], policy: str) -> list[str]:
    out = list(base)
    i = out.index("--scheduling-policy")
    out[i + 1] = policy
    return out


def warm_up(url: str, args: argparse.Namespace) -> None:
    """The same warm-up for both policies: 8 concurrent mix requests (kernels, caches, and
    the slo policy's step-time model has its first measured steps)."""
    w = build_workload("mix", seed=args.seed + 7, rate=None, num_requests=8)
    asyncio.run(run_workload(url, w, ClientOptions(request_timeout_s=args.request_timeout_s)))


def one_run(url: str, workload, args: argparse.Namespace, slo: SLO) -> dict[str, Any]:
    res = asyncio.run(run_workload(url, workload,
                                   ClientOptions(request_timeout_s=args.request_timeout_s), slo))
    s = res["summary"]
    refused = sum(1 for r in res["requests"] if (r.get("error") or "").startswith("HTTP 429"))
    keep = ("num_requests", "completed", "failed", "duration_s", "request_throughput",
            "output_throughput", "good_requests", "goodput", "ttft", "tpot", "itl")
    return {**{k: s[k] for k in keep}, "refused_429": refused,
            "failed_other": s["failed"] - refused}


def write(args, loads, meta, runs, t_start, load_before, *, final: bool) -> None:
    """The result JSON (rewritten after every run, so a cut-short benchmark keeps its runs)."""
    summary = {}
    for f in loads:
        pairs = {}
        for r in runs:
            if r["load"] == f:
                pairs.setdefault(r["repeat"], {})[r["policy"]] = r["goodput"]
        ratios = [p["slo"] / p["fcfs"] if p["fcfs"] > 0 else float("inf")
                  for p in pairs.values() if len(p) == 2]
        if not ratios:
            continue
        g = {pol: [p[pol] for p in pairs.values() if pol in p] for pol in POLICIES}
        summary[f"{f:g}x"] = {
            "fcfs_goodput_rps_median": statistics.median(g["fcfs"]),
            "slo_goodput_rps_median": statistics.median(g["slo"]),
            "ratio_per_repeat": ratios, "ratio_median": statistics.median(ratios)}
        if final:
            s = summary[f"{f:g}x"]
            print(f"{f:g}x capacity: goodput fcfs {s['fcfs_goodput_rps_median']:.3f}, slo "
                  f"{s['slo_goodput_rps_median']:.3f} req/s (median); slo/fcfs per repeat "
                  f"{', '.join(f'{x:.2f}x' for x in ratios)}", flush=True)
    with open("/proc/loadavg") as fh:
        load_now = fh.read().split()[:3]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "slo_engine", "complete": final, "started_at": t_start,
        "machine": machine_info(), "loadavg_before": load_before, "loadavg_after": load_now,
        **meta,
        "options": {"preset": PRESET, "requests": args.requests, "seed": args.seed,
                    "lengths_scale": args.lengths_scale,
                    "loads": loads, "repeats": args.repeats, "model": args.model or "bundled"},
        "summary": summary, "runs": runs, "wall_s": time.time() - t_start}, indent=2) + "\n")
    if final:
        print(f"wrote {out}")


def stop_on_sigterm() -> None:
    """SIGTERM ends the benchmark through its `finally`, so its servers are stopped too."""
    import signal

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def main() -> None:
    stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="0.8,1.5,2", help="load factors x capacity")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--slo-ttft-ms", type=float, help="default: the preset's, scaled (above)")
    ap.add_argument("--slo-tpot-ms", type=float, help="default: the preset's, scaled (above)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lengths-scale", type=float, default=1.0,
                    help="scale the preset's output lengths (< 1 for a reduced run on a "
                         "loaded machine; the quiet measurement uses 1)")
    ap.add_argument("--port", type=int, default=18610, help="fcfs server; slo on port + 1")
    ap.add_argument("--model", help="model path (default: the bundled model)")
    ap.add_argument("--serve-arg", action="append", help="extra `iterserve serve` argument")
    ap.add_argument("--request-timeout-s", type=float, default=900.0)
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--out", default="benchmarks/results/slo-goodput-engine.json")
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",") if x.strip()]
    t_start = time.time()
    with open("/proc/loadavg") as fh:
        load_before = fh.read().split()[:3]
    lengths: dict[str, Any] = {}
    if args.lengths_scale != 1.0:
        o = plan(PRESET).workload
        lengths = {k: [max(1, round(v * args.lengths_scale)) for v in getattr(o, k)]
                   for k in ("short", "long")}
    p = plan(PRESET, requests=args.requests, seed=args.seed, **lengths)
    base = serve_args(p)
    preset = p.settings["continuous"].scheduler
    servers: dict[str, Server] = {}
    try:
        servers["fcfs"] = srv = Server(args.port, policy_flags(base, "fcfs"), args, "fcfs")
        srv.wait_ready()
        warm_up(srv.url, args)
        burst = one_run(srv.url, bench_workload(p, PRESET, burst=True), args, SLO())
        cap = burst["completed"] / burst["duration_s"]
        t_full = burst["tpot"]["median_ms"] / 1e3
        # The preset's targets are in the shipped fit's time (lab/preset_scale.py divides
        # them by speed()); LAB_FULL_STEP_S is the reference fit's step: one time for both.
        scale = t_full / (LAB_FULL_STEP_S / speed())
        ttft_ms = args.slo_ttft_ms or preset.slo_ttft_ms * scale
        tpot_ms = args.slo_tpot_ms or preset.slo_tpot_ms * scale
        print(f"capacity (fcfs burst of {args.requests}): {cap:.3f} requests/s "
              f"({burst['output_throughput']:.1f} output tok/s), full-batch TPOT "
              f"{t_full * 1e3:.1f} ms -> targets TTFT {ttft_ms:.0f} ms, TPOT {tpot_ms:.1f} ms",
              flush=True)
        meta = {"capacity_rps": cap, "burst": burst, "full_batch_tpot_s": t_full,
                "slo": {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms,
                        "scaled_from_preset": not (args.slo_ttft_ms and args.slo_tpot_ms)},
                "serve_flags": base}
        slo = SLO(ttft_s=ttft_ms / 1e3, itl_s=tpot_ms / 1e3)
        servers["slo"] = srv = Server(
            args.port + 1, policy_flags(base, "slo") + [
                "--slo-ttft-ms", f"{ttft_ms:.1f}", "--slo-tpot-ms", f"{tpot_ms:.2f}"],
            args, "slo")
        srv.wait_ready()
        warm_up(srv.url, args)
        runs: list[dict[str, Any]] = []
        for rep in range(args.repeats):
            order = POLICIES if rep % 2 == 0 else POLICIES[::-1]
            for f in loads:
                w = bench_workload(plan(PRESET, requests=args.requests, seed=args.seed + rep,
                                        arrival_rate_s=f * cap, **lengths), PRESET)
                for policy in order:
                    srv = servers[policy]
                    r = one_run(srv.url, w, args, slo)
                    st = srv.stats()
                    runs.append({"repeat": rep, "policy": policy, "load": f,
                                 "rate_rps": f * cap, **r,
                                 "engine_slo": (st or {}).get("slo")})
                    write(args, loads, meta, runs, t_start, load_before, final=False)
                    print(f"repeat {rep} {policy:4s} {f:g}x ({f * cap:.2f} req/s): goodput "
                          f"{r['goodput']:.3f} req/s ({r['good_requests']}/{r['num_requests']}"
                          f" met both), 429 {r['refused_429']}, other failures "
                          f"{r['failed_other']}, p99 TTFT {r['ttft']['p99_ms']} ms, "
                          f"median TPOT {r['tpot']['median_ms']} ms", flush=True)
        write(args, loads, meta, runs, t_start, load_before, final=True)
    finally:
        for srv in servers.values():
            srv.stop()


if __name__ == "__main__":
    main()

"""1 vs N engine replicas (`iterserve serve --data-parallel-size N`, Ray Serve) on one machine.

Each configuration is the real CLI in a subprocess (`python -m iterserve.cli serve`), driven
over HTTP by iterserve's benchmark client (bench/client.py: streamed, open loop, TTFT at the
first text chunk). `--data-parallel-size 1` is the plain single-process server, as a user
gets it; N > 1 starts a local Ray (or joins `--ray-address`) with N replicas of
`--threads-per-replica` threads (default: cores / N).

Per configuration it reports output tok/s, request throughput and TTFT / ITL percentiles,
and two overheads:
- the routing decision (replicas/request_router.py: loads + core Router.route), per
  request, from the server's own timer (/v1/engine/stats "router_decision"); target p50 <= 2 ms;
- the Ray Serve path: median latency of `--probe-requests` sequential 1-token requests,
  N replicas minus 1 replica (routing + the handle's RPC + the streamed reply).

Configurations alternate (1, N, 1, N, ...) for `--repeats` rounds, so drift in the machine's
load hits both alike; medians over rounds are reported. On a 2-core machine N replicas share
the same 2 cores: the point is correctness and overhead, not speed-up.

Validating the lab: `--workload NAME` (bench/workloads.py) or `--requests-file F`
(JSON list of {"prompt": text or token ids, "max_tokens": n, "arrival_s": t}) runs exactly
those requests and prints throughput and median TTFT per configuration, for comparison with
`iterserve lab --replicas N` on the same requests.

    PYTHONPATH=src python benchmarks/bench_replicas.py --replicas 1,2 --workload mix \
        --num-requests 32 --port 18300 --out benchmarks/results/ray-mix.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from iterserve.bench.client import ClientOptions, machine_info, run_workload  # noqa: E402
from iterserve.bench.workloads import BenchRequest, Workload, build_workload  # noqa: E402


def load_requests_file(path: str) -> Workload:
    items = json.loads(Path(path).read_text())
    reqs = []
    for i, it in enumerate(items):
        p = it["prompt"]
        reqs.append(BenchRequest(index=i, prompt=p,
                                 prompt_len=len(p) if isinstance(p, list) else
                                 int(it.get("prompt_len", len(p.split()))),
                                 max_tokens=int(it["max_tokens"]),
                                 arrival_s=float(it.get("arrival_s", 0.0)), kind="file"))
    return Workload(name=f"file:{Path(path).name}", seed=0, rate=None, requests=tuple(reqs),
                    description=f"requests from {path}")


def start_server(args: argparse.Namespace, n: int, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--data-parallel-size", str(n), "--router", args.router,
           "--log-level", "warning", "--max-num-seqs", str(args.max_num_seqs),
           "--kv-cache-memory", str(args.kv_cache_memory)]
    if args.model:
        cmd += ["--model", args.model]
    if n > 1 and args.threads_per_replica:
        cmd += ["--threads-per-replica", str(args.threads_per_replica)]
    if n > 1 and args.ray_address:
        cmd += ["--ray-address", args.ray_address]
    if args.enable_prefix_caching:
        cmd += ["--enable-prefix-caching"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    if n == 1 and args.dp1_threads:
        env["OMP_NUM_THREADS"] = str(args.dp1_threads)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.start_timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server (dp={n}) exited: {proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                proc.start_s = time.monotonic() - t0          # type: ignore[attr-defined]
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server (dp={n}) did not start in {args.start_timeout} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def probe(base: str, n: int) -> float:
    """Median seconds of `n` sequential 1-token completions (the per-request path cost)."""
    times = []
    with httpx.Client(timeout=60) as c:
        model = c.get(base + "/v1/models").json()["data"][0]["id"]
        for i in range(n):
            t = time.perf_counter()
            r = c.post(base + "/v1/completions", json={"model": model, "prompt": f"probe {i}",
                                                       "max_tokens": 1})
            r.raise_for_status()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_one(args: argparse.Namespace, workload: Workload, n: int, port: int) -> dict:
    proc = start_server(args, n, port)
    base = f"http://127.0.0.1:{port}"
    try:
        probe(base, 3)                                              # warm up
        probe_s = probe(base, args.probe_requests)
        doc = asyncio.run(run_workload(base, workload, ClientOptions(
            max_concurrency=args.max_concurrency)))
        stats = httpx.get(base + "/v1/engine/stats", timeout=30).json()
    finally:
        stop_server(proc)
    s = doc["summary"]
    return {"replicas": n, "omp_threads": (args.dp1_threads or os.environ.get("OMP_NUM_THREADS")
                                           or os.cpu_count()) if n == 1 else None,
            "start_s": round(proc.start_s, 2),   # type: ignore[attr-defined]
            "output_throughput": s["output_throughput"],
            "request_throughput": s["request_throughput"], "completed": s["completed"],
            "failed": s["failed"], "duration_s": s["duration_s"],
            "ttft": s["ttft"], "itl": s["itl"],
            "probe_1tok_median_ms": round(probe_s * 1e3, 3),
            "router_decision": stats.get("router_decision"),
            "threads_per_replica": stats.get("threads_per_replica"),
            "prefix_cache_hit_rate": stats.get("prefix_cache_hit_rate")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M GGUF")
    ap.add_argument("--replicas", default="1,2", help="comma-separated replica counts")
    ap.add_argument("--router", default="least_loaded")
    ap.add_argument("--threads-per-replica", type=int, default=None)
    ap.add_argument("--ray-address", default=None)
    ap.add_argument("--dp1-threads", type=int, default=None,
                    help="OMP_NUM_THREADS of the 1-replica server (default: unset, all "
                         "cores); on a loaded machine a 2-thread OpenMP team can collapse")
    ap.add_argument("--workload", default="mix")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--rate", type=float, default=None)
    ap.add_argument("--requests-file", default=None)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--kv-cache-memory", type=float, default=0.25)
    ap.add_argument("--enable-prefix-caching", action="store_true")
    ap.add_argument("--probe-requests", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--port", type=int, default=18300)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--out", default=None, help="JSON path (benchmarks/results/ray-*.json)")
    args = ap.parse_args()

    workload = (load_requests_file(args.requests_file) if args.requests_file else
                build_workload(args.workload, rate=args.rate, num_requests=args.num_requests))
    counts = [int(x) for x in args.replicas.split(",")]
    runs: list[dict] = []
    for rnd in range(args.repeats):
        for k, n in enumerate(counts):
            r = run_one(args, workload, n, args.port + k)
            r["round"] = rnd
            runs.append(r)
            rd = r["router_decision"] or {}
            print(f"round {rnd} replicas {n}: {r['output_throughput']:.1f} output tok/s, "
                  f"{r['request_throughput']:.2f} req/s, median TTFT "
                  f"{r['ttft']['median_ms']} ms, "
                  f"1-token probe {r['probe_1tok_median_ms']:.1f} ms, router decision p50 "
                  f"{rd.get('p50_ms', '-')} ms, failed {r['failed']}", flush=True)
    summary = {}
    for n in counts:
        mine = [r for r in runs if r["replicas"] == n]
        summary[str(n)] = {
            "output_throughput_median": statistics.median(r["output_throughput"] for r in mine),
            "ttft_median_ms_median": statistics.median(r["ttft"]["median_ms"] or 0
                                                       for r in mine),
            "probe_1tok_median_ms": statistics.median(r["probe_1tok_median_ms"] for r in mine),
        }
    if 1 in counts:
        for n in counts:
            if n != 1:
                summary[str(n)]["ray_path_overhead_ms"] = round(
                    summary[str(n)]["probe_1tok_median_ms"]
                    - summary["1"]["probe_1tok_median_ms"], 3)
                summary[str(n)]["throughput_vs_1"] = round(
                    summary[str(n)]["output_throughput_median"]
                    / summary["1"]["output_throughput_median"], 3)
    print(json.dumps(summary, indent=2))
    doc = {"benchmark": "bench_replicas", "machine": machine_info(), "args": vars(args),
           "workload": workload.summary(), "runs": runs, "summary": summary}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

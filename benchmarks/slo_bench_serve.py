"""fcfs vs slo servers under `iterserve bench serve --workload poisson`, as a user runs it.

Both servers (bundled model unless --model, `--max-num-seqs 16`, the slo one with the user's
targets as `--slo-ttft-ms` / `--slo-tpot-ms`) run side by side and are driven one at a time
by the project's own client CLI, `iterserve bench serve --workload poisson --rate R --slo
ttft:MS,itl:MS`. Capacity is measured first: the fcfs server's steady service rate at a
rate far above it (`saturated_rate`: completions between the first and third quartile of
finish times, so neither the ramp-up nor the drain, when fewer than `--max-num-seqs` run,
counts); then, per load factor, fcfs and slo get the same seeded arrivals, adjacent in
time. Per run: goodput, refused (429), the admitted requests' share within the TTFT target and
their TTFT p90/p99 (client side), and, for slo, the policy's forecast error (actual - forecast
TTFT, server side) p50/p90/p99 from /v1/engine/stats for the requests of that run.

    PYTHONPATH=src .venv/bin/python benchmarks/slo_bench_serve.py [--loads 0.5,1.5,3]
        [--requests 96] [--ttft-ms 2000 --itl-ms 150] [--workload sharegpt]
        [--client openai --max-retries 2] [--out benchmarks/results/F.json]

With `--client openai` the requests go through the official SDK, which sleeps for a 429's
Retry-After and sends again: `retried` / `served_after_retry` count those, the admitted
share and TTFT percentiles use the admitted attempt's TTFT, and goodput the application's
(from its first attempt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slo_engine import Server, stop_on_sigterm  # noqa: E402

from iterserve.bench.client import ClientOptions, machine_info, run_workload  # noqa: E402
from iterserve.bench.metrics import percentile  # noqa: E402
from iterserve.bench.workloads import build_workload  # noqa: E402


def bench(url: str, rate: float, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "iterserve.cli", "bench", "serve", "--base-url", url,
           "--workload", args.workload, "--rate", f"{rate:.3f}", "--num-requests",
           str(args.requests), "--seed", str(args.seed),
           "--slo", f"ttft:{args.ttft_ms:g},itl:{args.itl_ms:g}", "--out", str(out),
           "--client", args.client, "--max-retries", str(args.max_retries)]
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def forecast_errors(before: dict | None, after: dict | None) -> dict | None:
    """actual - forecast TTFT (ms) of the requests admitted during one run."""
    if not after or "slo" not in after:
        return None
    n0 = ((before or {}).get("slo") or {}).get("ttft_forecast", {}).get("count", 0)
    rows = [r for r in after["slo"]["ttft_forecast"]["recent"] if r[0] > n0]
    d = sorted(a - p for _, p, a in rows)
    return {"n": len(d), **{q: percentile(d, v) for q, v in
                            (("p50_ms", 50), ("p90_ms", 90), ("p99_ms", 99))}}


def saturated_rate(doc: dict) -> float:
    """Requests per second finished while the server was saturated: between the first and
    third quartile of the finish times. A whole run's throughput understates capacity (the
    last requests drain at batch sizes far below the limit), so 1.5x that figure is not
    1.5x overload."""
    done = sorted(r["start_s"] + r["e2e"] for r in doc["requests"]
                  if r.get("success") and r.get("e2e") is not None)
    lo, hi = len(done) // 4, (3 * len(done)) // 4
    if hi - lo < 4 or done[hi] <= done[lo]:
        return doc["summary"]["request_throughput"]
    return (hi - lo) / (done[hi] - done[lo])


def row(doc: dict, ttft_s: float) -> dict:
    s = doc["summary"]
    reqs = doc["requests"]
    refused = sum(1 for r in reqs if (r.get("error") or "").startswith("HTTP 429"))
    # The admitted attempt's TTFT: with a retrying client the first attempts' refusals and
    # Retry-After sleeps come before it (what the application waited is in `goodput`).
    ttfts = sorted(r["ttft_admitted"] if r.get("ttft_admitted") is not None else r["ttft"]
                   for r in reqs if r.get("success") and r.get("ttft") is not None)
    return {"completed": s["completed"], "refused": refused,
            "failed_other": s["failed"] - refused, "duration_s": s["duration_s"],
            "request_throughput": s["request_throughput"], "goodput": s["goodput"],
            "good_requests": s["good_requests"],
            "admitted_ttft_met": (sum(t <= ttft_s for t in ttfts) / len(ttfts)) if ttfts else None,
            "admitted_ttft_p90_s": percentile(ttfts, 90) if ttfts else None,
            "admitted_ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
            "itl_p99_ms": s["itl"].get("p99_ms"),
            "retried": s.get("retried", 0), "served_after_retry": s.get("served_after_retry", 0),
            "client_ttft_p99_s": percentile(sorted(r["ttft"] for r in reqs if r.get("success")
                                                   and r.get("ttft") is not None), 99)}


def main() -> None:
    stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="0.5,1.5,3")
    ap.add_argument("--workload", default="poisson",
                    help="poisson (mix lengths), sharegpt or longprompt, at each load's rate; "
                         "capacity is measured on the same workload")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--warm", type=int, default=8, help="mix requests each server serves first")
    ap.add_argument("--capacity-rate", type=float, default=8.0)
    ap.add_argument("--capacity", type=float, default=None,
                    help="req/s measured before (skips the capacity run)")
    ap.add_argument("--ttft-ms", type=float, default=2000.0)
    ap.add_argument("--itl-ms", type=float, default=150.0)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=18710)
    ap.add_argument("--model", default=None)
    ap.add_argument("--client", choices=["httpx", "openai"], default="httpx",
                    help="openai: the official SDK, retrying a 429 after its Retry-After")
    ap.add_argument("--max-retries", type=int, default=2)
    ap.add_argument("--serve-arg", action="append")
    ap.add_argument("--log-dir", default=tempfile.gettempdir())
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/slo-bench-serve.json"))
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    base = ["--max-num-seqs", str(args.max_num_seqs)]
    servers = {
        "fcfs": Server(args.port, base + ["--scheduling-policy", "fcfs"], args, "fcfs"),
        "slo": Server(args.port + 1, base + ["--scheduling-policy", "slo", "--slo-ttft-ms",
                                              f"{args.ttft_ms:g}", "--slo-tpot-ms",
                                              f"{args.itl_ms:g}"], args, "slo")}
    t_start = time.time()
    doc = {"machine_before": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
           "runs": []}
    tmp = Path(tempfile.mkdtemp())
    try:
        for s in servers.values():
            s.wait_ready()
        for name, s in servers.items():      # the same warm-up for both: a few mix requests
            w = build_workload("mix", seed=args.seed + 7, rate=None, num_requests=args.warm)
            asyncio.run(run_workload(s.url, w, ClientOptions()))
        if args.capacity is None:
            cap_doc = bench(servers["fcfs"].url, args.capacity_rate, args, tmp / "cap.json")
            capacity = saturated_rate(cap_doc)
            doc["capacity_run_throughput_rps"] = cap_doc["summary"]["request_throughput"]
        else:
            capacity = args.capacity
        doc["capacity_rps"] = capacity
        print(f"capacity (fcfs saturated at {args.capacity_rate} req/s offered): "
              f"{capacity:.3f} req/s",
              flush=True)
        for load in loads:
            rate = load * capacity
            for name, s in servers.items():
                before = s.stats()
                res = bench(s.url, rate, args, tmp / f"{name}-{load}.json")
                r = {"load": load, "rate": rate, "policy": name, **row(res, args.ttft_ms / 1000)}
                if name == "slo":
                    r["forecast_error"] = forecast_errors(before, s.stats())
                doc["runs"].append(r)
                print(json.dumps(r), flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(doc, indent=1) + "\n")
    finally:
        for s in servers.values():
            s.stop()
    doc["machine_after"] = machine_info()
    doc["wall_s"] = time.time() - t_start
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

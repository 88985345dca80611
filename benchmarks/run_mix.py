"""Run `mix` on iterserve and its peers in one run, write JSON and the BENCHMARKS.md table.

Why one orchestrating script: on a small shared machine absolute figures drift with
whatever else runs, so the engines are measured back to back in the same run and the
report leads with ratios to one reference (llama-server F16 with 8 slots). Each engine runs
alone (one server at a time), gets a short warm-up, then the same fixed-seed workload.

Engines (each skipped with a note when it cannot run here):
- iterserve (`iterserve serve`, default model, float32) at each --iterserve-slots value;
- llama-server Q4_1 and F16 (`benchmarks/peers/llama_server.py`) at each --llama-slots value;
- HF transformers static `generate` groups and HF continuous batching (offline, float32);
- vLLM on a GPU device machine only (benchmarks/peers/vllm_gpu.py).

    python benchmarks/run_mix.py                       # 8 slots each
    python benchmarks/run_mix.py --iterserve-slots 8,16,32 --llama-slots 8,16,32
    python benchmarks/run_mix.py --workload poisson --rate 2 --skip hf --llama-quants f16

Other workloads (`--workload poisson|longprompt|sharegpt`) run the servers only: the HF
peers replay `mix` offline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

import httpx  # noqa: E402

from iterserve.bench.client import machine_info, run_workload  # noqa: E402
from iterserve.bench.workloads import build_workload  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
REFERENCE = "llama-server F16 -np 8"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout_s}s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench_server(label: str, cmd: list[str], url: str, health: str, workload, log: Path) -> dict:
    """Start a server, warm it up, run the workload, stop it."""
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, url, health, 300)
            asyncio.run(run_workload(url, build_workload("mix", num_requests=2, seed=99)))
            doc = asyncio.run(run_workload(url, workload))
        finally:
            _stop(proc)
    doc["engine"] = label
    return doc


def run_iterserve(slots: int, workload, out_dir: Path) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--port", str(port),
           "--max-num-seqs", str(slots), "--log-level", "warning"]
    return bench_server(f"iterserve -max-num-seqs {slots}", cmd, f"http://127.0.0.1:{port}",
                        "/v1/models", workload, out_dir / f"iterserve_{slots}.log")


def run_llama(quant: str, slots: int, workload, out_dir: Path) -> dict:
    import llama_server as ls

    port = _free_port()
    # Every slot must hold the workload's longest request, or llama-server truncates the
    # prompt (it did on `longprompt` with 1,024 tokens per slot) and does less work.
    longest = max(r.prompt_len + r.max_tokens for r in workload.requests)
    ctx = max(1024, -(-(longest + 64) // 256) * 256)
    cmd = ls.server_command(quant, port, slots, threads=2, ctx_per_slot=ctx)
    return bench_server(f"llama-server {quant.upper()} -np {slots}", cmd,
                        f"http://127.0.0.1:{port}", "/health", workload,
                        out_dir / f"llama_{quant}_{slots}.log")


def run_hf(mode: str, slots: int, out_dir: Path, num_requests: int | None) -> dict:
    out = out_dir / f"hf_{mode}_{slots}.json"
    extra = ["--num-requests", str(num_requests)] if num_requests else []
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers" / "hf_transformers.py"),
                    "--mode", mode, "--max-num-seqs", str(slots), "--out", str(out), *extra],
                   check=True)
    doc = json.loads(out.read_text())
    out.unlink()                      # run_mix writes it again under the engine's label
    doc["engine"] = f"HF {'static generate' if mode == 'static' else 'continuous batching'} {slots}"
    return doc


def row(doc: dict) -> dict:
    """The figures of one engine, from a serve result or an offline peer result."""
    load = ((doc.get("machine") or {}).get("loadavg") or [None])[0]
    return {**_figures(doc), "load_1m": load}


def _figures(doc: dict) -> dict:
    if "summary" in doc:
        s = doc["summary"]
        return {"engine": doc["engine"], "output_tok_s": s["output_throughput"],
                "total_tok_s": s["total_token_throughput"], "duration_s": s["duration_s"],
                "ttft_p50_ms": s["ttft"]["median_ms"], "ttft_p99_ms": s["ttft"]["p99_ms"],
                "itl_p50_ms": s["itl"]["median_ms"], "itl_p99_ms": s["itl"]["p99_ms"],
                "failed": s["failed"]}
    return {"engine": doc["engine"], "output_tok_s": doc["output_throughput"],
            "total_tok_s": doc["total_token_throughput"], "duration_s": doc["wall_s"],
            "ttft_p50_ms": None, "ttft_p99_ms": None, "itl_p50_ms": None, "itl_p99_ms": None,
            "failed": 0}


def markdown(rows: list[dict], notes: list[str], machine: dict) -> str:
    ref = next((r for r in rows if r["engine"] == REFERENCE), None)
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    lines = ["| engine | output tok/s | vs " + REFERENCE + " | total tok/s | wall s "
             "| TTFT p50 / p99 ms | ITL p50 / p99 ms | load 1m |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -r["output_tok_s"]):
        ratio = f"{r['output_tok_s'] / ref['output_tok_s']:.2f}x" if ref else "-"
        lines.append(f"| {r['engine']} | {r['output_tok_s']:.1f} | {ratio} | "
                     f"{r['total_tok_s']:.1f} | {r['duration_s']:.1f} | "
                     f"{fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p99_ms'])} | "
                     f"{fmt(r['itl_p50_ms'])} / {fmt(r['itl_p99_ms'])} | "
                     f"{fmt(r.get('load_1m'))} |")
    lines.append("")
    lines.append(f"Machine: {machine['cpu']}, {machine['cpus_usable']} usable CPUs "
                 f"({machine['platform']}), load average {machine.get('loadavg')}.")
    lines.append("- load 1m: the machine's 1-minute load average when that engine's run ended "
                 "(its own 2 threads count ~2); a higher figure means other work competed.")
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterserve-slots", default="8")
    ap.add_argument("--llama-slots", default="8")
    ap.add_argument("--hf-slots", default="8")
    ap.add_argument("--skip", default="", help="comma list: iterserve,llama,hf")
    ap.add_argument("--workload", default="mix", help="mix, poisson, longprompt or sharegpt")
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    ap.add_argument("--llama-quants", default="f16,q4_1", help="llama-server weights to run")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="a smaller mix (same 80/20 rule, same seed); default 48")
    ap.add_argument("--tag", default=time.strftime("%Y%m%d-%H%M%S"))
    ap.add_argument("--render", type=Path, nargs="+", default=None, metavar="DIR",
                    help="only rebuild the table from the engine JSONs in these result dirs")
    args = ap.parse_args(argv)
    if args.render:
        docs = [json.loads(p.read_text()) for d in args.render for p in sorted(d.glob("*.json"))]
        docs = [d for d in docs if "engine" in d]
        notes = json.loads((args.render[0] / "summary.json").read_text())["notes"]
        print(markdown([row(d) for d in docs], notes, docs[0]["machine"]))
        return 0
    skip = set(filter(None, args.skip.split(",")))
    out_dir = RESULTS / f"{args.workload}-{args.tag}"
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    w = build_workload(args.workload, num_requests=args.num_requests, rate=args.rate)
    if args.workload != "mix":
        skip.add("hf")
    docs, notes = [], []

    def attempt(label, fn, *a):
        try:
            doc = fn(*a)
        except Exception as e:      # one peer failing must not lose the others' figures
            notes.append(f"{label}: not measured ({type(e).__name__}: {e})")
            print(notes[-1], file=sys.stderr)
            return
        docs.append(doc)
        name = doc["engine"].replace(" ", "_").replace("/", "_")
        (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=1))
        print(json.dumps(row(doc)), flush=True)

    if "llama" not in skip:
        for slots in _ints(args.llama_slots):
            for quant in filter(None, args.llama_quants.split(",")):
                attempt(f"llama-server {quant} -np {slots}", run_llama, quant, slots, w, out_dir)
    if "iterserve" not in skip:
        for slots in _ints(args.iterserve_slots):
            attempt(f"iterserve {slots}", run_iterserve, slots, w, out_dir)
    if "hf" not in skip:
        for slots in _ints(args.hf_slots):
            attempt(f"HF continuous {slots}", run_hf, "continuous", slots, out_dir,
                    args.num_requests)
            attempt(f"HF static {slots}", run_hf, "static", slots, out_dir,
                    args.num_requests)
    from vllm_gpu import skip_reason
    if (reason := skip_reason()):
        notes.append(f"vLLM: skipped ({reason})")
    else:
        notes.append("vLLM: run benchmarks/peers/vllm_gpu.py on the device machine")
    notes.append("iterserve and llama-server are measured over HTTP with `iterserve bench "
                 "serve` (streaming); the HF peers run offline in-process (no HTTP), so their "
                 "figures carry no per-token latencies.")
    rows = [row(d) for d in docs]
    summary = {"kind": f"{args.workload}-comparison", "tag": args.tag, "machine": machine_info(),
               "workload": w.summary(), "rows": rows, "notes": notes}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    md = markdown(rows, notes, summary["machine"])
    (out_dir / "table.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

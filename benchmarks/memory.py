"""Memory and load time of real-shaped models, iterserve beside its peers in one run (not CI).

Each engine serves the same weights as a real server process, one process at a time (the
machine is small and shared), with the same KV budget (`--slots` sequences x `--ctx` tokens,
f16 KV where the engine lets us choose):

- iterserve: `iterserve serve --model M --max-num-seqs S --max-model-len C --num-kv-blocks
  S*C/16 --kv-cache-dtype float16` (llama.cpp's KV is f16 by default);
- llama-server (GGUF only): `-np S -c S*C -t 2`, f16 KV (benchmarks/peers/llama_server.py);
- vLLM's CPU build (HF safetensors only, it does not take these GGUFs on CPU):
  `--max-num-seqs S --max-model-len C`, KV space `VLLM_CPU_KVCACHE_SPACE` = the budget
  rounded up to whole GiB (vLLM reads it as an int), bf16 KV (benchmarks/peers/vllm_cpu.py).

Measured per row:
- `load_s`: process start to the end of a one-token completion (the model is loaded, the KV
  allocated and one forward pass done);
- `rss_at_load_bytes`: RSS of the server's process tree (vLLM forks an engine core) right
  after that first token; `peak_rss_bytes`: the largest tree RSS a 0.1 s sampler saw from
  process start to the end of the workload, and `vm_hwm_bytes` the kernel's high-water mark
  of the main process (both count file-backed mapped weight pages: what the machine pays);
- the fixed workload: decode at batch 1 (one request, 32-token prompt, 64 tokens) then batch
  8 (8 at once, same lengths), `ignore_eos`, through one OpenAI streaming client
  (iterserve.bench.client); `decode_tok_s` = batch / median inter-token gap.
The memory budget is printed beside each row: 1.15 x file + KV + 400 MB.

Load time (the bar: <= 1.5 x llama-server's on the same file) is noisy on a shared machine:
`--repeats N` starts every engine N times, alternating engines within each repeat, and
reports the medians and iterserve's same-run ratio (`load_ratio_vs_llama_server`);
`--load-only` skips the decode workload; `--baseline-src DIR` adds iterserve from another
source tree (engine `iterserve-baseline`) for a same-run before/after. Each iterserve row
also splits `load_s` into `ready_s` (until /health answers) + `first_request_s`, and
`phases_s` from iterserve's `startup <phase> <s> s` log lines (model/startup.py: imports,
torch, metadata, tokenizer, weights, kv_alloc, runner).

    python benchmarks/memory.py --model smollm2-1.7b --formats Q4_K_M Q4_0 hf-bf16 \
        --engines iterserve llama-server vllm-cpu --out benchmarks/results/memory.json
Figures are taken on whatever load the machine has: the JSON records the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(HERE.parent / "src"))
import models  # noqa: E402

MB = 1 << 20
ENGINES = ("iterserve", "llama-server", "vllm-cpu")
BASELINE = "iterserve-baseline"      # --baseline-src: iterserve from another tree, alternated


# --- what a process tree holds ---------------------------------------------------------------

def _status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_pids(root: int) -> list[int]:
    """`root` and every descendant (vLLM's engine core is a child of the API server)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def tree_rss(root: int) -> int:
    return sum(_status_kb(p, "VmRSS") for p in tree_pids(root)) * 1024


class RssSampler(threading.Thread):
    """The largest tree RSS seen, every `interval` seconds, until stopped."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak = pid, interval, 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self._done.wait(self.interval)

    def stop(self) -> int:
        self._done.set()
        self.join(timeout=5)
        return self.peak


# --- the engines' command lines --------------------------------------------------------------

def iterserve_command(model: Path, port: int, slots: int, ctx: int, block_size: int = 16) -> list[str]:
    return [sys.executable, "-m", "iterserve.cli", "serve", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(slots),
            "--max-model-len", str(ctx), "--num-kv-blocks", str(slots * ctx // block_size),
            "--block-size", str(block_size), "--kv-cache-dtype", "float16",
            "--log-level", "info"]


def llama_server_command(model: Path, port: int, slots: int, ctx: int) -> list[str]:
    """peers/llama_server.command (its -b 2048 -ub 512 are llama-server's defaults)."""
    import llama_server as peer
    return peer.command(model, port, slots, threads=2, ctx_per_slot=ctx,
                        binary=peer.BIN_DIR / "llama-server")


def kv_bytes(name: str, tokens: int, elem_bytes: int = 2) -> int:
    c = models.hf_config(name)
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * elem_bytes * tokens


def file_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return path.stat().st_size


# --- one engine on one file -----------------------------------------------------------------

def _workload(batch: int, prompt_len: int, max_tokens: int, seed: int):
    import random

    from iterserve.bench.workloads import BenchRequest, Workload, make_prompt
    rng = random.Random(seed)
    reqs = tuple(BenchRequest(index=i, prompt=make_prompt(prompt_len, rng), prompt_len=prompt_len,
                              max_tokens=max_tokens, arrival_s=0.0, kind="short")
                 for i in range(batch))
    return Workload(name=f"decode-b{batch}", seed=seed, rate=None, requests=reqs,
                    description=f"{batch} x ({prompt_len} prompt, {max_tokens} out) at t=0")


def _decode_phase(url: str, batch: int, max_tokens: int) -> dict:
    from iterserve.bench.client import ClientOptions, run_workload
    doc = asyncio.run(run_workload(url, _workload(batch, 32, max_tokens, seed=batch),
                                   ClientOptions(request_timeout_s=600)))
    reqs = doc["requests"]
    ok = [r for r in reqs if r.get("success")]
    gaps = [g for r in ok for g in (r.get("itl") or [])]
    med = statistics.median(gaps) if gaps else None
    return {"batch": batch, "ok": len(ok) == batch, "errors": [r.get("error") for r in reqs if not r.get("success")][:3],
            "median_itl_ms": None if med is None else round(med * 1e3, 2),
            "decode_tok_s": None if not med else round(batch / med, 2),
            "output_tok_s": doc["summary"].get("output_throughput"),
            "duration_s": doc["summary"].get("duration_s")}


def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float) -> str | None:
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode} before it was ready"
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return f"not ready after {timeout_s} s"


def _first_token(url: str) -> str | None:
    import httpx
    try:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        r = httpx.post(url + "/v1/completions", timeout=900, json={
            "model": model, "prompt": "Hello there", "max_tokens": 1, "temperature": 0})
        return None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:300]}"
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def _stop(proc: subprocess.Popen) -> None:
    """End the server's whole session group (vLLM forks an engine core), as the peers do."""
    from vllm_cpu import stop_server
    stop_server(proc)


def run_engine(engine: str, model: Path, name: str, *, port: int, slots: int, ctx: int,
               max_tokens: int, log_dir: Path, vllm_threads_bind: str | None,
               load_only: bool = False, baseline_src: Path | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    kv = kv_bytes(name, slots * ctx)
    info: dict = {"engine": engine}
    if engine == BASELINE:                  # the same command on another source tree
        env["PYTHONPATH"] = str(baseline_src)
        info["src"] = str(baseline_src)
        cmd = iterserve_command(model, port, slots, ctx)
    elif engine == "iterserve":
        cmd = iterserve_command(model, port, slots, ctx)
    elif engine == "llama-server":
        if model.is_dir():
            return {**info, "ok": False, "skipped": "llama-server serves GGUF only"}
        cmd = llama_server_command(model, port, slots, ctx)
    else:
        import vllm_cpu
        if not model.is_dir():
            return {**info, "ok": False, "skipped": "vLLM CPU is run on the HF safetensors only"}
        if not vllm_cpu.installed():
            return {**info, "ok": False, "skipped": f"vllm-cpu not installed ({vllm_cpu.VENV}): "
                                                    "benchmarks/peers/vllm_cpu.py setup"}
        kv_gib = kv / (1 << 30)
        cmd = vllm_cpu.server_command(model, port, slots, ctx)
        env = vllm_cpu.server_env(kv_gib, vllm_threads_bind)
        kv = vllm_cpu.kv_space_gib(kv_gib) << 30
        info["threads_bind"] = vllm_threads_bind or "default (one core for the front end)"
    info.update(command=cmd, kv_bytes=kv)
    log = log_dir / f"{engine}-{model.name}.log"
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    sampler = RssSampler(proc.pid)
    sampler.start()
    try:
        err = _wait_ready(proc, url, timeout_s=900 if engine == "vllm-cpu" else 300)
        t_ready = time.monotonic()
        err = err or _first_token(url)
        if err:
            return {**info, "ok": False, "error": err, "log_tail": log.read_text()[-1500:]}
        info["load_s"] = round(time.monotonic() - t0, 2)
        # ready: /health answers (model loaded, KV allocated); the rest is the first request
        info["ready_s"] = round(t_ready - t0, 2)
        info["first_request_s"] = round(info["load_s"] - info["ready_s"], 2)
        info["rss_at_load_bytes"] = tree_rss(proc.pid)
        if engine in ("iterserve", BASELINE):
            info["phases_s"] = load_phases(log.read_text())
        info["decode"] = [] if load_only else [_decode_phase(url, b, max_tokens) for b in (1, slots)]
        info["rss_after_workload_bytes"] = tree_rss(proc.pid)
        info["vm_hwm_bytes"] = _status_kb(proc.pid, "VmHWM") * 1024
        info["ok"] = all(d["ok"] for d in info["decode"])
    finally:
        try:
            info["peak_rss_bytes"] = sampler.stop()
        finally:
            _stop(proc)
    return info


def load_phases(log_text: str) -> dict[str, float]:
    """iterserve's `startup <phase> <seconds> s` log lines (model/startup.py), in order."""
    import re
    out: dict[str, float] = {}
    for m in re.finditer(r"startup (\S+)\s+([0-9.]+) s", log_text):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _record(row: dict, engine: str, r: dict) -> None:
    """The first successful run keeps its full record; later ones add their load times."""
    prev = row["engines"].get(engine)
    if prev is None or (not prev.get("ok") and r.get("ok")):
        row["engines"][engine] = {**r, "runs": (prev or {}).get("runs", [])}
        prev = row["engines"][engine]
    if r.get("ok"):
        prev["runs"].append({k: r.get(k) for k in ("load_s", "ready_s", "first_request_s",
                                                  "rss_at_load_bytes",
                                                  "peak_rss_bytes", "phases_s")})


def _summarise(row: dict, fmt: str) -> None:
    """Median load time per engine over the repeats, and iterserve's ratio to llama-server."""
    med = {}
    for engine, r in row["engines"].items():
        loads = [x["load_s"] for x in r.get("runs", []) if x.get("load_s") is not None]
        if loads:
            r["load_s_median"] = med[engine] = round(statistics.median(loads), 2)
            phases = [x["phases_s"] for x in r["runs"] if x.get("phases_s")]
            if phases:
                r["phases_s_median"] = {k: round(statistics.median(p.get(k, 0.0) for p in phases), 2)
                                        for k in phases[0]}
    if "iterserve" in med and "llama-server" in med and med["llama-server"] > 0:
        row["load_ratio_vs_llama_server"] = round(med["iterserve"] / med["llama-server"], 2)
    if "iterserve" in med and BASELINE in med and med[BASELINE] > 0:
        row["load_ratio_vs_baseline"] = round(med["iterserve"] / med[BASELINE], 2)
    if med:
        n = max(len(r.get("runs", [])) for r in row["engines"].values())
        print(f"{fmt:10s} median load over {n} run(s): "
              + ", ".join(f"{e} {v:.2f} s" for e, v in med.items())
              + (f"; iterserve / llama-server {row['load_ratio_vs_llama_server']}"
                 if "load_ratio_vs_llama_server" in row else "")
              + (f"; iterserve / baseline {row['load_ratio_vs_baseline']}"
                 if "load_ratio_vs_baseline" in row else ""), flush=True)


def resolve(name: str, fmt: str) -> Path:
    d = models.model_dir(name)
    if fmt == "hf-bf16":
        return d / "hf-bf16"
    return d / (fmt if fmt.endswith(".gguf") else f"{name}.{fmt}.gguf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-1.7b", choices=sorted(models.SHAPES))
    ap.add_argument("--formats", nargs="+", default=["Q4_K_M", "Q4_0", "hf-bf16"],
                    help="GGUF types made by `models.py make --recipe convert` (files "
                         "<name>.<TYPE>.gguf), a file name in the model folder, or hf-bf16")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=18810)
    ap.add_argument("--vllm-threads-bind", default=None, help="e.g. 0-1 (default: vLLM's own)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "memory.json")
    ap.add_argument("--repeats", type=int, default=1,
                    help="start each engine this many times, alternating engines; load_s "
                         "is then the median (the decode workload runs on the first only)")
    ap.add_argument("--baseline-src", type=Path, default=None, metavar="DIR",
                    help="also run iterserve from this source tree (e.g. `git archive` of "
                         "main, extracted) as engine iterserve-baseline, alternated with the "
                         "others: a same-run before/after")
    ap.add_argument("--load-only", action="store_true",
                    help="skip the decode workload: load time and RSS at load only")
    args = ap.parse_args(argv)
    if args.baseline_src is not None:
        args.baseline_src = args.baseline_src.resolve()
        args.engines = [*args.engines, BASELINE]
    from iterserve.bench.client import machine_info

    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "iterserve-memory-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for fmt in args.formats:
        path = resolve(args.model, fmt)
        if not path.exists():
            rows.append({"format": fmt, "ok": False, "error": f"{path} missing: run models.py make"})
            continue
        size = file_bytes(path)
        kv = kv_bytes(args.model, args.slots * args.ctx)
        row = {"model": args.model, "format": fmt, "file": path.name, "file_bytes": size,
               "types": models.type_census(path) if path.suffix == ".gguf" else {"BF16": "all"},
               "kv_tokens": args.slots * args.ctx, "kv_f16_bytes": kv,
               "budget_bytes": int(1.15 * size + kv + 400 * MB), "engines": {}}
        for rep in range(args.repeats):
            # Engines alternate within each repeat, so a change of machine load hits both;
            # the decode workload runs on the first repeat only (load time is what repeats).
            for engine in args.engines:
                r = run_engine(engine, path, args.model, port=models.free_port(args.port),
                               slots=args.slots, ctx=args.ctx, max_tokens=args.max_tokens,
                               log_dir=log_dir, vllm_threads_bind=args.vllm_threads_bind,
                               load_only=args.load_only or rep > 0,
                               baseline_src=args.baseline_src)
                _record(row, engine, r)
                if r.get("skipped"):
                    continue
                if not r.get("ok"):
                    print(f"{fmt:10s} {engine:13s} FAILED: {r.get('error')}", flush=True)
                    continue
                dec = "".join(f" b{d['batch']} {d['decode_tok_s']}" for d in r["decode"])
                phases = "".join(f" {k} {v:.2f}" for k, v in (r.get("phases_s") or {}).items())
                print(f"{fmt:10s} {engine:13s} file {size / 1e9:5.2f} GB  load {r['load_s']:6.1f} s "
                      f"(ready {r['ready_s']:.1f} + first {r['first_request_s']:.1f})  "
                      f"rss@load {r['rss_at_load_bytes'] / 1e9:5.2f} GB  peak {r['peak_rss_bytes'] / 1e9:5.2f} GB "
                      f"(budget {row['budget_bytes'] / 1e9:5.2f})"
                      + (f"  decode{dec} tok/s" if dec else "")
                      + (f"  phases:{phases}" if phases else ""), flush=True)
        _summarise(row, fmt)
        rows.append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "machine": machine_info(), "load_avg_at_end": os.getloadavg(),
            "slots": args.slots, "ctx": args.ctx, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "load_only": args.load_only,
            "note": "one server process at a time; RSS includes mapped weight pages",
            "rows": rows}, indent=1))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

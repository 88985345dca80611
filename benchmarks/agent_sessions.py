"""Multi-turn agent sessions (`agent` workload) on iterserve and llama-server, one client.

Why: an agent resends its system prompt, tools and the whole conversation every turn, so
what a turn costs is what the server can reuse of the last one. Each case runs the same
fixed-seed sessions (bench/workloads.py `agent`: 8 sessions x 10 turns, a shared 2,000-token
system prompt, ~300 tokens of tool output and a short answer a turn) through the same
closed-loop client (bench/sessions.py), one server at a time, on the same model file:

- `warm`: iterserve (prefix caching, its default) and llama-server with its best cache
  settings for this traffic (`--cache-reuse 256`, its prompt cache, slots = sessions);
  TTFT of turns >= 2 is the prefix reuse.
- `restart`: iterserve with `--kv-offload-dir`, stopped (SIGTERM) after turn 5 and started
  again on the same directory for turns 6-10; `restart-cold`: the same without the disk
  tier. Turns 6-10 against `warm`'s.
- `small-pool`: a KV pool of 25% of what the sessions need, alone, with a RAM tier that holds
  the rest (`small-pool-ram`, `--kv-offload-ram-gib`) and with the disk tier
  (`small-pool-disk`): later turns must come back from somewhere.

    python benchmarks/agent_sessions.py                       # everything, bundled model
    python benchmarks/agent_sessions.py --cases warm --engines iterserve,llama-server
    python benchmarks/agent_sessions.py --model ~/.cache/iterserve-models/<1.7B>.gguf
    python benchmarks/agent_sessions.py --smoke               # 2 short sessions, checks the script

llama-server is `benchmarks/peers/llama_server.py`'s build (`setup` first, ~12 min on 2
cores). The JSON (`--out`) holds every case's result document and the summary rows.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

import httpx  # noqa: E402

from iterserve.bench.client import ClientOptions, machine_info, run_workload  # noqa: E402
from iterserve.bench.sessions import run_sessions, ttft_over_turns  # noqa: E402
from iterserve.bench.workloads import Workload, agent, build_workload  # noqa: E402

CASES = ("warm", "restart", "restart-cold", "small-pool", "small-pool-ram", "small-pool-disk")
CACHE_REUSE = 256               # llama-server --cache-reuse: min chunk reused by KV shifting


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process: started, health-checked, warmed up, stopped."""

    def __init__(self, label: str, cmd: list[str], port: int, log: Path) -> None:
        self.label, self.cmd, self.url, self.log = label, cmd, f"http://127.0.0.1:{port}", log

    def __enter__(self) -> "Server":
        self.out = open(self.log, "a")
        self.proc = subprocess.Popen(self.cmd, stdout=self.out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.label} not healthy after 600 s; see {self.log}")
            time.sleep(0.5)
        # One short unrelated request: kernels built, first-call costs paid, nothing cached
        # that the sessions could reuse (its prompt is drawn from another seed).
        w = build_workload("mix", num_requests=1, seed=99)
        w = dataclasses.replace(w, requests=tuple(dataclasses.replace(r, max_tokens=4)
                                                  for r in w.requests))
        asyncio.run(run_workload(self.url, w))
        return self

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.out.close()


def kv_bytes_per_token(model: Path) -> int:
    """float32 K/V bytes one token takes in iterserve's pool (for sizing the small pool)."""
    from iterserve.model.gguf_loader import load_gguf
    from iterserve.model.config import ModelConfig
    import torch
    hf, _, _ = load_gguf(model, tokenizer=False)
    cfg = ModelConfig.from_hf(hf, torch.float32)
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4


def sessions_tokens(w: Workload) -> int:
    """Tokens the sessions hold at their end (each one's last prompt + answer)."""
    last: dict[int, int] = {}
    for r in w.requests:
        last[r.session] = max(last.get(r.session, 0), r.prompt_len + r.max_tokens)
    return sum(last.values())


def iterserve_cmd(a, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "iterserve.cli", "serve", "--model", str(a.model),
            "--port", str(port), "--max-model-len", str(a.max_model_len),
            "--max-num-seqs", str(max(8, a.conversations)), "--log-level", "warning",
            "--enable-prompt-tokens-details", *a.iterserve_args.split(), *extra]


def llama_cmd(a, port: int) -> list[str]:
    import llama_server as ls
    cmd = ls.command(a.model, port, slots=a.conversations, threads=a.threads,
                     ctx_per_slot=a.max_model_len)
    return cmd + ["--cache-reuse", str(CACHE_REUSE)]


def run_case(case: str, engine: str, a, w: Workload, work: Path) -> dict:
    opts = ClientOptions(request_timeout_s=3600)
    half = (a.turns + 1) // 2
    log = work / f"{case}-{engine}.log"
    port = free_port()
    kv_dir = work / f"kv-{case}"
    pool_tokens = sessions_tokens(w)
    all_kv_gib = f"{pool_tokens * kv_bytes_per_token(a.model) * 1.1 / (1 << 30):.3f}"
    extra = ["--kv-cache-memory", all_kv_gib]
    if case.startswith("small-pool"):
        blocks = -(-int(pool_tokens * 0.25) // 16)
        extra = ["--num-kv-blocks", str(max(blocks, -(-a.max_model_len // 16)))]
    if case in ("restart", "small-pool-disk"):
        extra += ["--kv-offload-dir", str(kv_dir), "--kv-offload-gib", str(a.kv_offload_gib)]
    if case == "small-pool-ram":
        extra += ["--kv-offload-ram-gib", all_kv_gib]        # room for every session
    if engine == "llama-server":
        cmd, label = llama_cmd(a, port), f"llama-server -np {a.conversations} --cache-reuse {CACHE_REUSE}"
    else:
        cmd, label = iterserve_cmd(a, port, extra), "iterserve " + " ".join(extra)
    print(f"[{case}] {label}", flush=True)
    if case.startswith("restart"):
        with Server(label, cmd, port, log) as s:
            before = asyncio.run(run_sessions(s.url, w, opts, turns=(1, half)))
        with Server(label, cmd, port, log) as s:          # the same port and directory
            doc = asyncio.run(run_sessions(s.url, w, opts, turns=(half + 1, a.turns)))
        doc["before_restart"] = before
    else:
        with Server(label, cmd, port, log) as s:
            doc = asyncio.run(run_sessions(s.url, w, opts))
            if engine == "iterserve":
                doc["engine_stats"] = httpx.get(s.url + "/v1/engine/stats", timeout=30).json()
    shutil.rmtree(kv_dir, ignore_errors=True)
    doc.update(case=case, engine=engine, label=label)
    return doc


def row(doc: dict, half: int, turns: int) -> dict:
    reqs = [r for r in doc["requests"] if r["success"]]
    prompt = sum(r["prompt_len"] for r in reqs)
    cached = sum(r["cached_tokens"] or 0 for r in reqs)
    return {"case": doc["case"], "engine": doc["engine"],
            "ttft_p50_turns_ge2_ms": ttft_over_turns(doc, 2, turns),
            "ttft_p99_turns_ge2_ms": ttft_over_turns(doc, 2, turns, "p99_ms"),
            "ttft_p50_later_turns_ms": ttft_over_turns(doc, half + 1, turns),
            "output_tok_s": doc["summary"]["output_throughput"],
            "prefix_hit_tokens": cached, "prompt_tokens": prompt,
            "failed": doc["summary"]["failed"],
            "load_1m": (doc["machine"].get("loadavg") or [None])[0]}


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None,
                    help="a GGUF file both engines serve (default: the bundled Q4_1)")
    ap.add_argument("--engines", default="iterserve,llama-server")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--conversations", type=int, default=8, help="agent sessions run at once")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-len", type=int, default=2000)
    ap.add_argument("--tool-len", default="250,350", help="MIN,MAX tokens of tool output a turn")
    ap.add_argument("--answer-len", default="20,60", help="MIN,MAX tokens of each answer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t / -tb")
    ap.add_argument("--kv-offload-gib", type=float, default=8.0)
    ap.add_argument("--iterserve-args", default="", help="extra `iterserve serve` flags")
    ap.add_argument("--smoke", action="store_true",
                    help="2 sessions x 3 short turns: runs every case quickly")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.model is None:
        import llama_server as ls
        a.model = ls.default_gguf()
    if a.smoke:
        a.conversations, a.turns, a.max_model_len = 2, 3, 1024
        w = agent(seed=a.seed, num_requests=2, num_turns=3, system_len=200,
                  tool_len=(30, 50), answer_len=(4, 8))
    else:
        w = agent(seed=a.seed, num_requests=a.conversations, num_turns=a.turns,
                  system_len=a.system_len, tool_len=_pair(a.tool_len),
                  answer_len=_pair(a.answer_len))
    longest = max(r.prompt_len + r.max_tokens for r in w.requests)
    if longest > a.max_model_len:
        ap.error(f"the sessions reach {longest} tokens; raise --max-model-len")
    engines = [e for e in a.engines.split(",") if e]
    cases = [c for c in a.cases.split(",") if c]
    bad = set(cases) - set(CASES) or set(engines) - {"iterserve", "llama-server"}
    if bad:
        ap.error(f"unknown {sorted(bad)}")
    work = Path(tempfile.mkdtemp(prefix="agent-sessions-"))
    half = (a.turns + 1) // 2
    docs, rows = [], []
    try:
        for case in cases:
            for engine in engines:
                if engine == "llama-server" and case != "warm":
                    continue                         # the peer's case is the warm one
                doc = run_case(case, engine, a, w, work)
                docs.append(doc)
                rows.append(row(doc, half, a.turns))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by = {(r["case"], r["engine"]): r for r in rows}
    ratios = {}
    it, ll = by.get(("warm", "iterserve")), by.get(("warm", "llama-server"))
    if it and ll and ll["ttft_p50_turns_ge2_ms"]:
        ratios["warm_ttft_p50_turns_ge2_iterserve_over_llama"] = round(
            it["ttft_p50_turns_ge2_ms"] / ll["ttft_p50_turns_ge2_ms"], 3)
    for case in ("restart", "restart-cold"):
        r = by.get((case, "iterserve"))
        if r and it and it["ttft_p50_later_turns_ms"]:
            ratios[f"{case}_ttft_p50_later_turns_over_warm"] = round(
                r["ttft_p50_later_turns_ms"] / it["ttft_p50_later_turns_ms"], 3)
    r, c = by.get(("restart", "iterserve")), by.get(("restart-cold", "iterserve"))
    if r and c and c["ttft_p50_later_turns_ms"]:
        ratios["restart_over_restart_cold"] = round(
            r["ttft_p50_later_turns_ms"] / c["ttft_p50_later_turns_ms"], 3)
    s = by.get(("small-pool", "iterserve"))
    for case in ("small-pool-ram", "small-pool-disk"):
        r = by.get((case, "iterserve"))
        if s and r and s["ttft_p50_later_turns_ms"]:
            ratios[f"{case.replace('-', '_')}_over_small_pool"] = round(
                r["ttft_p50_later_turns_ms"] / s["ttft_p50_later_turns_ms"], 3)
    report = {"kind": "agent-sessions", "model": str(a.model), "machine": machine_info(),
              "workload": w.summary(), "smoke": a.smoke, "rows": rows, "ratios": ratios,
              "runs": docs}
    print(json.dumps({"ratios": ratios}, indent=1))
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

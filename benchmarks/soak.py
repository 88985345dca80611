"""Soak (issue 15, not in CI): steady load for N minutes with the server's RSS sampled, then a
burst of abandoned requests; JSON out.

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--abandon 10000] [--model PATH]
        [--concurrency 16] [--url http://host:port --pid PID] [--out FILE]

Without --url it starts `iterserve serve` itself (the bundled model unless --model) and
samples that process. Phase 1 sends a steady mix (completions and chat, streaming and not,
max_tokens 1..64) at --concurrency for --minutes and samples RSS every --sample-s seconds;
the slope is a least-squares fit over the samples after --warmup-minutes (target below
1 MB/min). Phase 2 sends --abandon requests at concurrency 32 of which 30% go away (a stream
closed after a few chunks, or a client timeout) and checks that afterwards every KV block is
free, nothing runs or waits, and no response was a 5xx.

Result: {"steady": {requests, statuses, rss_mb: [[t_min, mb], ...], slope_mb_per_min},
"abandon": {requests, statuses, leaked_blocks, running, waiting, swapped}, "ok": bool}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--port", str(port),
           "--log-level", "warning"] + (["--model", model] if model else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited early ({proc.returncode})")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not come up")


async def one(client: httpx.AsyncClient, rng: random.Random, i: int, abandon_p: float,
              statuses: dict) -> None:
    def count(key) -> None:
        statuses[str(key)] = statuses.get(str(key), 0) + 1

    stream, abandon = rng.random() < 0.5, rng.random() < abandon_p
    body: dict = {"max_tokens": rng.randint(1, 64), "temperature": rng.choice([0, 0.8]),
                  "stream": stream}
    text = f"request {i}: " + "tell me something. " * rng.randint(1, 20)
    if rng.random() < 0.5:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", text
    try:
        if stream:
            async with client.stream("POST", path, json=body) as r:
                count(r.status_code)
                keep = rng.randint(1, 4) if abandon else None
                got = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        got += 1
                        if keep is not None and got >= keep:
                            count("abandoned")
                            break
        else:
            try:
                r = await client.post(path, json=body,
                                      timeout=rng.uniform(0.01, 0.3) if abandon else 300)
                count(r.status_code)
            except httpx.TimeoutException:
                count("timed_out")
    except httpx.HTTPError as e:
        count(type(e).__name__)


async def load(base: str, *, concurrency: int, abandon_p: float, until: float | None = None,
               total: int | None = None, seed: int = 0, on_tick=None) -> tuple[int, dict]:
    rng = random.Random(seed)
    statuses: dict = {}
    sent = 0
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        async def worker() -> None:
            nonlocal sent
            while (total is None or sent < total) and (until is None or time.monotonic() < until):
                sent += 1
                await one(client, rng, sent, abandon_p, statuses)
                if on_tick:
                    on_tick()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sent, statuses


def slope(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / var if var else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--warmup-minutes", type=float, default=2.0)
    ap.add_argument("--abandon", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--url", default=None, help="an already running server")
    ap.add_argument("--pid", type=int, default=None, help="its process id (for RSS)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    proc = None
    if args.url:
        base, pid = args.url.rstrip("/"), args.pid
    else:
        proc, base = start_server(args.model)
        pid = proc.pid
    ps = psutil.Process(pid) if pid else None
    try:
        t0 = time.monotonic()
        samples: list[tuple[float, float]] = []
        last = [0.0]

        def tick() -> None:
            now = time.monotonic()
            if ps is not None and now - last[0] >= args.sample_s:
                last[0] = now
                samples.append(((now - t0) / 60, ps.memory_info().rss / 2**20))

        tick()
        sent, statuses = asyncio.run(load(base, concurrency=args.concurrency, abandon_p=0.0,
                                          until=t0 + args.minutes * 60, on_tick=tick))
        after_warmup = [p for p in samples if p[0] >= args.warmup_minutes]
        steady = {"requests": sent, "statuses": statuses, "rss_mb": samples,
                  "slope_mb_per_min": slope(after_warmup)}
        print(json.dumps({"steady": {k: v for k, v in steady.items() if k != "rss_mb"}}),
              file=sys.stderr)

        start = httpx.get(base + "/v1/engine/stats", timeout=30).json()
        sent2, statuses2 = asyncio.run(load(base, concurrency=32, abandon_p=0.3,
                                            total=args.abandon, seed=1))
        deadline = time.monotonic() + 120
        while True:
            st = httpx.get(base + "/v1/engine/stats", timeout=30).json()
            if (st["num_running"] == st["num_waiting"] == st["num_swapped"] == 0
                    and st["num_free_blocks"] == st["num_blocks"]) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        abandon = {"requests": sent2, "statuses": statuses2,
                   "leaked_blocks": st["num_blocks"] - st["num_free_blocks"],
                   "free_blocks_before": start["num_free_blocks"],
                   "running": st["num_running"], "waiting": st["num_waiting"],
                   "swapped": st["num_swapped"]}
        five_xx = sum(v for k, v in {**statuses, **statuses2}.items()
                      if k.isdigit() and int(k) >= 500)
        s = steady["slope_mb_per_min"]
        result = {"steady": steady, "abandon": abandon, "five_xx": five_xx,
                  "ok": five_xx == 0 and abandon["leaked_blocks"] == 0
                  and (s is None or s < 1.0)}
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

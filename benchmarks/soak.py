"""Soak (not in CI): steady load for N minutes with the server's RSS and bookkeeping
sampled, then a burst of abandoned requests; JSON out.

    python benchmarks/soak.py [--minutes 10] [--abandon 10000] [--model PATH]
        [--concurrency 16] [--port 18600] [--malloc-arena-max N] [--tracemalloc FRAMES]
        [--url http://host:port --pid PID] [--out FILE]

Without --url it starts the server itself (`benchmarks/soak_server.py`: `iterserve serve`, the
same app and flags, plus a GET /debug/soak probe) on the bundled model unless --model.

Phase 1 (steady) sends a mix (completions and chat, streaming and not, max_tokens 1..64) at
--concurrency for --minutes. RSS is sampled every --sample-s seconds by its own task (not per
finished request, so a stalled server is still sampled) and the probe every --probe-s: the
sizes of every per-request and bounded structure (engine/bookkeeping.py), live objects by type
and asyncio tasks. The RSS curve is reported as two numbers, because growth that stops at a
bound (allocator arenas meeting new batch shapes, the KV pool touched page by page, the trace
ring filling up to --max-finished-requests) is not a leak:
  - `warmup_mb`: RSS growth over the first half (the plateau being reached);
  - `slope_mb_per_min`: a least-squares fit over the second half (the target: below 1).
At the end the probe runs `malloc_trim(0)`: RSS it gives back was free memory the allocator
kept (fragmentation), not live objects.

Phase 2 (abandon) sends --abandon requests at concurrency 32 *all* of which go away: a stream
closed after 1-4 chunks, or a non-streaming request whose client times out after 10-300 ms
(max_tokens 16..64, so a client that stays would usually see more). It is bounded: no request
starts after --abandon-minutes and what is in flight 60 s later is cancelled (the steady phase
ends the same way). Then it waits (bounded) until every KV
block is free and nothing runs or waits, and reports leaked blocks, 5xx, the bookkeeping
sizes, and the cost of one disconnect: wall time, server CPU and client CPU per request.

Result: {"steady": {...}, "abandon": {...}, "end": {...}, "ok": bool}; with --out a file.
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

HERE = os.path.dirname(os.path.abspath(__file__))
PORTS = range(18600, 18700)          # the soak's port range on the shared machine


def free_port(preferred: int | None) -> int:
    for port in ([preferred] if preferred else []) + list(PORTS):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise SystemExit("no free port in 18600-18699")


def start_server(model: str | None, port: int, *, arena_max: int | None,
                 tracemalloc_frames: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, os.path.join(HERE, "soak_server.py"), "--port", str(port),
           "--log-level", "warning"] + (["--model", model] if model else []) + extra
    env = dict(os.environ)
    if arena_max:
        env["MALLOC_ARENA_MAX"] = str(arena_max)
    if tracemalloc_frames:
        env["SOAK_TRACEMALLOC"] = str(tracemalloc_frames)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
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


def count(statuses: dict, key) -> None:
    statuses[str(key)] = statuses.get(str(key), 0) + 1


def make_body(rng: random.Random, i: int, *, abandon: bool) -> tuple[str, dict]:
    stream = rng.random() < 0.5
    body: dict = {"max_tokens": rng.randint(16, 64) if abandon else rng.randint(1, 64),
                  "temperature": rng.choice([0, 0.8]), "stream": stream}
    text = f"request {i}: " + "tell me something. " * rng.randint(1, 20)
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": text}


async def one(client: httpx.AsyncClient, rng: random.Random, i: int, abandon: bool,
              statuses: dict) -> None:
    path, body = make_body(rng, i, abandon=abandon)
    try:
        if body["stream"]:
            keep = rng.randint(1, 4) if abandon else None
            async with client.stream("POST", path, json=body) as r:
                count(statuses, r.status_code)
                got = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        got += 1
                        if keep is not None and got >= keep:
                            count(statuses, "abandoned")
                            break       # leaving the block closes the connection
        else:
            try:
                r = await client.post(path, json=body,
                                      timeout=rng.uniform(0.01, 0.3) if abandon else 300)
                count(statuses, r.status_code)
            except httpx.TimeoutException:
                count(statuses, "timed_out")
    except httpx.HTTPError as e:
        count(statuses, type(e).__name__)


async def load(base: str, *, concurrency: int, abandon: bool, until: float,
               total: int | None = None, seed: int = 0, grace_s: float = 60.0
               ) -> tuple[int, dict]:
    rng = random.Random(seed)
    statuses: dict = {}
    sent = 0
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        async def worker() -> None:
            nonlocal sent
            while (total is None or sent < total) and time.monotonic() < until:
                sent += 1
                await one(client, rng, sent, abandon, statuses)

        # Bounded: at `until` no new request starts; what is still in flight `grace_s` later
        # is cancelled (its client goes away: one more abandoned request, counted as such).
        tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, until - time.monotonic())
                                        + grace_s)
        for t in pending:
            t.cancel()
            count(statuses, "cancelled_at_deadline")
        await asyncio.gather(*pending, return_exceptions=True)
    return sent, statuses


async def probe(base: str, *, trim: bool = False) -> dict | None:
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        try:
            r = await c.get("/debug/soak", params={"trim": int(trim)})
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None


async def sampler(base: str, ps: psutil.Process | None, t0: float, *, sample_s: float,
                  probe_s: float, rss: list, probes: list, stop: asyncio.Event) -> None:
    next_probe = time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        if ps is not None:
            rss.append([round((now - t0) / 60, 3), round(ps.memory_info().rss / 2**20, 1)])
        if probe_s and now >= next_probe:
            next_probe = now + probe_s
            p = await probe(base)
            if p is not None:
                probes.append({"t_min": round((now - t0) / 60, 3), "rss_mb": p["rss_mb"],
                               "malloc": p.get("malloc"),
                               "kv_resident_mb": p.get("kv_resident_mb"), "sizes": p["sizes"], "asyncio_tasks": p["asyncio_tasks"],
                               "gc_total": p["gc"]["total"], "gc_grown": p["gc"]["grown"][:8],
                               "tracemalloc": p.get("tracemalloc")})
        try:
            await asyncio.wait_for(stop.wait(), timeout=sample_s)
        except asyncio.TimeoutError:
            pass


def slope(points: list) -> float | None:
    """Least-squares slope of [(t, y), ...] (y per unit of t)."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / var if var else None


def rss_summary(rss: list, minutes: float) -> dict:
    """Warm-up plateau (first half) vs slope (second half) of an RSS curve."""
    if not rss:
        return {}
    half = minutes / 2
    first = [p for p in rss if p[0] < half]
    second = [p for p in rss if p[0] >= half]
    s = slope(second)
    return {"start_mb": rss[0][1], "half_mb": second[0][1] if second else None,
            "end_mb": rss[-1][1], "max_mb": max(p[1] for p in rss),
            "warmup_mb": round(second[0][1] - rss[0][1], 1) if second else None,
            "slope_mb_per_min": round(s, 3) if s is not None else None,
            "slope_first_half_mb_per_min": round(slope(first), 3) if slope(first) else None}


async def wait_idle(base: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=base, timeout=30) as c:
        while True:
            st = (await c.get("/v1/engine/stats")).json()
            if (st["num_running"] == st["num_waiting"] == st["num_swapped"] == 0
                    and st["num_free_blocks"] == st["num_blocks"]) \
                    or time.monotonic() > deadline:
                return st
            await asyncio.sleep(0.1)


async def run(args: argparse.Namespace, base: str, ps: psutil.Process | None) -> dict:
    # --- phase 1: steady ---------------------------------------------------------------
    t0 = time.monotonic()
    rss: list = []
    probes: list = []
    stop = asyncio.Event()
    samp = asyncio.create_task(sampler(base, ps, t0, sample_s=args.sample_s,
                                       probe_s=args.probe_s, rss=rss, probes=probes, stop=stop))
    sent, statuses = await load(base, concurrency=args.concurrency, abandon=False,
                                until=t0 + args.minutes * 60)
    stop.set()
    await samp
    idle = await wait_idle(base, 60)
    after_steady = await probe(base)
    steady = {"minutes": args.minutes, "concurrency": args.concurrency, "requests": sent,
              "statuses": statuses, **rss_summary(rss, args.minutes),
              "sizes_end": after_steady["sizes"] if after_steady else None,
              "rss_mb": rss, "probes": probes}
    print(json.dumps({"steady": {k: v for k, v in steady.items()
                                 if k not in ("rss_mb", "probes")}}), file=sys.stderr)

    # --- phase 2: abandon --------------------------------------------------------------
    abandon: dict = {"requested": args.abandon}
    if args.abandon:
        start = (await httpx.AsyncClient(base_url=base, timeout=30).get("/v1/engine/stats")).json()
        cpu0 = ps.cpu_times() if ps is not None else None
        me0 = time.process_time()
        w0 = time.monotonic()
        sent2, statuses2 = await load(base, concurrency=32, abandon=True, total=args.abandon,
                                      until=w0 + args.abandon_minutes * 60, seed=1)
        wall = time.monotonic() - w0
        me = time.process_time() - me0
        st = await wait_idle(base, 120)
        drain = time.monotonic() - w0 - wall
        srv = None
        if ps is not None:
            c1 = ps.cpu_times()
            srv = (c1.user + c1.system) - (cpu0.user + cpu0.system)
        after = await probe(base)
        abandon.update({
            "requests": sent2, "statuses": statuses2, "stopped_by_deadline": sent2 < args.abandon,
            "wall_s": round(wall, 1), "drain_s": round(drain, 2),
            "per_request_ms": round(1000 * wall / max(sent2, 1), 2),
            "server_cpu_ms_per_request": round(1000 * srv / max(sent2, 1), 2) if srv else None,
            "client_cpu_ms_per_request": round(1000 * me / max(sent2, 1), 2),
            "leaked_blocks": st["num_blocks"] - st["num_free_blocks"],
            "free_blocks_before": start["num_free_blocks"],
            "running": st["num_running"], "waiting": st["num_waiting"],
            "swapped": st["num_swapped"],
            "sizes_end": after["sizes"] if after else None})
        statuses = {**statuses}
        for k, v in statuses2.items():
            statuses[f"abandon:{k}"] = v

    end = await probe(base, trim=True)
    end_summary = None
    if end is not None:
        end_summary = {"rss_mb": end["rss_mb"], "rss_mb_after_trim": end.get("rss_mb_after_trim"),
                       "malloc": end.get("malloc"), "kv_pool_mb": end.get("kv_pool_mb"),
                       "kv_resident_mb": end.get("kv_resident_mb"),
                       "sizes": end["sizes"], "asyncio_tasks": end["asyncio_tasks"],
                       "gc_total": end["gc"]["total"], "gc_grown": end["gc"]["grown"],
                       "tracemalloc": end.get("tracemalloc")}
    five_xx = sum(v for k, v in statuses.items()
                  if k.split(":")[-1].isdigit() and int(k.split(":")[-1]) >= 500)
    from iterserve.engine.bookkeeping import leftovers
    not_back = leftovers((end_summary or {}).get("sizes") or {})
    s = steady.get("slope_mb_per_min")
    return {"steady": steady, "abandon": abandon, "end": end_summary, "five_xx": five_xx,
            "per_request_structures_not_empty": not_back,
            "ok": five_xx == 0 and abandon.get("leaked_blocks", 0) == 0 and not not_back
            and (s is None or s < 1.0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--abandon", type=int, default=10_000)
    ap.add_argument("--abandon-minutes", type=float, default=15.0,
                    help="the abandon phase stops after this long even if not all were sent")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--probe-s", type=float, default=30.0,
                    help="seconds between /debug/soak probes (0: none)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--port", type=int, default=None, help="default: a free one in 18600-18699")
    ap.add_argument("--malloc-arena-max", type=int, default=None,
                    help="MALLOC_ARENA_MAX for the server (glibc arenas; default: glibc's)")
    ap.add_argument("--tracemalloc", type=int, default=0,
                    help="trace allocations with N frames in the server (slow; short runs)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="an extra `iterserve serve` flag (repeatable), e.g. "
                         "--server-arg=--max-finished-requests=100")
    ap.add_argument("--url", default=None, help="an already running server (no probe unless "
                    "it is soak_server.py)")
    ap.add_argument("--pid", type=int, default=None, help="its process id (for RSS)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--note", default=None, help="free text stored in the JSON (e.g. 'under load')")
    args = ap.parse_args()

    proc = None
    if args.url:
        base, pid = args.url.rstrip("/"), args.pid
    else:
        proc, base = start_server(args.model, free_port(args.port),
                                  arena_max=args.malloc_arena_max,
                                  tracemalloc_frames=args.tracemalloc, extra=args.server_arg)
        pid = proc.pid
    ps = psutil.Process(pid) if pid else None
    started = time.time()
    try:
        result = asyncio.run(run(args, base, ps))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    result["config"] = {"minutes": args.minutes, "abandon": args.abandon,
                        "concurrency": args.concurrency, "model": args.model or "bundled",
                        "malloc_arena_max": args.malloc_arena_max,
                        "tracemalloc": args.tracemalloc, "server_args": args.server_arg,
                        "started_unix": round(started), "note": args.note,
                        "load_average_at_end": os.getloadavg(), "cpus": os.cpu_count()}
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    summary = {k: result[k] for k in ("five_xx", "per_request_structures_not_empty", "ok")}
    summary["steady"] = {k: v for k, v in result["steady"].items()
                         if k not in ("rss_mb", "probes", "sizes_end")}
    summary["abandon"] = {k: v for k, v in result["abandon"].items() if k != "sizes_end"}
    summary["end"] = {k: v for k, v in (result["end"] or {}).items()
                      if k in ("rss_mb", "rss_mb_after_trim", "gc_total", "asyncio_tasks")}
    print(json.dumps(summary, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

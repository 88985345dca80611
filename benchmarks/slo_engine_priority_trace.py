"""Where an urgent request's TTFT goes under a batch flood, on the real engine.

The `priority-flood` preset's requests (slo_workloads.py) are sent to a real `iterserve
serve` (bundled model, HTTP, streaming); the server runs inside this script's wrapper
(`--wrapped-serve`), which times, on the server's monotonic clock:

- each `AsyncEngine.add_request` entry (the HTTP handler has parsed the body) and return
  (tokenised and queued in the scheduler: this waits for the engine thread, so for the step
  in flight), and
- each engine step: start, the executor's start and end, end, tokens, requests, and which
  requests were scheduled for the first time in it.

The client (its own small streamer, same clock: perf_counter and monotonic are both
CLOCK_MONOTONIC on Linux) times the send and the first streamed token and reads
`X-Request-Id`. Per interactive (priority 0) request, its TTFT is split into:

  http_in       send -> add_request entered (connection, body parsing)
  engine_wait   add_request entered -> queued (tokenise + the step in flight on the engine
                thread: `inflight_s` says how much of that step was left)
  loop_gap      queued -> the start of the step that schedules it
  sched_to_exec schedule() and the step's preparation
  exec          the executor of that step (its prefill, with whatever else ran in it)
  post          the executor's end -> step end (sampling bookkeeping, outputs)
  out_path      step end -> the client's first token (queue, SSE, detokenise)

for the flood (under the chosen policy) and for the interactive class alone, same server.

    PYTHONPATH=src .venv/bin/python benchmarks/slo_engine_priority_trace.py
        [--policy priority] [--rate-scale 1.0] [--serve-arg=--priority-step-ms=20 ...]
        [--out benchmarks/results/slo-priority-trace.json]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


# --- the server side: a wrapper around `iterserve serve` that logs timings -------------------
def wrapped_serve(log_path: str, argv: list[str]) -> int:
    from iterserve.engine.async_engine import AsyncEngine
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve import cli

    steps: list[list[Any]] = []
    adds: dict[str, list[float]] = {}
    clock = time.monotonic

    def dump() -> None:
        with open(log_path, "w") as fh:
            json.dump({"steps": steps, "adds": adds}, fh)

    atexit.register(dump)
    orig_add = AsyncEngine.add_request
    orig_step = LLMEngine.step
    orig_exec = LLMEngine._execute

    async def add_request(self, request_id, prompt, params, **kw):
        t = clock()
        try:
            return await orig_add(self, request_id, prompt, params, **kw)
        finally:
            adds[request_id] = [t, clock()]

    cur: dict[str, Any] = {}

    def _execute(self, sched_out):
        cur["x0"] = clock()
        cur["ntok"] = sched_out.num_batched_tokens
        cur["nreq"] = len(sched_out.num_scheduled_tokens)
        cur["new"] = [d.req_id for d in sched_out.scheduled_new_reqs]
        try:
            return orig_exec(self, sched_out)
        finally:
            cur["x1"] = clock()

    def step(self):
        t0 = clock()
        cur.clear()
        try:
            return orig_step(self)
        finally:
            if "x0" in cur:
                steps.append([t0, cur["x0"], cur["x1"], clock(), cur["ntok"], cur["nreq"],
                              cur["new"]])
                if len(steps) % 200 == 0:
                    dump()

    AsyncEngine.add_request = add_request
    LLMEngine.step = step
    LLMEngine._execute = _execute
    import signal

    signal.signal(signal.SIGUSR1, lambda *_: dump())
    return cli.main(argv)


# --- the client side --------------------------------------------------------------------
async def _stream(client, url: str, body: dict, rec: dict) -> None:
    rec["send"] = time.perf_counter()
    async with client.stream("POST", url, json=body) as resp:
        rec["status"] = resp.status_code
        rec["id"] = resp.headers.get("x-request-id")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if any((c.get("text") or "") for c in chunk.get("choices") or ()):
                if "first" not in rec:
                    rec["first"] = time.perf_counter()
    rec["end"] = time.perf_counter()


async def run_requests(base: str, reqs, priorities: dict[int, int], send_priority: bool,
                       model: str) -> list[dict]:
    import httpx

    url = base + "/v1/completions"
    recs: list[dict] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600, connect=30)) as c:
        t0 = time.perf_counter()

        async def one(r):
            d = t0 + r.arrival_s - time.perf_counter()
            if d > 0:
                await asyncio.sleep(d)
            body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens,
                    "temperature": 0.0, "stream": True, "ignore_eos": True}
            if send_priority:
                body["priority"] = priorities[r.index]
            rec = {"index": r.index, "priority": priorities[r.index]}
            recs.append(rec)
            await _stream(c, url, body, rec)

        await asyncio.gather(*(one(r) for r in reqs))
    return recs


def decompose(recs: list[dict], log: dict) -> list[dict]:
    steps = log["steps"]
    adds = log["adds"]
    first_step: dict[str, list] = {}
    for s in steps:
        for rid in s[6]:
            first_step.setdefault(rid, s)
    rows = []
    for r in recs:
        if r["priority"] != 0 or r.get("id") not in adds or "first" not in r:
            continue
        rid = r["id"]
        a0, a1 = adds[rid]
        # Sequence ids: the engine's request id, or "<id>-<n>" for n > 1.
        s = first_step.get(rid) or next((v for k, v in first_step.items()
                                         if k.startswith(rid)), None)
        if s is None:
            continue
        inflight = [x for x in steps if x[0] <= a0 < x[3]]
        rows.append({
            "index": r["index"], "ttft_s": r["first"] - r["send"],
            "http_in": a0 - r["send"], "engine_wait": a1 - a0,
            "inflight_s": (inflight[0][3] - a0) if inflight else 0.0,
            "inflight_step_s": (inflight[0][3] - inflight[0][0]) if inflight else 0.0,
            "loop_gap": s[0] - a1, "sched_to_exec": s[1] - s[0], "exec": s[2] - s[1],
            "post": s[3] - s[2], "out_path": r["first"] - s[3],
            "step_tokens": s[4], "step_reqs": s[5]})
    return rows


PARTS = ("http_in", "engine_wait", "inflight_s", "loop_gap", "sched_to_exec", "exec", "post",
         "out_path")


def summarise(rows: list[dict]) -> dict[str, Any]:
    if not rows:
        return {}
    ttft = sorted(r["ttft_s"] for r in rows)
    worst = max(rows, key=lambda r: r["ttft_s"])
    return {"n": len(rows), "p99_ttft_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "median_ttft_s": statistics.median(ttft),
            "median": {k: statistics.median(r[k] for r in rows) for k in PARTS},
            "mean": {k: statistics.fmean(r[k] for r in rows) for k in PARTS},
            "worst": worst}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--wrapped-serve":
        sys.exit(wrapped_serve(sys.argv[2], sys.argv[3:]))
    from slo_workloads import bench_workload, plan, serve_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="priority")
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--rate-scale", type=float, default=1.0,
                    help="preset rate x this: the presets already follow the shipped fit's "
                    "speed (lab/preset_scale.py); slo_engine_tradeoffs.py prints this machine's "
                    "factor against that fit)")
    ap.add_argument("--port", type=int, default=18640)
    ap.add_argument("--serve-arg", action="append", default=[])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/slo-priority-trace.json")
    args = ap.parse_args()
    import httpx

    base_opts = {"requests": args.requests, "scheduling_policy": args.policy}
    rate = plan("priority-flood", **base_opts).workload.arrival_rate_s
    p = plan("priority-flood", **base_opts, arrival_rate_s=rate * args.rate_scale)
    w = bench_workload(p, "priority-flood")
    prios = w.extra["priorities"]
    log_path = f"/tmp/slo-priority-trace-{args.port}.json"
    cmd = [sys.executable, __file__, "--wrapped-serve", log_path, "serve", "--host",
           "127.0.0.1", "--port", str(args.port), *serve_args(p), *args.serve_arg]
    logf = open(f"/tmp/slo-priority-trace-{args.port}.log", "w")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=os.environ.copy())
    base = f"http://127.0.0.1:{args.port}"
    doc: dict[str, Any] = {"policy": args.policy, "serve_flags": serve_args(p) + args.serve_arg,
                           "rate_s": rate * args.rate_scale, "runs": []}
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"server exited: see {logf.name}")
            time.sleep(0.5)
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        send_p = args.policy == "priority"
        urgent = [r for r in w.requests if prios[r.index] == 0]
        # warm-up: a few flood requests
        asyncio.run(run_requests(base, w.requests[:8], prios, send_p, model))
        for rep in range(args.repeats):
            for name, reqs in (("flood", w.requests), ("alone", urgent)):
                t = time.perf_counter()
                recs = asyncio.run(run_requests(base, reqs, prios, send_p, model))
                proc.send_signal(__import__("signal").SIGUSR1)
                time.sleep(1.0)
                log = json.loads(Path(log_path).read_text())
                rows = decompose(recs, log)
                s = summarise(rows)
                run_steps = [x for x in log["steps"] if x[0] >= t - 0.1]
                dur = [x[3] - x[0] for x in run_steps]
                s["steps"] = {"n": len(dur), "median_s": statistics.median(dur) if dur else None,
                              "max_s": max(dur) if dur else None}
                doc["runs"].append({"repeat": rep, "case": name, "summary": s, "rows": rows})
                print(f"{name}: n={s.get('n')} p99 TTFT {s.get('p99_ttft_s', 0):.3f} s, "
                      f"median {s.get('median_ttft_s', 0):.3f} s; median parts "
                      + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in s.get("median", {}).items())
                      + f" ms; steps median {s['steps']['median_s'] or 0:.3f} s", flush=True)
                if s:
                    wr = s["worst"]
                    print("   worst: " + ", ".join(
                        f"{k} {wr[k] * 1e3:.1f}" for k in ("ttft_s", *PARTS, "inflight_step_s"))
                        + f" ms, step {wr['step_tokens']} tok / {wr['step_reqs']} req", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        logf.close()
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Closed-loop sessions: each session sends its turns one after another, sessions at once.

Why its own runner: an agent sends turn k + 1 only once turn k has answered, so arrival
times cannot be fixed in advance (bench/client.py's open loop sends on a schedule). Each
session is one coroutine over its turns (workloads.agent); a turn is timed exactly as the
open-loop client times a request (`stream_one`: TTFT, gaps, E2E), and the server's
`usage.prompt_tokens_details.cached_tokens` says how much of its prompt a cache served
(iterserve, vLLM and llama-server all report it). `turns` runs part of each session (a
restart between turn 5 and 6 is two calls), and the summary is per turn: TTFT p50/p99 of
every session's turn k, throughput, and the prompt tokens served from a cache.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import httpx

from .client import (ENDPOINTS, ClientOptions, _normalise_base_url, discover_model,
                     machine_info, stream_one)
from .metrics import RequestRecord, latency_stats, percentile, summarize
from .workloads import Workload


def sessions_of(workload: Workload) -> dict[int, list]:
    """The workload's requests by session, each session's turns in order."""
    out: dict[int, list] = defaultdict(list)
    for r in workload.requests:
        if r.session < 0:
            raise ValueError(f"workload {workload.name!r} has no sessions (request {r.index})")
        out[r.session].append(r)
    for turns in out.values():
        turns.sort(key=lambda r: r.turn)
    return dict(out)


async def run_sessions(base_url: str, workload: Workload, opts: ClientOptions | None = None,
                       turns: tuple[int, int] | None = None) -> dict:
    """Run every session's turns `turns` (first, last; 1-based, inclusive; None: all) against
    the server at `base_url`, sessions concurrently; return the result document."""
    opts = (opts or ClientOptions()).validate()
    base = _normalise_base_url(base_url)
    url = base + ENDPOINTS[opts.endpoint]
    first, last = turns or (1, max(r.turn for r in workload.requests))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(opts.request_timeout_s, connect=30.0)
    records: list[RequestRecord] = []
    turn_of: dict[int, int] = {}
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = opts.model or await discover_model(client, base)

        async def session(reqs) -> None:
            for r in reqs:
                if not first <= r.turn <= last:
                    continue
                try:
                    rec = await asyncio.wait_for(
                        stream_one(client, url, r, model, opts, t0), opts.request_timeout_s)
                except asyncio.TimeoutError:
                    rec = RequestRecord(index=r.index, prompt_len=r.prompt_len,
                                        max_tokens=r.max_tokens,
                                        error=f"timed out after {opts.request_timeout_s}s")
                records.append(rec)
                turn_of[r.index] = r.turn
                if not rec.success:
                    break                     # the conversation cannot go on without it

        started_at = time.time()
        t0 = time.perf_counter()
        await asyncio.gather(*(session(reqs) for reqs in sessions_of(workload).values()))
        duration = time.perf_counter() - t0
    records.sort(key=lambda r: r.index)
    return {
        "kind": "sessions", "base_url": base, "endpoint": opts.endpoint, "model": model,
        "started_at": started_at, "machine": machine_info(), "workload": workload.summary(),
        "turns": [first, last], "summary": summarize(records, duration),
        "per_turn": per_turn(records, turn_of),
        "requests": [{**r.to_json(), "turn": turn_of[r.index]} for r in records],
    }


def per_turn(records: list[RequestRecord], turn_of: dict[int, int]) -> dict:
    """Turn -> TTFT stats over the sessions, prompt and cached tokens, completed count."""
    by: dict[int, list[RequestRecord]] = defaultdict(list)
    for r in records:
        by[turn_of[r.index]].append(r)
    out = {}
    for t in sorted(by):
        ok = [r for r in by[t] if r.success]
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        out[str(t)] = {"completed": len(ok), "failed": len(by[t]) - len(ok),
                       "ttft": latency_stats([r.ttft for r in ok if r.ttft is not None]),
                       "prompt_tokens": sum(r.prompt_len for r in ok),
                       "cached_tokens": sum(cached) if cached else None}
    return out


def ttft_over_turns(doc: dict, first: int, last: int, q: str = "median_ms") -> float | None:
    """The `q` of TTFT over every session's turns first..last of a result document."""
    values = [r["ttft"] for r in doc["requests"]
              if r["success"] and first <= r["turn"] <= last and r["ttft"] is not None]
    if not values:
        return None
    return round(percentile(values, {"median_ms": 50, "p99_ms": 99}[q]) * 1e3, 3)

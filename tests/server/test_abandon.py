"""The abandon suite: 1,000 mixed requests at concurrency 32, streaming and not,
random max_tokens, 30% of the clients going away (closing the stream mid-way, or timing out
while waiting for a non-streamed answer). After the drain: every KV block is free again,
running = waiting = swapped = 0, no 5xx, and the finished-by-reason counters of /metrics sum
to the requests the engine received (each ended exactly once; a client that timed out
before its request was even sent is not a request received, so at most the timed-out ones
may be missing).

Sized for CI on 2 cores: max_tokens 1..24 on the tiny model (one request is a few ms of
engine time); ITERSERVE_ABANDON_REQUESTS overrides the count (benchmarks/soak.py runs the
same client with 10,000).
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx

REQUESTS = int(os.environ.get("ITERSERVE_ABANDON_REQUESTS", "1000"))
CONCURRENCY = 32
ABANDON = 0.3


def metric_values(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            out[labels] = float(value)
    return out


async def one(client: httpx.AsyncClient, rng: random.Random, i: int, tally: dict) -> None:
    stream = rng.random() < 0.5
    abandon = rng.random() < ABANDON
    body = {"prompt": f"request {i} " * rng.randint(1, 6), "max_tokens": rng.randint(1, 24),
            "ignore_eos": rng.random() < 0.7, "temperature": rng.choice([0, 0.7, 1.0]),
            "stream": stream}
    path = "/v1/completions"
    if rng.random() < 0.4:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    try:
        if stream:
            async with client.stream("POST", path, json=body) as r:
                tally[r.status_code] = tally.get(r.status_code, 0) + 1
                keep = rng.randint(1, 4) if abandon else None
                got = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        got += 1
                        if keep is not None and got >= keep:
                            tally["abandoned"] = tally.get("abandoned", 0) + 1
                            break                    # leaving the block closes the stream
        else:
            timeout = rng.uniform(0.01, 0.2) if abandon else 120
            try:
                r = await client.post(path, json=body, timeout=timeout)
                tally[r.status_code] = tally.get(r.status_code, 0) + 1
            except httpx.TimeoutException:
                tally["timed_out"] = tally.get("timed_out", 0) + 1
    except httpx.HTTPError as e:
        tally[type(e).__name__] = tally.get(type(e).__name__, 0) + 1


async def run_abandon(base_url: str, n: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    tally: dict = {}
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        async def guarded(i: int) -> None:
            async with sem:
                await one(client, rng, i, tally)

        await asyncio.gather(*(guarded(i) for i in range(n)))
    return tally


def drained(base_url: str, free_blocks: int, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = httpx.get(base_url + "/v1/engine/stats").json()
        if (st["num_running"] == st["num_waiting"] == st["num_swapped"] == 0
                and st["num_free_blocks"] == free_blocks) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def test_abandoned_requests_leak_nothing(start_server):
    s = start_server(max_model_len=128, num_kv_blocks=160, max_num_seqs=32)
    before = httpx.get(s.v1 + "/engine/stats").json()
    added_before = s.engine.num_requests_added
    counted_before = sum(metric_values(httpx.get(s.base_url + "/metrics").text,
                                       "iterserve:request_success_total").values())
    t0 = time.monotonic()
    tally = asyncio.run(run_abandon(s.base_url, REQUESTS))
    elapsed = time.monotonic() - t0
    st = drained(s.base_url, before["num_free_blocks"])
    print(f"abandon: {REQUESTS} requests in {elapsed:.1f} s: {tally}")
    assert not any(isinstance(k, int) and k >= 500 for k in tally), tally
    assert tally.get(200, 0) + tally.get("timed_out", 0) == REQUESTS, tally
    assert tally.get("abandoned", 0) + tally.get("timed_out", 0) >= 0.2 * REQUESTS, tally
    assert st["num_running"] == st["num_waiting"] == st["num_swapped"] == 0, st
    assert st["num_free_blocks"] == before["num_free_blocks"] == st["num_blocks"], st
    # every request the engine received ended exactly once, by some reason
    received = s.engine.num_requests_added - added_before
    assert REQUESTS - tally.get("timed_out", 0) <= received <= REQUESTS, (received, tally)
    deadline = time.monotonic() + 10
    while True:
        reasons = metric_values(httpx.get(s.base_url + "/metrics").text,
                                "iterserve:request_success_total")
        if sum(reasons.values()) - counted_before == received or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert sum(reasons.values()) - counted_before == received, (reasons, received)
    assert any("abort" in k for k in reasons), reasons
    assert not httpx.get(s.base_url + "/health").is_error

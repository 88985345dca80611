"""What a long-running server keeps must not grow with what it has served (what a soak checks).

benchmarks/soak.py found the server's heap growing by ~0.6 MB for every new GEMM row count:
oneDNN (and ideep) cache a primitive per shape, up to 1,024 entries per cache, and a prefill
step's row count is its batch's token count, so traffic met a new shape almost every step.
model/layers.py (`onednn_linear`) keeps a bounded set of row shapes; the first test counts
the shapes oneDNN is asked for and fails without that bound (one shape per distinct prompt
length). The others are the guard for the engine's own bookkeeping: after traffic
(streams, abandons, timeouts) every per-request structure is empty again and every ring /
cache is under its bound (engine/bookkeeping.py lists them). Counts, not RSS: nothing here
depends on timing or on what else the machine runs.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time

import httpx
import pytest
import torch

import iterserve.model.layers as layers
from iterserve import LLM, SamplingParams
from iterserve.core.request import FinishReason
from iterserve.engine.bookkeeping import leftovers, sizes

pytestmark = pytest.mark.skipif(not layers._ONEDNN_PLAIN, reason="torch without oneDNN")


@pytest.mark.parametrize("m", [1, 7, 16, 17, 40, 255, 256, 257, 700])
def test_onednn_linear_matches_one_call(m):
    torch.manual_seed(m)
    w, b = torch.randn(48, 64), torch.randn(48)
    x = torch.randn(m, 64)
    ref = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
    for weight in (w, packed):
        got = layers.onednn_linear(x, weight, b)
        assert got.shape == (m, 48)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    pieces = layers.onednn_rows(m)
    assert sum(p[1] for p in pieces) == m
    assert all(p[2] <= layers.ONEDNN_MAX_ROWS for p in pieces)


def test_gemm_shapes_stay_bounded_whatever_the_prompt_lengths(tiny_model_dir, monkeypatch):
    """80 prompts of 80 different lengths: unbounded, oneDNN would get a new shape per
    length (80 per weight); each weight sees at most 31 row counts."""
    seen: dict[tuple, set[int]] = collections.defaultdict(set)
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, w, *rest):
        seen[tuple(w.shape)].add(x.shape[0])
        return real(x, w, *rest)

    monkeypatch.setattr(layers, "_onednn_op", spy)
    # A path that calls torch.ops.mkldnn._linear_pointwise directly is counted too.
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy, raising=False)
    llm = LLM(str(tiny_model_dir), max_model_len=512, num_kv_blocks=256, max_num_seqs=24,
              max_num_batched_tokens=512)
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    # One prompt at a time, so each prefill step has that prompt's length as its row count
    # (the server's case: arrivals spread over time), then a batch (decode batches of 1..24).
    for i, n in enumerate(range(3, 3 + 80 * 5, 5)):
        out = llm.generate({"prompt_token_ids": [5 + (i * 7 + j) % 200 for j in range(n)]},
                           sp, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    llm.generate([{"prompt_token_ids": [7] * (i + 2)} for i in range(24)], sp, use_tqdm=False)
    assert seen, "no GEMM went through oneDNN (is the tiny model's Linear packed?)"
    bound = layers.ONEDNN_EXACT_ROWS + \
        (layers.ONEDNN_MAX_ROWS - layers.ONEDNN_EXACT_ROWS) // layers.ONEDNN_ROW_STEP
    worst = max(len(v) for v in seen.values())
    assert worst <= bound, {k: sorted(v) for k, v in seen.items()}


async def _traffic(base: str, n: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    tally: collections.Counter = collections.Counter()
    sem = asyncio.Semaphore(16)
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        async def one(i: int) -> None:
            body = {"prompt": f"req {i} " * rng.randint(1, 8), "max_tokens": rng.randint(1, 12),
                    "stream": rng.random() < 0.5, "ignore_eos": True}
            path = "/v1/completions"
            if rng.random() < 0.4:
                path = "/v1/chat/completions"
                body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
            abandon = rng.random() < 0.3
            async with sem:
                try:
                    if body["stream"]:
                        async with client.stream("POST", path, json=body) as r:
                            tally[r.status_code] += 1
                            async for line in r.aiter_lines():
                                if abandon and line.startswith("data: "):
                                    tally["abandoned"] += 1
                                    break
                    else:
                        r = await client.post(path, json=body,
                                              timeout=rng.uniform(0.005, 0.05) if abandon else 60)
                        tally[r.status_code] += 1
                except httpx.TimeoutException:
                    tally["timed_out"] += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return dict(tally)


def _engine_sizes(s) -> dict:
    loop = s.engine._loop
    fut = asyncio.run_coroutine_threadsafe(s.engine.run_in_engine(sizes, s.engine), loop)
    out = fut.result(timeout=30)

    async def tasks() -> int:
        return len(asyncio.all_tasks())
    out["asyncio.tasks"] = asyncio.run_coroutine_threadsafe(tasks(), loop).result(timeout=30)
    return out


def test_bookkeeping_returns_to_baseline_after_traffic(start_server):
    """250 requests (40 more than the trace ring holds; 30% abandoned or timed out): every
    per-request structure is empty again, rings and caches are at or under their bounds, and
    the event loop holds as many tasks as before."""
    s = start_server(max_model_len=128, num_kv_blocks=160, max_num_seqs=16,
                     max_finished_requests=50, step_history_len=40)
    httpx.post(s.v1 + "/completions", json={"prompt": "warm up", "max_tokens": 2})
    deadline = time.monotonic() + 30
    before = _engine_sizes(s)
    while before["async.streams"] and time.monotonic() < deadline:
        time.sleep(0.05)
        before = _engine_sizes(s)
    tally = asyncio.run(_traffic(s.base_url, 250))
    assert not any(isinstance(k, int) and k >= 500 for k in tally), tally
    while True:                                    # drained: nothing live in the engine
        after = _engine_sizes(s)
        if not leftovers(after) and after["asyncio.tasks"] <= before["asyncio.tasks"] \
                or time.monotonic() > deadline + 60:
            break
        time.sleep(0.05)
    assert not leftovers(after), (leftovers(after), tally)
    assert after["executor.requests"] <= 16, after      # at most one step's finishes linger
    assert after["tracer.finished_traces"] == 50, after
    assert after["tracer.step_history"] <= 40, after
    assert after["blocks.free"] == after["blocks.num_blocks"], after
    assert after["blocks.cached"] <= after["blocks.num_blocks"], after
    assert after["scheduler.waiting_entries"] == 0, after
    assert after["scheduler.timeouts"] == 0, after
    # Label sets: one per finish reason at most (2 samples each: total and created).
    assert after["prometheus.samples"] <= before["prometheus.samples"] + 2 * len(FinishReason)
    assert after["asyncio.tasks"] <= before["asyncio.tasks"], (before, after)

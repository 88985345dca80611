"""`--data-parallel-size 2` through the official `openai` client over real HTTP: the same
greedy outputs as one engine, streaming, abort on disconnect reaching the replica, per-replica
stats and metrics, and the CLI's refusals."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from iterserve.engine.args import EngineArgs
from iterserve.engine.async_engine import AsyncEngine
from iterserve.errors import RayNotInstalledError

from .conftest import serve_engine

PROMPTS = ["hello world", "the quick brown fox", "once upon a time", "a b c d e f",
           "numbers: 1 2 3", "zzz", "lorem ipsum dolor", "x y z"]


def wait_until(fn, timeout: float = 15.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(interval)
    return fn()


@pytest.fixture(scope="module")
def pool_server(start_pool):
    return start_pool(router="least_loaded")


@pytest.fixture(scope="module")
def single_server(tiny_model_dir):
    engine = AsyncEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir),
                                                     num_kv_blocks=128, max_model_len=256))
    s = serve_engine(engine)
    yield s
    s.stop()


def client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0, timeout=60)


def test_greedy_outputs_equal_a_single_engine(pool_server, single_server):
    """Completions (several prompts, concurrently so both replicas serve) and streamed chat:
    token for token what one engine produces."""
    from concurrent.futures import ThreadPoolExecutor

    def complete(s, p):
        r = client(s).completions.create(model=None or "tiny-llama", prompt=p, max_tokens=12,
                                         temperature=0)
        return r.choices[0].text, r.usage.completion_tokens

    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda p: complete(pool_server, p), PROMPTS))
    want = [complete(single_server, p) for p in PROMPTS]
    assert got == want

    def chat_stream(s):
        chunks = client(s).chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "hi there"}],
            max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        for c in chunks:
            if c.choices:
                text += c.choices[0].delta.content or ""
            if c.usage:
                usage = c.usage.completion_tokens
        return text, usage

    assert chat_stream(pool_server) == chat_stream(single_server)
    # Both replicas took part.
    stats = httpx.get(pool_server.base_url + "/v1/engine/stats").json()
    assert stats["num_replicas"] == 2
    assert all(r["num_cache_queries"] >= 0 for r in stats["replicas"])
    assert sum(1 for r in stats["replicas"] if r["history"]) == 2


def test_engine_stats_and_metrics_per_replica(pool_server):
    client(pool_server).completions.create(model="tiny-llama", prompt="metrics", max_tokens=4)
    stats = httpx.get(pool_server.base_url + "/v1/engine/stats").json()
    ids = {r["replica_id"] for r in stats["replicas"]}
    assert len(ids) == 2
    assert stats["num_blocks"] == sum(r["num_blocks"] for r in stats["replicas"]) == 256
    assert len({r["pid"] for r in stats["replicas"]}) == 2            # two processes
    assert all(r["threads"] == 1 for r in stats["replicas"])

    def metrics():
        text = httpx.get(pool_server.base_url + "/metrics").text
        lines = [ln for ln in text.splitlines() if ln.startswith("iterserve:generation_tokens_total")]
        per = {ln.split('replica="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1])
               for ln in lines if "replica=" in ln}
        total = [float(ln.rsplit(" ", 1)[1]) for ln in lines if "replica=" not in ln]
        return text, per, total

    def settled():
        text, per, total = metrics()
        return set(per) == ids and total and abs(sum(per.values()) - total[0]) < 1e-9 \
            and total[0] > 0 and (text, per, total)

    text, per, total = wait_until(settled)
    assert set(per) == ids, text
    assert sum(per.values()) == total[0] > 0
    assert text.count("# TYPE iterserve:generation_tokens_total") <= 1    # one family
    assert "iterserve:num_free_kv_blocks{" in text


def test_abort_on_disconnect_frees_blocks_on_the_replica(pool_server):
    """A streamed request cut by its client: the abort reaches its replica, whose blocks are
    free again (the per-replica stats say so), and the endpoint keeps serving."""
    async def go():
        async with httpx.AsyncClient(base_url=pool_server.base_url, timeout=30) as c:
            body = {"model": "tiny-llama", "prompt": "abort me", "max_tokens": 200,
                    "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                rid.append(None)
                n = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        n += 1
                        if rid[-1] is None:
                            import json
                            rid[-1] = json.loads(line[6:])["id"]
                    if n >= 3:
                        break                 # leave: the connection closes

    rid: list[str] = []
    asyncio.run(go())

    def freed():
        s = httpx.get(pool_server.base_url + "/v1/engine/stats").json()
        return all(r["num_running"] == 0 and r["num_waiting"] == 0
                   and r["num_free_blocks"] == r["num_blocks"] for r in s["replicas"]) and s

    s = wait_until(freed)
    assert s, httpx.get(pool_server.base_url + "/v1/engine/stats").json()
    assert pool_server.engine.num_in_flight == 0
    trace = httpx.get(f"{pool_server.base_url}/v1/requests/{rid[0]}/trace").json()
    text = httpx.get(pool_server.base_url + "/metrics").text
    assert wait_until(lambda: 'finished_reason="abort"' in
                      httpx.get(pool_server.base_url + "/metrics").text), (trace, [
                          ln for ln in text.splitlines() if "success" in ln])
    # ignore_eos: a sampled answer of a random-weight model may draw its EOS early.
    r = client(pool_server).completions.create(model="tiny-llama", prompt="still", max_tokens=3,
                                               extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_bad_requests_are_4xx_through_the_pool(pool_server):
    c = client(pool_server)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny-llama", prompt="x " * 400, max_tokens=4)   # too long
    with pytest.raises(openai.BadRequestError):                 # fcfs: no priorities
        c.completions.create(model="tiny-llama", prompt="x", max_tokens=4,
                             extra_body={"priority": 3})
    with pytest.raises(openai.BadRequestError):                 # the replica's own check
        c.completions.create(model="tiny-llama", prompt=[[1, 2, 100000]], max_tokens=4)
    assert pool_server.engine.num_in_flight == 0


def test_data_parallel_flag_needs_ray(monkeypatch):
    """Without Ray installed, -dp 2 is a clear error, not a traceback."""
    import builtins

    from iterserve.replicas.launch import require_ray

    real = builtins.__import__

    def no_ray(name, *a, **kw):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(RayNotInstalledError, match=r"iterserve\[ray\]"):
        require_ray()


def test_a_replica_killed_mid_run_fails_its_requests_cleanly(pool_server):
    """ray.kill one replica while 8 streams and 4 non-streamed requests run on both: every
    stream ends within the timeout, never a hang: finished, or (on the victim) a chunk with
    finish_reason "error", an error event in the one shape (type service_unavailable, code
    replica_unavailable), then [DONE]; a non-streamed request on the victim is a 503 with
    Retry-After and that body. The endpoint keeps serving at once, and Ray Serve brings the
    replica back."""
    import json
    import threading

    import ray

    pool = pool_server.engine
    names = pool.router.replica_actor_names()
    assert len(names) == 2
    results: list[tuple[str, int]] = []
    errors: list[dict] = []
    plain: list[httpx.Response | str] = []
    started = threading.Barrier(9)

    def one(i: int) -> None:
        body = {"model": "tiny-llama", "prompt": f"fault {i}", "max_tokens": 200,
                "ignore_eos": True, "stream": True}
        outcome, n, done_last = "none", 0, False
        try:
            with httpx.stream("POST", pool_server.v1 + "/completions", json=body,
                              timeout=60) as r:
                if r.status_code != 200:
                    outcome = f"http {r.status_code}"
                    started.wait(timeout=30)
                else:
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done_last = True
                            outcome = outcome if outcome != "none" else "done-unfinished"
                            break
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            assert outcome == "error", "the choice ends before the error event"
                            errors.append(ev["error"])
                            continue
                        n += 1
                        if n == 2:
                            started.wait(timeout=30)
                        if ev["choices"] and ev["choices"][0].get("finish_reason"):
                            outcome = ev["choices"][0]["finish_reason"]
        except Exception as e:      # a reset connection or a hang (timeout) fails the test
            outcome = f"exception {type(e).__name__}: {e}"
        results.append((outcome if done_last else f"no [DONE] after {outcome}", n))

    def not_streamed(i: int) -> None:
        try:
            plain.append(httpx.post(pool_server.v1 + "/completions", timeout=60, json={
                "model": "tiny-llama", "prompt": f"plain {i}", "max_tokens": 200,
                "ignore_eos": True}))
        except Exception as e:
            plain.append(f"exception {type(e).__name__}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    threads += [threading.Thread(target=not_streamed, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(timeout=30)                 # every stream has its first tokens
    victim = sorted(names)[0]
    ray.kill(ray.get_actor(names[victim], namespace="serve"), no_restart=False)
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    outcomes = [o for o, _ in results]
    assert all(o in ("length", "error") for o in outcomes), results
    assert "error" in outcomes and "length" in outcomes, results    # both replicas had some
    assert len(errors) == outcomes.count("error")
    for err in errors:
        assert err["type"] == "service_unavailable" and err["code"] == "replica_unavailable"
        assert "internal server error" not in err["message"]
    for r in plain:
        assert not isinstance(r, str), plain
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert r.headers.get("retry-after") == "1"
            err = r.json()["error"]
            assert err["type"] == "service_unavailable" and err["code"] == "replica_unavailable"
    # Serving at once, on the survivor (or the restarted one).
    c = client(pool_server)
    for _ in range(4):
        assert c.completions.create(model="tiny-llama", prompt="after", max_tokens=3,
                                    extra_body={"ignore_eos": True}).usage.completion_tokens == 3
    assert wait_until(lambda: len(pool.replica_ids()) == 2 and victim not in pool.replica_ids(),
                      timeout=90), pool.replica_ids()
    assert pool.num_in_flight == 0

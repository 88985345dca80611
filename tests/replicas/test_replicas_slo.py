"""SLO admission through 2 replicas (`-dp 2 --scheduling-policy slo`, 1 slot each): a
request whose TTFT target a replica's forecast cannot meet goes on to the other replica,
and only when neither can meet it is it a 429 `slo_unattainable` with Retry-After (not the
503 of full queues, nor a 5xx: the refusal crosses the process boundary intact); a target
the busy replicas can meet is served."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest


class Stream(threading.Thread):
    """One long streamed completion in a thread, kept open until `stop` is set."""

    def __init__(self, s, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.s, self.prompt, self.max_tokens = s, prompt, max_tokens
        self.stop = threading.Event()
        self.start()

    def run(self) -> None:
        body = {"model": "tiny-llama", "prompt": self.prompt, "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True, "ttft_slo_ms": 600_000}
        with httpx.stream("POST", self.s.v1 + "/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if self.stop.is_set():
                    return
                assert not line.startswith("data: {") or "error" not in json.loads(line[6:])


@pytest.fixture(scope="module")
def slo_pool(start_pool, tmp_path_factory):
    from fixtures.tiny_models import make_tiny_model_dir
    model = make_tiny_model_dir(tmp_path_factory.mktemp("long-tiny-llama"),
                                max_position_embeddings=4096)
    return start_pool(max_num_seqs=1, scheduling_policy="slo", max_model_len=4096,
                      num_kv_blocks=300, model=model)


def test_a_target_no_replica_can_meet_is_a_429_after_both_were_asked(slo_pool):
    s = slo_pool
    pool = s.engine

    def running() -> int:
        return httpx.get(s.base_url + "/v1/engine/stats").json()["num_running"]

    c = openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0, timeout=60)
    # Each replica's step model needs its measured steps before it may refuse anything.
    for _ in range(2):
        c.completions.create(model="tiny-llama", prompt="warm", max_tokens=32,
                             extra_body={"ignore_eos": True})
    # Long answers until one runs on each replica (the router reads stats a few hundred ms
    # old, so two at once may both go to one; the spare waits in that replica's queue).
    streams = [Stream(s, "first", max_tokens=1200)]
    deadline = time.monotonic() + 60
    while running() < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
        if running() < 2 and len(streams) < 4:
            streams.append(Stream(s, f"more {len(streams)}", max_tokens=1200))
    assert running() == 2
    time.sleep(0.5)                          # the answers' steps teach both step models
    retries = pool.num_retries_queue_full
    # Behind ~1,200 decode steps on either replica, 50 ms cannot be met anywhere.
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="tiny-llama", prompt="Hi", max_tokens=2,
                             extra_body={"ttft_slo_ms": 50})
    assert e.value.status_code == 429
    assert e.value.body["code"] == "slo_unattainable"
    assert "no replica can meet" in e.value.body["message"]
    assert 1 <= int(e.value.response.headers["Retry-After"]) <= 120
    assert 0 < int(e.value.response.headers["retry-after-ms"]) <= 120_000
    assert pool.num_retries_queue_full == retries + 1        # the second replica was asked
    # A target the queue can meet is served next to the busy answers.
    r = c.completions.create(model="tiny-llama", prompt="Hi", max_tokens=2,
                             extra_body={"ttft_slo_ms": 600_000, "ignore_eos": True})
    assert r.usage.completion_tokens == 2
    for t in streams:                        # (they may have ended: 1,200 fast steps)
        t.stop.set()
        t.join(timeout=30)
    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running() == 0

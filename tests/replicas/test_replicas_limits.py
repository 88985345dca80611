"""Back-pressure, priorities and timeouts through 2 replicas (1 running + 1 queued each):
503 + Retry-After only once every replica's queue is full, a queued request's timeout ends
its stream with finish_reason "timeout", and priorities are accepted under the priority
policy."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def limited(start_pool, tmp_path_factory):
    from fixtures.tiny_models import make_tiny_model_dir
    model = make_tiny_model_dir(tmp_path_factory.mktemp("long-tiny-llama"),
                                max_position_embeddings=4096)
    # The running requests may decode 4,000 tokens, far longer than the queued ones' 2 s queue
    # timeout on any machine; the test aborts them once it has seen the timeouts. 2 s leaves a
    # loaded machine time to send the over-limit request while both queued ones still wait.
    return start_pool(max_num_seqs=1, max_queued_requests=1, scheduling_policy="priority",
                      queue_timeout=2.0, max_model_len=4096, num_kv_blocks=300,
                      model=model)


class Stream(threading.Thread):
    """One streamed completion read to its end in a thread: status, tokens, finish reason."""

    def __init__(self, s, prompt: str, max_tokens: int = 240) -> None:
        super().__init__(daemon=True)
        self.s, self.prompt, self.max_tokens = s, prompt, max_tokens
        self.status: int | None = None
        self.headers: dict = {}
        self.tokens = 0
        self.finish: str | None = None
        self.first = threading.Event()
        self.stop = threading.Event()    # set: close the stream, which aborts the request
        self.start()

    def run(self) -> None:
        body = {"model": "tiny-llama", "prompt": self.prompt, "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.s.v1 + "/completions", json=body, timeout=60) as r:
            self.status, self.headers = r.status_code, dict(r.headers)
            if r.status_code != 200:
                r.read()
                self.first.set()
                return
            self.first.set()
            for line in r.iter_lines():
                if self.stop.is_set():
                    return
                if line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    if ev.get("choices"):
                        self.tokens += 1
                        self.finish = ev["choices"][0].get("finish_reason") or self.finish


def test_503_only_when_every_replica_queue_is_full_and_queued_requests_time_out(limited):
    s = limited
    pool = s.engine

    def running() -> int:
        return httpx.get(s.base_url + "/v1/engine/stats").json()["num_running"]

    a = Stream(s, "first", max_tokens=4000)
    b = Stream(s, "second", max_tokens=4000)
    deadline = time.monotonic() + 30
    while running() < 2 and time.monotonic() < deadline:     # one running on each replica
        time.sleep(0.05)
    assert running() == 2
    c = Stream(s, "third")
    d = Stream(s, "fourth")
    for t in (c, d):
        assert t.first.wait(30) and t.status == 200, t.status   # queued, one per replica
    # Every queue is full now: the pool tried both replicas, then answered 503.
    r = httpx.post(s.v1 + "/completions", json={"model": "tiny-llama", "prompt": "fifth",
                                                "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.headers.get("retry-after"), r.text
    assert r.json()["error"]["type"] == "service_unavailable"
    assert pool.num_retries_queue_full >= 1
    # The queued two never got a slot: their queue timeout (2 s) ends them.
    for t in (c, d):
        t.join(timeout=30)
        assert t.finish == "timeout" and t.tokens == 1, (t.finish, t.tokens)
    assert a.is_alive() and b.is_alive(), "a running request ended before the queued ones timed out"
    for t in (a, b):
        t.stop.set()
        t.join(timeout=30)
    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:     # the aborts free both slots
        time.sleep(0.05)
    assert running() == 0


def test_priorities_work_through_the_pool(limited):
    c = openai.OpenAI(base_url=limited.v1, api_key="unused", max_retries=0, timeout=60)
    for prio in (0, 5, -3):
        # ignore_eos: the random tiny model may sample its EOS first (unseeded sampling)
        r = c.completions.create(model="tiny-llama", prompt="p", max_tokens=2,
                                 extra_body={"priority": prio, "ignore_eos": True})
        assert r.usage.completion_tokens == 2

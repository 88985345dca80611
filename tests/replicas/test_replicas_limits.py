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
def limited(start_pool):
    # max_model_len 1024: the running requests (1000 tokens) outlast the queued ones' 0.5 s
    # queue timeout by seconds, whatever the machine's load.
    return start_pool(max_num_seqs=1, max_queued_requests=1, scheduling_policy="priority",
                      queue_timeout=0.5, max_model_len=1024)


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

    a = Stream(s, "first", max_tokens=1000)
    b = Stream(s, "second", max_tokens=1000)
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
    # The queued two never got a slot: their queue timeout (0.5 s) ends them.
    for t in (c, d):
        t.join(timeout=30)
        assert t.finish == "timeout" and t.tokens == 1, (t.finish, t.tokens)
    for t in (a, b):
        t.join(timeout=60)
        assert t.finish == "length", t.finish


def test_priorities_work_through_the_pool(limited):
    c = openai.OpenAI(base_url=limited.v1, api_key="unused", max_retries=0, timeout=60)
    for prio in (0, 5, -3):
        # ignore_eos: the random tiny model may sample its EOS first (unseeded sampling)
        r = c.completions.create(model="tiny-llama", prompt="p", max_tokens=2,
                                 extra_body={"priority": prio, "ignore_eos": True})
        assert r.usage.completion_tokens == 2

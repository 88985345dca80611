"""The official `openai` client against `iterserve` serving a tiny random model."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


# --- completions ---------------------------------------------------------------------------

def test_completion_respects_max_tokens_and_reports_usage(client, server):
    r = client.completions.create(model=server.model, prompt="Hello world", max_tokens=5,
                                  **GREEDY)
    assert r.object == "text_completion" and r.model == server.model
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == len(server.engine.tokenizer.encode("Hello world"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_streamed_completion_is_one_token_per_chunk_and_usage_matches(client, server):
    stream = client.completions.create(model=server.model, prompt="Once upon a time",
                                       max_tokens=7, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    token_chunks = [c for c in chunks if c.choices]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(token_chunks) == 7
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert len(usage_chunks) == 1 and usage_chunks[0].usage.completion_tokens == 7
    streamed = "".join(c.choices[0].text for c in token_chunks)
    whole = client.completions.create(model=server.model, prompt="Once upon a time",
                                      max_tokens=7, **GREEDY)
    assert streamed == whole.choices[0].text


def test_stream_ends_with_done(server):
    with httpx.stream("POST", server.v1 + "/completions", timeout=60, json={
            "prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all("choices" in json.loads(e) for e in events[:-1])


def test_n_choices_and_several_prompts_get_openai_indexes(client, server):
    r = client.completions.create(model=server.model, prompt=["Hello", "The sky"], n=2,
                                  max_tokens=3, temperature=1.0, seed=3,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12
    stream = client.completions.create(model=server.model, prompt="Hello", n=3, max_tokens=2,
                                       stream=True, temperature=1.0,
                                       extra_body={"ignore_eos": True})
    per_index: dict[int, int] = {}
    for c in stream:
        for ch in c.choices:
            per_index[ch.index] = per_index.get(ch.index, 0) + 1
    assert per_index == {0: 2, 1: 2, 2: 2}


def test_stop_string_ends_the_text_before_it(client, server):
    free = client.completions.create(model=server.model, prompt="Hello world", max_tokens=10,
                                     **GREEDY).choices[0].text
    stop = next(free[i:i + 2] for i in range(2, len(free) - 2)
                if free[i:i + 2].strip() and "\ufffd" not in free[i:i + 2])
    r = client.completions.create(model=server.model, prompt="Hello world", max_tokens=10,
                                  stop=[stop], **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[:free.index(stop)]


def test_completion_logprobs(client, server):
    r = client.completions.create(model=server.model, prompt="Hello", max_tokens=3,
                                  logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text or "\ufffd" in r.choices[0].text
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(value)       # greedy takes the best


def test_prompt_as_token_ids(client, server):
    r = client.completions.create(model=server.model, prompt=[1, 40, 41, 42], max_tokens=2,
                                  **GREEDY)
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 2


# --- chat ----------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello there"}]


def test_chat_completion(client, server):
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=4,
                                       **GREEDY)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    tok = server.engine.tokenizer
    assert r.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(MESSAGES),
                                                   add_special_tokens=False))
    assert r.usage.completion_tokens == 4


def test_streamed_chat_sends_role_then_one_token_per_chunk(client, server):
    stream = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                            max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks[1:] if c.choices]
    assert len(content) == 5 and content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 5
    text = "".join(c.choices[0].delta.content or "" for c in content)
    whole = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                           max_tokens=5, **GREEDY)
    assert text == whole.choices[0].message.content


def test_chat_logprobs_and_n(client, server):
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=3,
                                       logprobs=True, top_logprobs=2, n=2, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.content) == 3
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert r.choices[0].message.content == r.choices[1].message.content   # greedy


def test_same_greedy_text_alone_and_among_30_others(server):
    async def main():
        c = openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120)
        kw = dict(model=server.model, max_tokens=8, **GREEDY)
        alone = (await c.completions.create(prompt="The little model", **kw)).choices[0].text
        others = [c.completions.create(prompt=f"Noise request {i} " * (1 + i % 4), **kw)
                  for i in range(30)]
        results = await asyncio.gather(c.completions.create(prompt="The little model", **kw),
                                       *others)
        await c.close()
        return alone, results[0].choices[0].text

    alone, batched = asyncio.run(main())
    assert batched == alone


# --- models, health, metrics, traces ---------------------------------------------------------

def test_models_health_and_metrics_names(client, server):
    assert [m.id for m in client.models.list().data] == [server.model]
    assert httpx.get(server.base_url + "/health").json()["status"] == "ok"
    text = httpx.get(server.base_url + "/metrics").text
    for name in ["iterserve:num_requests_running", "iterserve:num_requests_waiting",
                 "iterserve:num_requests_swapped", "iterserve:kv_cache_usage_perc",
                 "iterserve:num_preemptions_total", "iterserve:prompt_tokens_total",
                 "iterserve:generation_tokens_total",
                 "iterserve:time_to_first_token_seconds_bucket",
                 "iterserve:inter_token_latency_seconds_bucket",
                 "iterserve:e2e_request_latency_seconds_bucket",
                 "iterserve:request_queue_time_seconds_bucket"]:
        assert name in text, name


def metric(server, name: str) -> float:
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_token_counters_grow_by_the_tokens_served(client, server):
    before = metric(server, "iterserve:generation_tokens_total")
    client.completions.create(model=server.model, prompt="Hi", max_tokens=4, **GREEDY)
    assert metric(server, "iterserve:generation_tokens_total") == before + 4


def test_metrics_show_the_compute_team(client, server, start_server):
    """The contention adapter's team size is visible: an operator can see the engine shrink
    it on a shared machine; --threads fixes it."""
    import os

    import torch
    client.completions.create(model=server.model, prompt="Hi", max_tokens=2, **GREEDY)
    assert 1 <= metric(server, "iterserve:compute_threads") <= len(os.sched_getaffinity(0))
    assert metric(server, "iterserve:cpu_contended") in (0.0, 1.0)
    before = torch.get_num_threads()       # --threads sets this thread's team too
    try:
        fixed = start_server(threads=1)
        httpx.post(fixed.v1 + "/completions", timeout=60,
                   json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
        assert metric(fixed, "iterserve:compute_threads") == 1.0
        assert metric(fixed, "iterserve:compute_thread_switches") == 0.0
    finally:
        torch.set_num_threads(before)


def test_trace_of_a_finished_request(start_server):
    # priority 3 needs the priority policy (on fcfs it is a 400: test_api_surface.py)
    server = start_server(scheduling_policy="priority")
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60)
    r = client.completions.create(model=server.model, prompt="Trace me", max_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True, "priority": 3})
    t = httpx.get(f"{server.v1}/requests/{r.id}/trace").json()
    assert t["request_id"] == r.id and t["finish_reason"] == "length" and t["priority"] == 3
    names = [e["event"] for e in t["events"]]
    assert names[0] == "arrived" and names[-1] == "finished"
    assert {"queued", "scheduled", "prefill_chunk", "first_token"} <= set(names)
    assert all("time" in e and "step" in e for e in t["events"])
    missing = httpx.get(f"{server.v1}/requests/nope/trace")
    assert missing.status_code == 404 and "error" in missing.json()


def test_engine_stats_for_the_live_view(client, server):
    client.completions.create(model=server.model, prompt="Hi", max_tokens=2, **GREEDY)
    s = httpx.get(server.v1 + "/engine/stats").json()
    assert {"model", "step", "num_running", "num_waiting", "num_swapped", "kv_cache_usage",
            "num_free_blocks", "num_blocks", "num_preemptions_total", "history",
            "recent_requests"} <= set(s)
    assert s["history"] and s["recent_requests"] and s["num_blocks"] == 128


# --- cancellation, timeouts, back-pressure ----------------------------------------------------

def wait_until(cond, timeout: float = 10.0) -> bool:
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(scope="module")
def long_server(start_server):
    """Room for 1000-token requests: they run for seconds, whatever the machine's speed."""
    return start_server(max_model_len=1024)


def test_client_disconnect_mid_stream_frees_the_blocks(long_server):
    server = long_server
    with httpx.stream("POST", server.v1 + "/completions", timeout=60, json={
            "prompt": "Hello world", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}) as r:
        rid = r.headers["x-request-id"]
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
        assert metric(server, "iterserve:num_requests_running") == 1
    # the connection is closed: the request is aborted and its blocks freed
    assert wait_until(lambda: metric(server, "iterserve:num_requests_running") == 0
                      and metric(server, "iterserve:kv_cache_usage_perc") == 0.0)
    trace = httpx.get(f"{server.v1}/requests/{rid}/trace").json()
    assert trace["finish_reason"] == "abort" and trace["output_tokens"] < 1000


def test_timeout_ends_the_request_with_its_reason_and_frees_blocks(start_server):
    s = start_server(request_timeout=0.3, max_model_len=1024)
    c = openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0, timeout=60)
    r = c.completions.create(model=s.model, prompt="Hello", max_tokens=1000, **GREEDY)
    assert r.choices[0].finish_reason == "timeout"
    assert r.usage.completion_tokens < 1000
    assert metric(s, "iterserve:kv_cache_usage_perc") == 0.0


def test_full_queue_answers_503_with_retry_after(start_server):
    # One running slot, one queue slot; the running request needs >= 1000 steps (seconds),
    # so the second request surely waits and the third finds the queue full.
    s = start_server(max_num_seqs=1, max_queued_requests=1, max_model_len=1024)
    body = {"prompt": "Hello", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=s.v1, timeout=60) as http:
        with http.stream("POST", "/completions", json=body) as running:
            lines = running.iter_lines()        # kept: dropping it closes the connection
            next(line for line in lines if line.startswith("data: "))
            with http.stream("POST", "/completions", json=body) as queued:
                assert queued.status_code == 200
                refused = httpx.post(s.v1 + "/completions", json=body, timeout=60)
                assert refused.status_code == 503
                assert refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["message"]
    assert wait_until(lambda: metric(s, "iterserve:num_requests_running") == 0
                      and metric(s, "iterserve:num_requests_waiting") == 0)
    ok = httpx.post(s.v1 + "/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_api_key_is_required_when_set(start_server):
    s = start_server(api_key="sekret")
    bad = openai.OpenAI(base_url=s.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.post(s.v1 + "/completions", json={"prompt": "x"}).status_code == 401
    good = openai.OpenAI(base_url=s.v1, api_key="sekret", max_retries=0)
    assert good.completions.create(model=s.model, prompt="Hi", max_tokens=1).choices
    assert httpx.get(s.base_url + "/health").status_code == 200


def test_non_streaming_client_that_gives_up_gets_its_request_aborted(long_server):
    s = long_server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.v1 + "/completions", timeout=0.5, json={
            "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True})
    aborted = 'iterserve:request_success_total{finished_reason="abort"'
    assert wait_until(lambda: aborted in httpx.get(s.base_url + "/metrics").text)
    assert wait_until(lambda: metric(s, "iterserve:kv_cache_usage_perc") == 0.0)


def test_engine_stats_report_the_memory_plan(server):
    """What the server planned to use is visible over HTTP, not only in the log."""
    plan = httpx.get(server.v1 + "/engine/stats").json()["memory"]
    assert plan["fits"] is True
    assert plan["weights"]["bytes"] > 0 and plan["weights"]["bytes_by_encoding"]
    assert plan["kv_cache"]["num_blocks"] == 128       # the fixture's num_kv_blocks
    assert plan["kv_cache"]["bytes"] > 0
    assert plan["planned_peak_bytes"] >= plan["weights"]["bytes"] + plan["kv_cache"]["bytes"]

"""Per-request latency targets over HTTP: `ttft_slo_ms` / `tpot_slo_ms` as extra
body fields, driven with the official `openai` client against a real uvicorn server.

- any policy but slo: a 400 naming the field and saying it needs --scheduling-policy slo;
- bad values (0, negative, NaN, infinity, a string, above an hour): a 400 naming the field;
- under slo: the field reaches the scheduler's policy: a tiny TPOT target holds a second
  request back while the first runs; a TTFT target the busy engine cannot meet is refused
  early with 429 + Retry-After and an OpenAI error body, and nothing leaks.
"""

from __future__ import annotations

import math
import threading
import time

import httpx
import openai
import pytest

from iterserve.errors import SamplingParamsError


MESSAGES = [{"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0.0}


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def fcfs(start_server):
    return start_server()


@pytest.mark.parametrize("field", ["ttft_slo_ms", "tpot_slo_ms"])
def test_a_target_without_the_slo_policy_is_a_400_naming_it(fcfs, field):
    client = _client(fcfs)
    for call in (
            lambda: client.completions.create(model=fcfs.model, prompt="x", max_tokens=1,
                                              extra_body={field: 500}),
            lambda: client.chat.completions.create(model=fcfs.model, messages=MESSAGES,
                                                   max_tokens=1, extra_body={field: 500.5})):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == field
        assert "--scheduling-policy slo" in e.value.body["message"]
        assert "fcfs" in e.value.body["message"]
    # the same server still serves the request without it, and nothing leaked
    r = client.completions.create(model=fcfs.model, prompt="x", max_tokens=2, **GREEDY)
    assert r.choices[0].finish_reason == "length"
    assert fcfs.engine.num_in_flight == 0


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "0", "-5", "3600000.5",
                                   '"100"', "true"])
@pytest.mark.parametrize("field", ["ttft_slo_ms", "tpot_slo_ms"])
def test_bad_values_are_a_400_naming_the_field(fcfs, field, value):
    for path, body in (("/completions", '{"prompt": "x", "max_tokens": 1, '),
                       ("/chat/completions",
                        '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, ')):
        r = httpx.post(fcfs.v1 + path, timeout=30, content=f'{body}"{field}": {value}}}',
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, value, r.text)
        err = r.json()["error"]
        assert err["param"] == field and err["type"] == "invalid_request_error"


def test_offline_params_validate_the_targets():
    from iterserve.core.request import SamplingParams

    SamplingParams(ttft_slo_ms=250, tpot_slo_ms=50.0).validate()
    for bad in (float("nan"), float("inf"), 0.0, -1.0, 4e6, "100", True):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(ttft_slo_ms=bad).validate()
        assert e.value.param == "ttft_slo_ms"


def test_a_tpot_target_reaches_the_policy_and_holds_admission(start_server):
    # A 0.001 ms TPOT target on the first request: while it runs, no second decode fits.
    server = start_server(scheduling_policy="slo", max_num_seqs=4)
    client = _client(server)
    slo = server.engine.engine.scheduler.slo
    held_before = slo.num_held_steps
    results: dict[str, object] = {}

    def first() -> None:
        results["first"] = client.completions.create(
            model=server.model, prompt="Hello", max_tokens=40, extra_body={
                "ignore_eos": True, "tpot_slo_ms": 0.001}, **GREEDY)

    t = threading.Thread(target=first)
    t.start()
    deadline = time.monotonic() + 60
    while server.engine.num_in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    second = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                            max_tokens=4, **GREEDY)
    t.join(timeout=120)
    assert results["first"].choices[0].finish_reason == "length"
    assert len(results["first"].choices[0].text) > 0
    assert second.choices[0].finish_reason in ("length", "stop")
    assert slo.num_held_steps > held_before        # the second waited for the first


def test_an_unattainable_ttft_target_is_a_429_with_retry_after(start_server):
    # One slot and a backlog of long answers (240 steps each). A probe with a TTFT target
    # and nothing else to rank it by is queued ahead of the untargeted backlog, so what it
    # waits for is the rest of the running answer: each probe is sent just after a fresh
    # answer starts (>= 200 steps left) with a target of ~12 steps, which its own prefill
    # alone could meet (a few steps) but the queue cannot: a 429 to retry later, not the
    # request's own 400, whatever this machine's step time.
    server = start_server(scheduling_policy="slo", max_num_seqs=1)
    client = _client(server)
    scheduler = server.engine.engine.scheduler
    slo = scheduler.slo
    free = scheduler.stats().num_free_blocks
    backlog = [threading.Thread(target=lambda: client.completions.create(
        model=server.model, prompt="Hello there", max_tokens=240,
        extra_body={"ignore_eos": True}, **GREEDY)) for _ in range(12)]
    for t in backlog:
        t.start()
    deadline = time.monotonic() + 90
    while (slo.admission_rate is None or slo.model.num_observed < 20) \
            and time.monotonic() < deadline and any(t.is_alive() for t in backlog[1:]):
        time.sleep(0.02)
    assert slo.admission_rate is not None, ("the backlog never measured an admission rate",
                                           slo.stats(), slo._sat_seconds, slo.model.num_observed)

    def just_started() -> None:
        """Wait for the running answer to be a fresh one (most of its 240 steps to go)."""
        seen = {r.request_id for r in list(scheduler.running)}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            running = list(scheduler.running)
            if running and running[0].request_id not in seen \
                    and len(running[0].output_token_ids) <= 10:
                return
            seen |= {r.request_id for r in running}
            time.sleep(0.0005)
        raise AssertionError("no fresh answer started in the backlog")

    step_ms = (slo._last_step_s + slo.overhead_s) * 1000.0
    alone_ms = slo.prefill_time(32, 0, 0, typical=True) * 1000.0
    target = max(math.ceil(12 * step_ms), math.ceil(3 * alone_ms), 1)
    refused_before = slo.num_refused
    for call in (
            lambda: client.completions.create(model=server.model, prompt="Hi", max_tokens=2,
                                              extra_body={"ttft_slo_ms": target}),
            lambda: client.chat.completions.create(model=server.model, messages=MESSAGES,
                                                   max_tokens=2,
                                                   extra_body={"ttft_slo_ms": target})):
        just_started()
        with pytest.raises(openai.RateLimitError) as e:
            call()
        assert e.value.status_code == 429
        assert e.value.body["code"] == "slo_unattainable"
        assert f"ttft_slo_ms={target}" in e.value.body["message"]
        assert int(e.value.response.headers["Retry-After"]) >= 1
    assert slo.num_refused == refused_before + 2
    # a target it can meet is served while the backlog runs
    r = client.completions.create(model=server.model, prompt="Hi", max_tokens=2,
                                  extra_body={"ttft_slo_ms": 600_000}, **GREEDY)
    assert r.choices[0].finish_reason == "length"
    for t in backlog:
        t.join(timeout=300)
    deadline = time.monotonic() + 30
    while server.engine.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.engine.engine.scheduler.stats().num_free_blocks == free   # no KV leaked


def test_overload_gets_429_retry_after_and_admitted_requests_meet_their_ttft(start_server):
    """A burst of streamed requests into two slots, through the openai client: the ones the
    policy admits get their first token within the 300 ms target (measured here, as a user
    would), the rest are refused at once with 429, OpenAI's error body and Retry-After /
    retry-after-ms equal to the predicted wait (<= 120 s); a client that retries as told is
    served; the forecast errors are in /metrics."""
    server = start_server(scheduling_policy="slo", max_num_seqs=2, slo_ttft_ms=300)
    client = _client(server)
    slo = server.engine.engine.scheduler.slo
    client.completions.create(model=server.model, prompt="warm", max_tokens=40,
                              extra_body={"ignore_eos": True}, **GREEDY)
    assert slo.model.num_observed >= 20
    ttfts: list[float] = []
    refused: list[openai.RateLimitError] = []
    others: list[Exception] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        t0 = time.perf_counter()
        try:
            stream = client.completions.create(
                model=server.model, prompt=f"Request {i}", max_tokens=240, stream=True,
                extra_body={"ignore_eos": True}, **GREEDY)
            first = None
            for chunk in stream:            # read to the end: an admitted request keeps its
                if first is None and chunk.choices and chunk.choices[0].text:   # slot
                    first = time.perf_counter() - t0
            with lock:
                ttfts.append(first)
        except openai.RateLimitError as e:
            with lock:
                refused.append(e)
        except Exception as e:              # anything else fails the test below
            with lock:
                others.append(e)

    # Enough requests that the last would wait twice the target behind 240-token answers
    # in two slots, at the step time the policy measured (a fast machine needs more).
    step_s = slo.model.predict(tokens=2, seqs=2, kv_tokens=256)
    rounds = math.ceil(2 * 0.3 / (240 * step_s))
    n = min(48, max(8, 2 + 2 * rounds))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(timeout=120)
    assert not others, others
    assert ttfts and refused, (ttfts, len(refused))
    assert all(t <= 0.3 for t in ttfts), ttfts
    for e in refused:
        assert e.status_code == 429 and e.body["code"] == "slo_unattainable"
        assert e.body["type"] == "rate_limit_exceeded" and "ttft_slo_ms=300" in e.body["message"]
        h = e.response.headers
        assert 1 <= int(h["Retry-After"]) <= 120
        ms = int(h["retry-after-ms"])
        assert 0 < ms <= 120_000 and int(h["Retry-After"]) == max(1, -(-ms // 1000))
    # With retries on, the openai client waits as told and is served.
    patient = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=8, timeout=300)
    r = patient.completions.create(model=server.model, prompt="Hi", max_tokens=2, **GREEDY)
    assert r.choices[0].finish_reason == "length"
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert 'iterserve:slo_ttft_forecast_error_seconds{model_name=' in text
    assert "iterserve:slo_requests_refused" in text
    deadline = time.monotonic() + 60
    while server.engine.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.engine.num_in_flight == 0

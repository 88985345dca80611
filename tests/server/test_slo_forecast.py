"""The slo policy's TTFT forecast against the TTFT a client measures, on a real server.

Bursts of streamed requests (official `openai` client, real HTTP, the tiny model) overload a
slo server whose step time is whatever this machine gives it now, loaded or not: the
target is set from the step time the policy measured (about 60 steps of a full batch), so
the bursts overload it on any machine. The first bursts teach the online correction; over
the later ones, the admitted requests must meet their target at the rate the policy
promises (its quantile, 95%, with slack for a few dozen samples on a loaded machine), the
refused ones get 429 with Retry-After and retry-after-ms,
and the forecast (server side, from arrival) must be close to the actual TTFT at the median.
"""

from __future__ import annotations

import threading
import time

import openai

BURSTS_TO_LEARN = 3
BURSTS_MEASURED = 3
BURSTS_MEASURED_MAX = 9                 # bounded: more bursts only to reach MIN_ADMITTED
MIN_ADMITTED = 12
PER_BURST = 24
MAX_TOKENS = 48


def _burst(server, target_ms: float, i0: int) -> list[tuple[float | None, bool]]:
    """PER_BURST streamed requests 5 ms apart: (client TTFT s, admitted) each."""
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=300)
    out: list[tuple[float | None, bool]] = []
    errors: list[Exception] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        t0 = time.perf_counter()
        try:
            stream = client.completions.create(
                model=server.model, prompt=f"Request number {i} " * (1 + i % 4),
                max_tokens=MAX_TOKENS, stream=True, temperature=0.0,
                extra_body={"ignore_eos": True, "ttft_slo_ms": target_ms})
            first = None
            for chunk in stream:                # to the end: an admitted request keeps
                if first is None and chunk.choices and chunk.choices[0].text:   # its slot
                    first = time.perf_counter() - t0
            with lock:
                out.append((first, True))
        except openai.RateLimitError as e:
            assert e.body["code"] == "slo_unattainable"
            assert 1 <= int(e.response.headers["Retry-After"]) <= 120
            assert 0 < int(e.response.headers["retry-after-ms"]) <= 120_000
            with lock:
                out.append((None, False))
        except Exception as e:                  # anything else fails the test
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=one, args=(i0 + i,)) for i in range(PER_BURST)]
    for t in threads:
        t.start()
        time.sleep(0.005)
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return out


def _drain(server) -> None:
    deadline = time.monotonic() + 60
    while server.engine.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)


def test_admitted_requests_meet_the_forecast_target_at_the_promised_rate(start_server):
    server = start_server(scheduling_policy="slo", max_num_seqs=4)
    slo = server.engine.engine.scheduler.slo
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=300)
    for _ in range(3):                          # the step model's first measured steps
        client.completions.create(model=server.model, prompt="warm", max_tokens=MAX_TOKENS,
                                  temperature=0.0, extra_body={"ignore_eos": True})
    assert slo.model.num_observed >= 20
    # About 60 steps of a full batch at the measured (mean) step time: one burst queues
    # several answers' worth of work ahead of its last requests.
    step_s = slo._step_seconds(4, 4, 4 * 40, 0, 0)
    target_ms = min(max(60 * step_s * 1000, 150.0), 5000.0)

    for b in range(BURSTS_TO_LEARN):
        _burst(server, target_ms, 1000 * b)
        _drain(server)
    n0 = slo.errors.num_recorded
    results: list[tuple[float | None, bool]] = []
    # A slow moment on a shared machine inflates the learned correction, and then a burst
    # admits only its first few requests; the claim below needs a dozen samples, so more
    # bursts are measured (bounded) until that many were admitted.
    for b in range(BURSTS_MEASURED_MAX):
        if b >= BURSTS_MEASURED and sum(ok for _, ok in results) >= MIN_ADMITTED:
            break
        results += _burst(server, target_ms, 1000 * (BURSTS_TO_LEARN + b))
        _drain(server)

    admitted = [t for t, ok in results if ok]
    assert sum(not ok for _, ok in results), "the bursts overloaded nothing"
    assert len(admitted) >= MIN_ADMITTED, (len(admitted), target_ms, slo.errors.factor())
    assert all(t is not None for t in admitted)
    met = sum(t <= target_ms / 1000 for t in admitted) / len(admitted)
    # The policy aims at 95% (its correction's quantile). A few dozen samples on a machine
    # that other work slows by 10-50x at any moment (measured at load averages of 10-16 on
    # 2 cores: 75-100% met; without the mean bias and the floored correction, 17%) leave
    # this much slack.
    assert met >= 0.7, (met, sorted(admitted), target_ms, slo.errors.factor(),
                         slo.model.mean_bias)
    # Server side, the forecast (unscaled, from arrival) against the actual TTFT of the
    # measured requests: the median error is a small share of the target.
    rows = [(p, a) for i, p, a in slo.errors.errors if i > n0]
    assert len(rows) == len(admitted)
    errs = sorted(abs(a - p) / (target_ms / 1000) for p, a in rows)
    assert errs[len(errs) // 2] <= 0.25, (errs, target_ms)
    assert server.engine.num_in_flight == 0

"""The slo policy's TTFT forecast and its online correction, on simulated steps.

A fake executor advances the clock by a known step time (the "machine"), which may differ
from the step-time model the policy is seeded with (the "prior"): the policy must learn the
machine from the steps it observes, and the requests it admits must meet their TTFT target
at least 95% of the time under Poisson overload. Everything is seeded: deterministic.
"""

import random

import pytest

from iterserve.core.config import CacheConfig, SchedulerConfig
from iterserve.core.request import Request, SamplingParams
from iterserve.core.scheduler import Scheduler
from iterserve.core.slo_policy import SLOUnattainableError
from iterserve.core.step_time import StepTimeModel
from iterserve.core.ttft_forecast import ErrorTracker, Limits, Work, forecast

PRIOR = dict(c0=0.010, c_tok=0.0, c_seq=0.002, c_kv=0.0, c_prefill_tok=0.001)


def linear(c0=0.010, seq=0.002, pre=0.001):
    return lambda tokens, seqs, kv, prefill, pairs: c0 + seq * seqs + pre * prefill


class Machine:
    """A scheduler under the slo policy and a fake executor whose step costs
    `speed` x (c0 + c_seq x seqs + c_prefill_tok x prefill tokens) + jitter."""

    def __init__(self, speed=1.0, jitter=0.0, seed=0, **cfg):
        self.t = 0.0
        self.speed, self.jitter = speed, jitter
        self.rng = random.Random(seed)
        cfg.setdefault("max_num_seqs", 8)
        cfg.setdefault("max_num_batched_tokens", 256)
        cfg.setdefault("max_model_len", 2048)
        # No prefix caching: the simulated prompts share their tokens, and the forecast (made
        # at arrival, before the cache lookup) prices every prompt token.
        self.s = Scheduler(SchedulerConfig(scheduling_policy="slo", **cfg),
                           CacheConfig(block_size=16, num_kv_blocks=8192,
                                       enable_prefix_caching=False), clock=lambda: self.t)
        self.s.slo.model = StepTimeModel(PRIOR)
        self.refused: list[SLOUnattainableError] = []
        self.admitted: list[Request] = []

    def add(self, rid, prompt_len, max_tokens, ttft_ms):
        r = Request(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    arrival_time=self.t, ttft_slo_ms=ttft_ms)
        try:
            self.s.add_request(r)
        except SLOUnattainableError as e:
            self.refused.append(e)
            return None
        self.admitted.append(r)
        return r

    def step(self):
        s = self.s
        out = s.schedule()
        if not out.num_scheduled_tokens:
            self.t += 0.005
            s.update_from_output(out, {})
            return
        prefill = sum(n for rid, n in out.num_scheduled_tokens.items()
                      if n > 1 or s.requests[rid].num_computed_tokens
                      < s.requests[rid].num_prompt_tokens)
        dt = self.speed * (PRIOR["c0"] + PRIOR["c_seq"] * len(out.num_scheduled_tokens)
                           + PRIOR["c_prefill_tok"] * prefill)
        self.t += dt * (1.0 + self.jitter * self.rng.uniform(-1, 1))
        sampled = {rid: 2 for rid, n in out.num_scheduled_tokens.items()
                   if s.requests[rid].num_computed_tokens + n >= s.requests[rid].num_tokens}
        s.update_from_output(out, sampled)

    def warm(self):
        """Serve a little first: the policy refuses nothing before it has measured steps."""
        for i in range(4):
            self.add(f"warm{i}", 100, 20, None)
        while self.s.has_unfinished_requests():
            self.step()
        self.admitted.clear()

    def run_poisson(self, rate, n, ttft_ms, seed=1):
        rng = random.Random(seed)
        t = self.t
        arrivals = []
        for i in range(n):
            t += rng.expovariate(rate)
            long = rng.random() < 0.2
            arrivals.append((t, f"r{i}", rng.randint(20, 400),
                             rng.randint(150, 300) if long else rng.randint(10, 60)))
        i = 0
        while i < len(arrivals) or self.s.has_unfinished_requests():
            while i < len(arrivals) and arrivals[i][0] <= self.t:
                _, rid, p, m = arrivals[i]
                self.add(rid, p, m, ttft_ms)
                i += 1
            if self.s.has_unfinished_requests():
                self.step()
            elif i < len(arrivals):
                self.t = arrivals[i][0]


def test_forecast_waits_for_a_slot_then_prefills():
    lim = Limits(max_num_seqs=2, budget=256)
    running = [Work(0, 10, 50), Work(0, 30, 50)]
    # Slot frees after 10 decode steps of 2 seqs (14 ms), then a 100-token prefill next to
    # the remaining decode: 10 + 2 * 2 + 100 = 114 ms.
    first = forecast(running, [Work(100, 5, 0)], lim, linear())
    assert first == [pytest.approx(10 * 0.014 + 0.114)]
    # A second queued request waits for the other slot (30 steps in all), behind the first.
    first = forecast(running, [Work(100, 50, 0), Work(20, 5, 0)], lim, linear())
    assert first[0] == pytest.approx(0.254)
    assert first[1] > first[0] and first[1] == pytest.approx(
        0.254 + 19 * 0.014 + (0.010 + 0.004 + 0.020), rel=1e-6)


def test_forecast_chunks_a_long_prompt_and_honours_the_partial_cap():
    lim = Limits(max_num_seqs=8, budget=128)
    # 300 tokens in chunks of 128, 128, 44 (alone): three steps.
    [f] = forecast([], [Work(300, 4, 0)], lim, linear())
    assert f == pytest.approx(3 * (0.010 + 0.002) + 0.300)
    # Behind it, a short prompt waits: the budget of the first two steps is spent on the
    # long one's chunks; it rides along with the last one.
    f1, f2 = forecast([], [Work(300, 4, 0), Work(10, 4, 0)], lim, linear())
    assert f2 == f1 == pytest.approx(3 * 0.010 + 0.002 * 4 + 0.310)
    # A second long prompt cannot start mid-way beside the first (one partial prefill).
    f1, f2 = forecast([], [Work(300, 4, 0), Work(200, 4, 0)], lim, linear())
    assert f2 > f1


def test_forecast_respects_the_tpot_hold():
    lim = Limits(max_num_seqs=8, budget=256, tpot_headroom=1.0)
    running = [Work(0, 20, 10, tpot_s=0.0145)] * 2     # one more decode: 16 ms > 14.5 ms
    [f] = forecast(running, [Work(10, 4, 0)], lim, linear())
    assert f > 20 * 0.014                               # waited for the batch to end


def test_error_tracker_factor_follows_the_quantile():
    tr = ErrorTracker(window=100, quantile=0.9, min_samples=10)
    assert tr.factor() == 1.0
    for i in range(100):
        tr.record(1.0, 1.0 + i / 100, target_s=2.0)    # ratios 1.00 .. 1.99
    assert tr.factor() == pytest.approx(1.891, abs=0.01)
    tr.record(0.01, 5.0, target_s=2.0)                  # far below its target: not a ratio
    assert tr.factor() == pytest.approx(1.891, abs=0.01)
    s = tr.summary()
    assert s["count"] == 101 and s["error_p50_s"] == pytest.approx(0.5, abs=0.02)
    assert s["error_p99_s"] >= s["error_p90_s"] >= s["error_p50_s"]


@pytest.mark.parametrize("speed", [1.0, 2.5])
@pytest.mark.parametrize("load", [1.5, 3.0])
def test_admitted_requests_meet_their_ttft_under_poisson_overload(speed, load):
    """The machine is as the prior says (1.0) or 2.5x slower: either way, at 1.5x and 3x
    its capacity, >= 95% of the admitted requests get their first token within the target,
    some requests are refused, and the forecasts end up close to the actual TTFTs."""
    m = Machine(speed=speed, jitter=0.2)
    m.warm()
    # Capacity of 8 slots, mean 66 output tokens at ~26 ms a step (x speed): ~4.6 req/s.
    rate = load * 4.6 / speed
    m.run_poisson(rate, 400, ttft_ms=1000.0)
    ttfts = [r.first_token_time - r.arrival_time for r in m.admitted]
    met = sum(t <= 1.0 for t in ttfts) / len(ttfts)
    assert met >= 0.95, (met, len(m.admitted), len(m.refused))
    assert m.refused, "overload refused nothing"
    assert len(m.admitted) > 0.2 * 400
    for e in m.refused:
        if e.retry_after_s is not None:
            assert 0 < e.retry_after_s <= 120
    summary = m.s.slo.errors.summary()
    assert summary["count"] == len(m.admitted)
    assert abs(summary["error_p50_s"]) < 0.25      # median forecast within 250 ms


def test_the_step_model_learns_a_slower_machine():
    """Seeded with a prior 2.5x too fast, the online fit follows the measured steps: a
    forecast made after a few hundred steps matches the simulated step time."""
    m = Machine(speed=2.5)
    m.run_poisson(2.0, 60, ttft_ms=None)
    model = m.s.slo.model
    assert model.num_observed > 200
    predicted = model.predict(4, 4, 400, 0, 0)
    assert predicted == pytest.approx(2.5 * (0.010 + 4 * 0.002), rel=0.1)

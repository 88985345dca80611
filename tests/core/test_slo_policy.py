"""The `slo` policy: slack order, early refusal (SLOUnattainableError), the TPOT hold.

A fake executor advances the clock by a known linear step time between schedule() and
update_from_output(), as the engine's real executor and the lab's simulated one do, so the
policy's step-time model is fed through its normal path. The scheduler's books are checked
after every step.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.core.config import CacheConfig, SchedulerConfig
from iterserve.core.request import Request, RequestStatus, SamplingParams
from iterserve.core.scheduler import Scheduler
from iterserve.core.step_time import StepTimeModel
from iterserve.errors import ConfigError, QueueFullError, SLOUnattainableError, SamplingParamsError

COST = dict(c0=0.010, c_tok=0.0, c_seq=0.002, c_kv=0.0, c_prefill_tok=0.001)


def step_seconds(s, out):
    """The fake executor's step time (read before update_from_output advances the requests)."""
    prefill = 0
    for rid, n in out.num_scheduled_tokens.items():
        r = s.requests[rid]
        if n > 1 or r.num_computed_tokens < r.num_prompt_tokens:
            prefill += n
    return (COST["c0"] + COST["c_seq"] * len(out.num_scheduled_tokens)
            + COST["c_prefill_tok"] * prefill)


def sampled(s, out):
    return {rid: 2 for rid, n in out.num_scheduled_tokens.items()
            if s.requests[rid].num_computed_tokens + n >= s.requests[rid].num_tokens}


class Engine:
    def __init__(self, **cfg):
        self.t = 0.0
        cfg.setdefault("max_num_seqs", 64)
        cfg.setdefault("max_num_batched_tokens", 512)
        cfg.setdefault("max_model_len", 1024)
        self.s = Scheduler(SchedulerConfig(scheduling_policy="slo", **cfg),
                           CacheConfig(block_size=16, num_kv_blocks=4096), clock=lambda: self.t)
        self.s.slo.model = StepTimeModel(COST)
        self.order: list[str] = []

    def add(self, rid, prompt_len=10, max_tokens=20, **kw):
        r = Request(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    arrival_time=self.t, **kw)
        self.s.add_request(r)
        return r

    def step(self):
        s = self.s
        out = s.schedule()
        s.check_consistency()
        for d in out.scheduled_new_reqs:
            if d.req_id not in self.order:
                self.order.append(d.req_id)
        self.last_step_s = step_seconds(s, out) if out.num_scheduled_tokens else 0.01
        self.decode_only = all(n == 1 and s.requests[rid].num_computed_tokens
                               >= s.requests[rid].num_prompt_tokens
                               for rid, n in out.num_scheduled_tokens.items())
        tokens = sampled(s, out)
        self.t += self.last_step_s
        done = s.update_from_output(out, tokens)
        s.check_consistency()
        return out, done

    def warm(self):
        """Serve a little so the policy has measured steps (it refuses nothing before)."""
        self.add("warm", max_tokens=30)
        self.drain()

    def drain(self, limit=100_000):
        for _ in range(limit):
            if not self.s.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("did not drain")


def test_config():
    with pytest.raises(ConfigError):
        SchedulerConfig(scheduling_policy="slo", slo_ttft_ms=0).validate()
    with pytest.raises(ConfigError):
        SchedulerConfig(scheduling_policy="slo", slo_tpot_ms=float("nan")).validate()
    with pytest.raises(ConfigError):
        SchedulerConfig(scheduling_policy="edf").validate()
    e = Engine(slo_ttft_ms=500.0, slo_tpot_ms=80.0)
    r = e.add("a")
    assert (r.ttft_slo_ms, r.tpot_slo_ms) == (500.0, 80.0)        # defaults from the config
    r = e.add("b", ttft_slo_ms=2000.0)
    assert (r.ttft_slo_ms, r.tpot_slo_ms) == (2000.0, 80.0)       # per-request override
    e.drain()


def test_waiting_requests_are_admitted_by_slack():
    """One slot: the queue is served tightest deadline first (a long prompt, whose prefill
    eats its slack, before a short one with the same target), requests without a target last."""
    e = Engine(max_num_seqs=1)
    e.add("running", max_tokens=5)
    e.step()
    e.add("none")                                              # no target
    e.add("loose", ttft_slo_ms=60_000.0)
    e.add("tight-short", ttft_slo_ms=5_000.0, prompt_len=10)
    e.add("tight-long", ttft_slo_ms=5_000.0, prompt_len=400)   # ~0.4 s of prefill
    e.add("tighter", ttft_slo_ms=3_000.0)
    assert [r.request_id for r in e.s.waiting] == [
        "tighter", "tight-long", "tight-short", "loose", "none"]
    e.drain()
    assert e.order == ["running", "tighter", "tight-long", "tight-short", "loose", "none"]


def _late_behind_a_queue(target_ms) -> "Engine":
    """One slot; a queue of 20 ten-token requests with TTFT targets `target_ms(i)` (a slot
    frees every ~0.13 s of the fake clock); and "late", admitted early (before any refusal)
    with a 100 ms target that the running request's slot makes it miss. Drained."""
    e = Engine(max_num_seqs=1)
    e.add("running", max_tokens=10)
    e.step()
    e.add("late", ttft_slo_ms=100.0)
    for i in range(20):
        e.add(f"q{i}", max_tokens=10, ttft_slo_ms=target_ms(i))
    e.drain()
    assert e.s.slo.admission_rate is not None
    return e


def test_a_late_request_goes_first_once_the_on_time_head_can_wait_a_slot():
    """An admitted request that went late is not left until the overload ends: once the
    admission rate is measured, an on-time head with a minute of slack can wait one more
    admission, so the late request takes the next slot instead of the twenty-first."""
    e = _late_behind_a_queue(lambda i: 60_000.0)
    assert e.order.index("late") < 15, e.order


def test_a_late_request_waits_behind_on_time_heads_without_that_slack():
    """Each queued request's target just covers its own turn (~0.13 s a slot): none can
    give a slot away, so the late request is served after them all."""
    e = _late_behind_a_queue(lambda i: 200.0 + 130.0 * i)
    assert e.order[-1] == "late", e.order


def test_a_request_past_its_slack_waits_behind_on_time_ones_before_the_rate_is_known():
    e = Engine(max_num_seqs=1)
    e.add("running", max_tokens=30)
    e.step()
    e.add("late", ttft_slo_ms=100.0)          # fits an idle engine, but "running" holds the slot
    e.add("on-time", ttft_slo_ms=60_000.0)
    e.drain()
    assert e.order == ["running", "on-time", "late"]
    assert e.s.get_request("late") is None   # served, not dropped


def test_a_fresh_engine_refuses_nothing_until_it_has_measured_steps():
    """The seed may come from another machine: no refusal on its word alone."""
    e = Engine()
    e.add("huge", prompt_len=900, ttft_slo_ms=100.0)
    e.drain()


def test_refuses_a_prompt_that_cannot_make_its_ttft_even_on_an_idle_engine():
    e = Engine()
    e.warm()
    with pytest.raises(SLOUnattainableError) as exc:
        e.add("huge", prompt_len=900, ttft_slo_ms=100.0)      # ~0.9 s of prefill alone
    err = exc.value
    assert isinstance(err, QueueFullError)                    # the server's 429 path
    assert err.retry_after_s is None and err.predicted_ttft_s > err.ttft_slo_s == 0.1
    assert "ttft_slo_ms" in str(err)
    assert e.s.get_request("huge") is None and not e.s.has_unfinished_requests()
    bm = e.s.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_refuses_early_at_capacity_with_a_retry_after():
    """Two slots held by long answers: a new request waits for one of them to finish (the
    forecast replays their remaining decodes), so a target shorter than that wait is refused
    with how long to wait, and a longer one is accepted and met as forecast."""
    e = Engine(max_num_seqs=2)
    e.warm()
    for i in range(2):
        e.add(f"bg{i}", max_tokens=100)
    for _ in range(5):
        e.step()
    # ~95 decode steps of 14 ms left in both slots: ~1.3 s before a slot frees.
    with pytest.raises(SLOUnattainableError) as exc:
        e.add("impatient", ttft_slo_ms=200.0)
    assert 1.0 < exc.value.retry_after_s < 1.3
    assert 1.2 < exc.value.predicted_ttft_s < 1.5
    assert e.s.get_request("impatient") is None
    t0 = e.t
    r = e.add("patient", ttft_slo_ms=60_000.0)
    forecast_s = e.s.slo._forecasts["patient"][2]
    while r.first_token_time is None:
        e.step()
    assert r.first_token_time - t0 == pytest.approx(forecast_s, rel=0.02)
    e.drain()


def test_rejected_event_and_no_leak():
    e = Engine()
    e.warm()
    r = Request("x", [1] * 900, SamplingParams(max_tokens=4), ttft_slo_ms=50.0)
    with pytest.raises(SLOUnattainableError):
        e.s.add_request(r)
    assert r.events[-1].name == "rejected" and r.events[-1].detail == {"reason": "slo_unattainable"}
    assert r.status is RequestStatus.WAITING and not e.s.requests


def test_tpot_hold_caps_the_batch_below_the_target():
    """Decode step = 10 ms + 2 ms per sequence; with a 40 ms TPOT target and 85% headroom at
    most 12 decodes fit (10 + 2 * 12 = 34 <= 34): the 13th waits until one finishes."""
    e = Engine(slo_tpot_ms=40.0)
    for i in range(20):
        e.add(f"r{i}", max_tokens=50)
    peak = 0
    gaps = []
    while e.s.has_unfinished_requests():
        out, _ = e.step()
        peak = max(peak, e.s.num_running)
        if out.num_scheduled_tokens and e.decode_only:
            gaps.append(e.last_step_s)
    assert peak == 12
    assert max(gaps) <= 0.040
    assert e.s.slo.num_held_steps > 0


def test_time_between_steps_counts_against_the_tpot_target():
    """The same engine, but 6 ms pass between update_from_output and the next schedule()
    (output processing, streaming): the policy measures that overhead and holds the batch
    at 9 decodes (10 + 2 * 9 + 6 = 34 ms) instead of 12; idle waits are not overhead."""
    e = Engine(slo_tpot_ms=40.0)

    def run():
        peak = 0
        while e.s.has_unfinished_requests():
            e.step()
            e.t += 0.006
            peak = max(peak, e.s.num_running)
        return peak

    e.add("warm", max_tokens=60)                  # ~60 back-to-back steps: overhead learned
    run()
    assert e.s.slo.overhead_s == pytest.approx(0.006, rel=0.05)
    for i in range(20):
        e.add(f"r{i}", max_tokens=50)
    assert run() == 9
    e.t += 30.0                                   # idle, then one request
    e.add("late", max_tokens=5)
    run()
    assert e.s.slo.overhead_s == pytest.approx(0.006, rel=0.05)


def test_without_a_tpot_target_nothing_is_held():
    e = Engine()
    for i in range(20):
        e.add(f"r{i}", max_tokens=5)
    e.step()
    assert e.s.num_running == 20 and e.s.slo.num_held_steps == 0
    e.drain()


def test_the_step_time_model_learns_from_the_executor():
    """The policy is seeded wrong (2x); the measured steps bring its predictions to truth."""
    e = Engine()
    e.s.slo.model = StepTimeModel({k: 2 * v for k, v in COST.items()})
    for i in range(40):
        e.add(f"r{i}", prompt_len=5 + i * 7, max_tokens=10 + i)
        e.step()
    e.drain()
    pred = e.s.slo.model.predict(20, 20, 0, 0)
    assert pred == pytest.approx(COST["c0"] + 20 * COST["c_seq"], rel=0.1)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 40),
                          st.sampled_from([None, 50.0, 300.0, 5000.0]),
                          st.sampled_from([None, 14.0, 30.0]), st.integers(0, 3)),
                min_size=1, max_size=40),
       st.sampled_from(["recompute", "swap"]), st.integers(1, 8))
def test_random_overload_keeps_the_books_and_drains(reqs, mode, max_seqs):
    """Arrivals faster than service, mixed targets, a small KV pool (preemption): every step
    is consistent, refused requests hold nothing, accepted ones finish with max_tokens."""
    e = Engine(max_num_seqs=max_seqs, preemption_mode=mode, max_model_len=400)
    e.s = Scheduler(e.s.config, CacheConfig(block_size=16, num_kv_blocks=40,
                                            num_swap_blocks=40), clock=lambda: e.t)
    e.s.slo.model = StepTimeModel(COST)
    accepted = []
    for i, (prompt, out_len, ttft, tpot, gap) in enumerate(reqs):
        try:
            accepted.append(e.add(f"q{i}", prompt_len=prompt, max_tokens=out_len,
                                  ttft_slo_ms=ttft, tpot_slo_ms=tpot))
        except SLOUnattainableError as err:
            assert err.retry_after_s is None or err.retry_after_s > 0
            assert e.s.get_request(f"q{i}") is None
        for _ in range(gap):
            e.step()
    e.drain()
    bm = e.s.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.tables and not bm.host_tables
    for r in accepted:
        assert r.status is RequestStatus.FINISHED
        assert r.num_output_tokens == r.sampling_params.max_tokens


def test_per_request_targets_come_from_the_sampling_params_and_override_the_defaults():
    # The HTTP fields ride on SamplingParams; the Request takes them, add_request fills only
    # what is still unset from the server defaults.
    e = Engine(slo_ttft_ms=5000.0, slo_tpot_ms=500.0)
    own = Request("own", [1] * 4, SamplingParams(max_tokens=4, ttft_slo_ms=250.0),
                  arrival_time=e.t)
    e.s.add_request(own)
    assert (own.ttft_slo_ms, own.tpot_slo_ms) == (250.0, 500.0)
    dflt = e.add("dflt")
    assert (dflt.ttft_slo_ms, dflt.tpot_slo_ms) == (5000.0, 500.0)
    # The tighter target is served first (slack order), whatever the arrival order.
    assert [r.request_id for r in e.s.waiting] == ["own", "dflt"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("field", ["ttft_slo_ms", "tpot_slo_ms"])
def test_targets_under_another_policy_are_refused_naming_the_field(policy, field):
    s = Scheduler(SchedulerConfig(scheduling_policy=policy, max_num_seqs=4,
                                  max_num_batched_tokens=64, max_model_len=64),
                  CacheConfig(block_size=16, num_kv_blocks=64))
    r = Request("r", [1, 2], SamplingParams(max_tokens=2, **{field: 100.0}))
    with pytest.raises(SamplingParamsError) as exc:
        s.add_request(r)
    assert exc.value.param == field and "--scheduling-policy slo" in str(exc.value)
    assert policy in str(exc.value)
    assert not s.requests and s.num_waiting == 0
    s.add_request(Request("ok", [1, 2], SamplingParams(max_tokens=2)))   # the rest still works


def test_ttft_prediction_chunks_a_long_prompt_as_the_scheduler_does():
    """The prediction's chunk is the scheduler's: the threshold, and under
    max_long_prefill_tokens the long prompts' per-step cap; a long prompt's predicted
    prefill time is as many of those steps as the scheduler will run."""
    e = Engine(long_prefill_token_threshold=64)
    capped = Engine(long_prefill_token_threshold=64, max_long_prefill_tokens=32)
    assert e.s.slo._chunk(400) == 64 and capped.s.slo._chunk(400) == 32
    assert e.s.slo._chunk(40) == capped.s.slo._chunk(40) == 40    # short: whole
    assert capped.s.slo.prefill_time(400, 0, 0) > e.s.slo.prefill_time(400, 0, 0)
    # and the scheduler runs exactly those chunks
    capped.add("long", prompt_len=400)
    out, _ = capped.step()
    assert dict(out.num_scheduled_tokens) == {"long": 32}

"""A request that arrives while a step is in flight waits for that step to end
(the real engine adds requests between steps), and that wait is part of its TTFT; a request
that arrives while nothing runs starts at its arrival, not on the idle clock's next tick."""

import numpy as np
import pytest

from iterserve.core.config import CacheConfig, SchedulerConfig
from iterserve.core.cost_model import CostModel
from iterserve.lab.metrics import summarize
from iterserve.lab.simulator import SimSettings, simulate
from iterserve.lab.workload import RequestSpec

STEP = 0.1           # every step costs 100 ms (c0), an idle tick 30 ms
COST = CostModel(c0=STEP, idle_step_s=0.03)


def _settings():
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    return SimSettings(sc, CacheConfig(num_kv_blocks=64, block_size=16), prefill_ignored=False)


def _run(specs):
    res = simulate(specs, _settings(), COST, token_gaps=True)
    return res, summarize(res)


def test_an_arrival_mid_step_waits_for_the_step_in_flight():
    """A long request runs from t=0 (steps of 100 ms); a second one arrives at t=0.25, in
    the middle of step 2 (0.2-0.3). It is scheduled in step 3 (0.3-0.4) and its first
    token comes at 0.4: TTFT 150 ms, of which 50 ms is the step in flight, not 100 ms."""
    specs = [RequestSpec(0, 0, 4, 10, False, 1, arrival_s=0.0),
             RequestSpec(1, 0, 4, 3, False, 0, arrival_s=0.25)]
    res, out = _run(specs)
    S = res.step_start_s
    assert res.arrival_step[1] == 3 and S[3] == pytest.approx(0.3)
    assert S[res.first_token[1]] == pytest.approx(0.4)
    ttft = S[res.first_token] - np.array([0.0, 0.25])
    assert out["mean_ttft_s"] == pytest.approx(ttft.mean())
    assert out["p99_ttft_s"] == pytest.approx(np.percentile(ttft, 99))
    assert out["p99_ttft_s_urgent"] == pytest.approx(0.15)
    lat = S[res.finish] - np.array([0.0, 0.25])
    assert out["mean_latency_s"] == pytest.approx(lat.mean())


def test_an_arrival_while_idle_starts_at_its_arrival():
    """Nothing runs between 0.1 and the arrival at 0.5: the idle ticks (30 ms) end at the
    arrival itself, so the request's first step is 0.5-0.6 and its TTFT one step."""
    specs = [RequestSpec(0, 0, 4, 1, False, 1, arrival_s=0.0),
             RequestSpec(1, 0, 4, 1, False, 0, arrival_s=0.5)]
    res, out = _run(specs)
    S = res.step_start_s
    assert S[res.arrival_step[1]] == pytest.approx(0.5)
    assert S[res.first_token[1]] - 0.5 == pytest.approx(STEP)
    assert out["p99_ttft_s_urgent"] == pytest.approx(STEP)
    assert np.all(np.diff(S) > 0)


def test_step_arrivals_keep_their_meaning():
    """Without seconds arrivals, TTFT in seconds is still from the start of the arrival
    step (a request that arrives in step 2 is there when step 2 starts)."""
    specs = [RequestSpec(0, 0, 4, 10, False, 1), RequestSpec(1, 2, 4, 3, False, 0)]
    res, out = _run(specs)
    S = res.step_start_s
    assert out["p99_ttft_s_urgent"] == pytest.approx(S[res.first_token[1]] - S[2])

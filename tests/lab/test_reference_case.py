"""`iterserve lab` with no options: the reference case and its output shape."""

import time

from iterserve.lab.api import DEFAULT_SEED, run_lab

REQUIRED = {"steps", "utilization", "mean_latency", "p50_latency", "p99_latency",
            "requests", "tokens", "slots", "time_s", "throughput_tokens_per_s"}


def test_reference_case_reports_both_modes_with_the_required_keys():
    r = run_lab({})
    assert set(r) == {"static", "continuous"}
    for mode in r.values():
        assert REQUIRED <= set(mode)
        assert mode["requests"] == 48 and mode["slots"] == 8
        assert 0 < mode["utilization"] <= 1
        assert "per_request" not in mode and "mean_ttft" not in mode   # prefill ignored
    assert r["static"]["tokens"] == r["continuous"]["tokens"]


def test_reference_seed_lands_near_the_mission_figures():
    # Mission (for its own draw): static ~2,121 steps at ~34.9%, continuous ~954 at ~77.6%,
    # mean latency ~946 vs ~344 steps. The default seed's draw:
    r = run_lab({})
    s, c = r["static"], r["continuous"]
    assert (s["steps"], c["steps"]) == (2119, 945)
    assert abs(s["utilization"] - 0.349) < 0.01 and abs(c["utilization"] - 0.776) < 0.01
    assert abs(s["mean_latency"] - 946) < 15 and abs(c["mean_latency"] - 344) < 15
    assert s["utilization"] == s["tokens"] / (s["steps"] * 8)


def test_the_reference_case_is_reproducible():
    assert run_lab({}) == run_lab({"seed": DEFAULT_SEED})


def test_the_reference_case_runs_well_under_a_second():
    run_lab({})                                  # warm imports
    t = time.perf_counter()
    run_lab({})
    assert time.perf_counter() - t < 1.0

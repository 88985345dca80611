"""benchmarks/slo_engine_tradeoffs.py's `targets` block: issue 18's trade-off targets stated
against a run's numbers (the integrator reads the verdict from it), and the serve flags of
the new scheduler knobs (the real engine must run what the lab plans)."""

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, BENCH)
    try:
        import slo_engine_tradeoffs
        import slo_workloads
        yield slo_engine_tradeoffs, slo_workloads
    finally:
        sys.path.remove(BENCH)


def _case(preset, case, real, lab=None, **extra):
    return {"preset": preset, "case": case, "real": real, "lab": lab or {}, **extra}


def test_longprompt_best_is_the_cheapest_setting_that_gains_3x(bench):
    t, _ = bench
    off = {"p99_itl_s": 2.0, "throughput_tokens_per_s": 100.0}
    cases = [_case("longprompt", "chunking off", off, off),
             _case("longprompt", "b128", {"p99_itl_s": 0.25, "throughput_tokens_per_s": 93.0}),
             _case("longprompt", "b256", {"p99_itl_s": 0.5, "throughput_tokens_per_s": 96.0}),
             _case("longprompt", "b512", {"p99_itl_s": 1.0, "throughput_tokens_per_s": 99.0})]
    lp = t.targets(cases)["longprompt"]
    assert lp["best"]["case"] == "b256" and lp["met"]
    assert lp["best"]["real_p99_itl_gain"] == pytest.approx(4.0)
    assert lp["best"]["real_throughput_cost"] == pytest.approx(0.04)
    cases[2]["real"]["throughput_tokens_per_s"] = 94.0       # now 6%: best but not met
    lp = t.targets(cases)["longprompt"]
    assert lp["best"]["case"] == "b256" and not lp["met"]


def test_priority_flood_ratio_is_against_the_same_servers_alone_run(bench):
    t, _ = bench
    base = {"p99_ttft_s_urgent": 0.11, "throughput_tokens_per_s_normal": 300.0}
    capped = {"p99_ttft_s_urgent": 0.066, "throughput_tokens_per_s_normal": 240.0}
    cases = [_case("priority-flood", "priority", base, {"p99_ttft_s_urgent": 0.05},
                   alone_p99_ttft_s_urgent=0.055, lab_alone_p99_ttft_s_urgent=0.05),
             _case("priority-flood", "capped", capped, alone_p99_ttft_s_urgent=0.06),
             _case("priority-flood", "fcfs", {"p99_ttft_s_urgent": 11.0})]
    pf = t.targets(cases)["priority-flood"]
    rows = {r["case"]: r for r in pf["cases"]}
    assert rows["priority"]["real_ratio"] == pytest.approx(2.0)
    assert rows["priority"]["lab_ratio"] == pytest.approx(1.0)
    assert rows["capped"]["real_ratio"] == pytest.approx(1.1)
    assert rows["capped"]["real_batch_throughput_vs_priority"] == pytest.approx(0.8)
    assert pf["met"] and pf["fcfs_p99_ttft_s_urgent"] == 11.0


def test_serve_flags_carry_the_long_partial_cap_and_the_less_urgent_cap(bench):
    _, w = bench
    p = w.plan("longprompt", requests=8, max_num_batched_tokens=512,
               long_prefill_token_threshold=256, max_num_partial_prefills=2,
               max_long_partial_prefills=1)
    flags = w.serve_args(p)
    assert flags[flags.index("--max-long-partial-prefills") + 1] == "1"
    assert flags[flags.index("--long-prefill-token-threshold") + 1] == "256"
    p = w.plan("priority-flood", requests=8, priority_less_urgent_tokens=4)
    flags = w.serve_args(p)
    assert flags[flags.index("--priority-less-urgent-tokens") + 1] == "4"
    assert "--max-long-partial-prefills" not in flags

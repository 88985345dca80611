"""benchmarks/slo_engine_tradeoffs.py's `targets` block: the trade-off targets stated
against a run's numbers (a reader takes the verdict from it), and the serve flags of
the scheduler knobs (the real engine must run what the lab plans)."""

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
    assert "--max-long-prefill-tokens" not in flags
    p = w.plan("longprompt-heavy", requests=8, max_num_batched_tokens=512,
               long_prefill_token_threshold=256, max_long_prefill_tokens=256)
    flags = w.serve_args(p)
    assert flags[flags.index("--max-long-prefill-tokens") + 1] == "256"


def test_cases_select_by_substring_or_by_a_whole_name(bench):
    t, _ = bench
    cases = t.CASES["longprompt-heavy"]
    pick = lambda spec: [n for n, _ in t.select_cases(cases, spec)]  # noqa: E731
    assert pick(None) == [n for n, _ in cases]
    # "budget 256" also matches the threshold case; its whole name is that case alone
    assert pick("budget 256") == ["chunked, budget 256",
                                  "chunked, budget 256, threshold 32, 2 partial / 1 long"]
    assert pick("off,chunked, budget 256") == ["chunking off", "chunked, budget 256"]
    assert pick("off,chunked, budget 512, threshold 256, 2 partial / 1 long,long cap") == [
        "chunking off", "chunked, budget 512, threshold 256, 2 partial / 1 long",
        "chunked, budget 512, threshold 256, long cap 256, 2 partial / 1 long"]
    assert pick("no such case") == []


def test_the_long_prefill_cap_trims_the_heavy_presets_tail_in_the_lab(bench):
    """max_long_prefill_tokens on longprompt-heavy (budget 512, threshold 256, 2 partial /
    1 long): without it the step that ends one long prefill starts the next with a whole
    second chunk; with it that step is no longer than the others, so p99.9 / max ITL drop
    at the same throughput (same requests, same cost model: the lab runs this scheduler)."""
    from iterserve.core.cost_model import load_cost_model

    t, w = bench
    cost = load_cost_model("smollm2-cpu")
    base = {**w.preset_options("longprompt-heavy"), "cost_model": cost, "seed": 0,
            "max_num_batched_tokens": 512, "long_prefill_token_threshold": 256,
            "max_num_partial_prefills": 2, "max_long_partial_prefills": 1}
    free = t.lab_run(base)
    capped = t.lab_run({**base, "max_long_prefill_tokens": 256})
    assert capped["max_itl_s"] < 0.85 * free["max_itl_s"]
    assert capped["p999_itl_s"] < 0.85 * free["p999_itl_s"]
    assert capped["p99_itl_s"] <= free["p99_itl_s"]
    assert capped["throughput_tokens_per_s"] >= 0.99 * free["throughput_tokens_per_s"]


def test_chunking_target_pairs_each_case_with_chunking_off_of_its_own_repeat(bench):
    """Under load only same-run ratios mean something: repeat r's chunked case is divided by
    repeat r's chunking off (ABBA order), and the verdict is on the medians."""
    t, _ = bench
    P = "longprompt-heavy"

    def m(p99, tput, p999=None, mx=None):
        return {"p99_itl_s": p99, "p999_itl_s": p999 or p99, "max_itl_s": mx or p99,
                "throughput_tokens_per_s": tput}
    cases = [  # repeat 0 quick, repeat 1 twice as slow (load): the ratios are the same
        _case(P, "chunking off", m(1.2, 100.0, 1.3, 1.4), m(1.0, 100.0), repeat=0),
        _case(P, "b64", m(0.06, 97.0, 0.065, 0.07), m(0.05, 100.0), repeat=0),
        _case(P, "b64", m(0.12, 48.0, 0.13, 0.14), m(0.05, 100.0), repeat=1),
        _case(P, "chunking off", m(2.4, 50.0, 2.6, 2.8), m(1.0, 100.0), repeat=1)]
    lp = t.targets(cases)[P]
    assert lp["repeats"] == 2 and lp["met"]
    row = lp["best"]
    assert row["case"] == "b64"
    assert row["real_p99_itl_gain"] == pytest.approx(20.0)
    assert row["real_p99_itl_gain_per_repeat"] == pytest.approx([20.0, 20.0])
    assert row["real_p999_itl_gain"] == pytest.approx(20.0)
    assert row["real_max_itl_gain"] == pytest.approx(20.0)
    assert row["real_throughput_cost"] == pytest.approx(0.035)     # median of 3% and 4%
    assert row["lab_p99_itl_gain"] == pytest.approx(20.0)
    cases[2]["real"]["throughput_tokens_per_s"] = 40.0             # 20% in repeat 1
    cases[1]["real"]["throughput_tokens_per_s"] = 90.0             # 10% in repeat 0
    assert not t.targets(cases)[P]["met"]


def test_itl_tail_reads_p999_and_max_of_the_gaps(bench):
    t, _ = bench
    gaps = [0.01] * 999 + [2.0]
    tail = t.itl_tail(gaps)
    assert tail["max_itl_s"] == 2.0 and tail["itl_count"] == 1000
    assert 0.01 < tail["p999_itl_s"] < 2.0          # linear between the last two
    assert t.itl_tail([])["max_itl_s"] is None


def test_longprompt_heavy_makes_the_stall_the_p99_in_the_lab(bench):
    """The stall-heavy preset is what chunked prefill is for: with chunking off the whole-
    prompt stalls are more than 1% of the gaps, so p99 ITL is a stall (>1 s on the shipped
    fit), and a 64-token budget brings p99 (and p99.9 and max) down to one chunk step at
    about the same throughput. The lab's own check; the real engine is
    benchmarks/slo_engine_tradeoffs.py --presets longprompt-heavy."""
    from iterserve.core.cost_model import load_cost_model
    from iterserve.lab.options import PRESETS

    t, w = bench
    opts = {**w.preset_options("longprompt-heavy"), "seed": 100}
    cost = load_cost_model(opts["cost_model"])
    on = t.lab_run({**opts, "cost_model": cost})
    off_opts = {**opts, "cost_model": cost, "enable_chunked_prefill": False}
    off_opts.pop("max_num_batched_tokens")
    off = t.lab_run(off_opts)
    assert PRESETS["longprompt-heavy"]["options"]["max_num_batched_tokens"] == 64
    assert off["p99_itl_s"] > 0.5 and off["p99_itl_s"] >= 3 * on["p99_itl_s"]
    assert off["p999_itl_s"] >= 3 * on["p999_itl_s"] and off["max_itl_s"] >= 3 * on["max_itl_s"]
    assert on["throughput_tokens_per_s"] >= 0.95 * off["throughput_tokens_per_s"]

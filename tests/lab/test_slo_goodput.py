"""SLO-aware admission in the lab: the slo policy's goodput against fcfs's around the engine's capacity.

The same Scheduler and policy code as the engine; the simulated executor feeds the policy's
online step-time model the cost model's step times. One fixed seed, small enough to run in
about a second; benchmarks/slo_goodput.py runs more seeds.
"""

import subprocess
import sys

import pytest

from iterserve.errors import LabOptionsError
from iterserve.lab.api import run_lab
from iterserve.lab.preset_scale import speed
from iterserve.lab.slo import PRESET, capacity_rps, goodput_comparison, search_capacity

SEED = 1001


@pytest.fixture(scope="module")
def comparison():
    return goodput_comparison({"seed": SEED, "requests": 240})


def test_capacity_is_measured_from_the_shipped_cost_model():
    cap = capacity_rps({"seed": SEED, "requests": 240})
    # the reference smollm2-cpu fit: ~0.45 s of steps per request at full batch; a
    # re-fitted file scales it by its speed (lab/preset_scale.py)
    s = speed()
    assert 1.5 * s < cap < 3.0 * s


def test_slo_goodput_is_at_least_1_5x_fcfs_above_capacity(comparison):
    rows = {row["load"]: row for row in comparison["rows"]}
    for load in (1.5, 2.0):
        row = rows[load]
        assert row["slo"]["goodput_rps"] >= 1.5 * row["fcfs"]["goodput_rps"], row
        # Not an artefact of slo's shorter run (refused work): counts alone say the same.
        assert row["slo"]["slo_met"] >= 1.5 * row["fcfs"]["slo_met"], row
        assert row["slo"]["refused"] > 0 and row["fcfs"]["refused"] == 0
    # ... while below capacity it costs nothing: the same requests meet their targets.
    low = rows[0.8]
    assert low["slo"]["refused"] == 0
    assert low["slo"]["slo_met"] == pytest.approx(low["fcfs"]["slo_met"], rel=0.02)
    assert low["slo"]["goodput_rps"] == pytest.approx(low["fcfs"]["goodput_rps"], rel=0.02)


def test_goodput_is_reported_for_any_policy_with_targets():
    r = run_lab({**PRESET, "requests": 40, "arrival_rate_s": 1.0, "cost_model": None,
                 "scheduling_policy": "priority"})["continuous"]
    assert {"goodput_rps", "slo_met", "refused", "slo_attainment"} <= set(r)
    assert r["refused"] == 0 and 0 <= r["slo_met"] <= 40
    r = run_lab({"batching": "continuous", "requests": 8})["continuous"]
    assert "goodput_rps" not in r


@pytest.mark.parametrize("options, option", [
    ({"arrival_rate": 0.1, "arrival_rate_s": 1.0}, "arrival_rate_s"),
    ({"arrival_rate_s": 0.0}, "arrival_rate_s"),
    ({"slo_ttft_ms": -5}, "slo_ttft_ms"),
    ({"slo_tpot_ms": float("nan")}, "slo_tpot_ms"),
    ({"scheduling_policy": "edf"}, "scheduling_policy"),
])
def test_bad_slo_options_name_the_option(options, option):
    with pytest.raises(LabOptionsError) as exc:
        run_lab(options)
    assert exc.value.option == option


def test_cli_runs_the_slo_policy():
    cmd = [sys.executable, "-m", "iterserve.cli", "lab", "--batching", "continuous",
           "--max-num-seqs", "64", "--requests", "60", "--prompt-len", "8-40",
           "--arrival-rate-s", "4", "--cost-model", "smollm2-cpu", "--slo-ttft-ms", "1000",
           "--slo-tpot-ms", "100", "--scheduling-policy", "slo"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "goodput (requests/s)" in proc.stdout and "refused (SLO)" in proc.stdout


def test_lab_slo_command_prints_the_comparison():
    cmd = [sys.executable, "-m", "iterserve.cli", "lab", "slo", "--requests", "80", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    import json

    out = json.loads(proc.stdout)
    assert [row["load"] for row in out["rows"]] == [0.8, 1.5, 2.0]
    assert out["capacity_rps"] > 0
    bad = subprocess.run(cmd[:-3] + ["--max-num-seqs", "0"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "max_num_seqs" in bad.stderr


def test_user_targets_keep_the_promise_from_half_to_four_times_capacity():
    """`iterserve lab slo --loads` with targets a user picks (TTFT 2,000 ms, TPOT 150 ms, 16
    slots): the admitted requests meet both targets >= 95% at every load, goodput slo / fcfs
    is >= 1.5x at 1.5x capacity and >= 2x above, and nothing is lost at half capacity."""
    cmd = [sys.executable, "-m", "iterserve.cli", "lab", "slo", "--requests", "200",
           "--max-num-seqs", "16", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "150",
           "--loads", "0.5,1.5,2,4", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import json

    rows = {row["load"]: row for row in json.loads(proc.stdout)["rows"]}
    assert sorted(rows) == [0.5, 1.5, 2.0, 4.0]
    for load, row in rows.items():
        assert row["slo"]["admitted_met"] >= 0.95, (load, row["slo"])
    assert rows[0.5]["goodput_ratio"] >= 0.98
    assert rows[1.5]["goodput_ratio"] >= 1.5
    assert rows[2.0]["goodput_ratio"] >= 2.0 and rows[4.0]["goodput_ratio"] >= 2.0
    assert rows[4.0]["fcfs"]["admitted_met"] < 0.5       # fcfs breaks its admitted ones
    bad = subprocess.run(cmd[:-2] + ["0,-1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--loads" in bad.stderr


def test_the_search_finds_the_highest_rate_that_keeps_the_attainment():
    """`search_capacity` at user targets: at the rate it reports, >= 90% of the requests meet
    both targets under that policy; a fifth above it (a run of its own), fewer do."""
    opts = {"seed": SEED, "requests": 120, "max_num_seqs": 16, "slo_ttft_ms": 2000.0,
            "slo_tpot_ms": 150.0}
    result = search_capacity(opts, attainment=0.9, iterations=5)
    assert result["capacity_rps"] > 0 and result["attainment"] == 0.9
    for policy, r in result["policies"].items():
        rate = r["max_rate_rps"]
        assert r["bounded"] and rate is not None and rate > 0, (policy, r)
        for probe, meets in ((rate, True), (1.2 * rate, False)):
            run = run_lab({**_with_cost_model(opts), "scheduling_policy": policy,
                           "arrival_rate_s": probe})["continuous"]
            assert (run["slo_met"] / run["requests"] >= 0.9) is meets, (policy, probe, run)


def _with_cost_model(opts):
    from iterserve.core.cost_model import load_cost_model

    return {**PRESET, **opts, "cost_model": load_cost_model(PRESET["cost_model"])}


def test_lab_slo_search_command():
    cmd = [sys.executable, "-m", "iterserve.cli", "lab", "slo", "--search", "--requests", "60",
           "--max-num-seqs", "16", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "150"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "fcfs:" in proc.stdout and "slo:" in proc.stdout and "requests/s" in proc.stdout
    bad = subprocess.run(cmd + ["--attainment", "0"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--attainment" in bad.stderr

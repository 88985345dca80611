"""Speculative decoding in the lab: the engine's scheduler side on simulated time.

The lab runs the engine's Speculator (proposals as extra tokens of a step, the adaptive
plan, the online step-time refit) and draws each verification's acceptance from the
workload's per-position rates; these tests hold it to what the mechanism promises: drafts
accepted at the given rates, a gain where a step is mostly its fixed cost, no loss where
the acceptance is low (adaptive), the sweep command, and options refused by name.
"""

import json
import subprocess
import sys

import pytest

from iterserve.core.cost_model import load_cost_model
from iterserve.errors import LabOptionsError
from iterserve.lab.api import run_lab
from iterserve.lab.spec import sweep

COST = load_cost_model("smollm2-cpu")
BASE = {"batching": "continuous", "requests": 32, "prompt_len": [8, 40], "cost_model": COST}


def _run(slots: int, spec: dict | None = None, acceptance=None, **kw) -> dict:
    opts = {**BASE, "max_num_seqs": slots, **kw}
    if spec is not None:
        opts["speculative_config"] = spec
    if acceptance is not None:
        opts["spec_acceptance"] = acceptance
    return run_lab(opts)["continuous"]


def test_drafts_are_accepted_at_the_given_per_position_rates():
    rates = [0.8, 0.6, 0.4]
    r = _run(1, {"method": "synthetic", "num_speculative_tokens": 3,
                 "acceptance_rates": rates, "adaptive": False})
    sd = r["spec_decoding"]
    per_pos = [n / sd["num_drafts"] for n in sd["num_accepted_tokens_per_pos"]]
    # A request near its max_tokens verifies fewer drafts, so later positions read a bit low.
    for got, want in zip(per_pos, rates):
        assert want - 0.06 <= got <= want + 0.03, (per_pos, rates)
    assert sd["mean_acceptance_length"] == pytest.approx(1 + sum(per_pos), rel=1e-9)


def test_it_pays_at_batch_1_and_adaptive_never_loses_where_drafts_are_rejected():
    off1, off8 = _run(1), _run(8)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    high = _run(1, spec, 0.9)
    assert high["throughput_tokens_per_s"] > 1.8 * off1["throughput_tokens_per_s"]
    assert high["steps"] < 0.6 * off1["steps"]
    for slots, off in ((1, off1), (8, off8)):
        low = _run(slots, spec, 0.3)
        every = _run(slots, {**spec, "adaptive": False}, 0.3)
        assert low["throughput_tokens_per_s"] >= 0.97 * off["throughput_tokens_per_s"]
        if slots == 8:      # without the plan, rejected drafts cost rows of a bigger step
            assert every["throughput_tokens_per_s"] < 0.7 * off["throughput_tokens_per_s"]


def test_adaptive_keeps_up_with_verifying_everything_when_drafts_are_accepted():
    """A full batch of 8 long requests at acceptance 0.9: the adaptive plan's gain is at
    least 0.95x that of verifying every draft (a request whose noisy estimate dipped below
    what pays comes back as its count ages, and a new request probes at once)."""
    fixed = {"lengths": [300] * 8, "prompt_len": [20, 20], "requests": None}
    off = _run(8, **fixed)["throughput_tokens_per_s"]
    for k in (1, 4):
        spec = {"method": "ngram", "num_speculative_tokens": k}
        adaptive = _run(8, spec, 0.9, **fixed)["throughput_tokens_per_s"] / off
        every = _run(8, {**spec, "adaptive": False}, 0.9, **fixed)["throughput_tokens_per_s"]
        assert adaptive > 1.0 and adaptive >= 0.95 * every / off, (k, adaptive, every / off)


@pytest.mark.parametrize("options, option", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
     "spec_acceptance"),
    ({"spec_acceptance": 0.5}, "spec_acceptance"),
    ({"speculative_config": {"method": "draft_model", "model": "d.gguf",
                             "num_speculative_tokens": 2}, "spec_acceptance": 0.5},
     "speculative_config.method"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
      "spec_acceptance": [0.5, 0.7]}, "spec_acceptance"),
    ({"speculative_config": {"method": "synthetic", "acceptance_rates": [0.5]},
      "spec_acceptance": 0.5}, "spec_acceptance"),
    ({"speculative_config": {"method": "ngram"}, "spec_acceptance": 0.5},
     "speculative_config.num_speculative_tokens"),
])
def test_bad_speculation_options_name_the_option(options, option):
    with pytest.raises(LabOptionsError) as e:
        run_lab({**BASE, **options})
    assert e.value.option == option and str(e.value).startswith(option)


def test_the_sweep_shows_where_it_pays():
    out = sweep({"requests": 24}, slots=(1, 16), acceptance=(0.3, 0.9))
    rows = {(r["slots"], r["acceptance"]): r for r in out["rows"]}
    assert rows[(1, 0.9)]["adaptive_gain"] > 1.8
    assert rows[(16, 0.3)]["every_draft_gain"] < 0.6 <= rows[(16, 0.3)]["adaptive_gain"]
    assert rows[(1, 0.9)]["adaptive_gain"] > rows[(16, 0.9)]["adaptive_gain"]


def test_lab_spec_command_and_speculation_flags():
    cmd = [sys.executable, "-m", "iterserve.cli", "lab", "spec", "--slots", "1,8",
           "--acceptance", "0.5,0.9", "--requests", "16", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    assert [(r["slots"], r["acceptance"]) for r in rows] == [(1, 0.5), (1, 0.9), (8, 0.5),
                                                             (8, 0.9)]
    bad = subprocess.run(cmd[:-1] + ["--acceptance", "1.5"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--acceptance" in bad.stderr
    run = [sys.executable, "-m", "iterserve.cli", "lab", "--batching", "continuous",
           "--requests", "16", "--prompt-len", "8-40", "--speculative-config",
           '{"method": "ngram", "num_speculative_tokens": 4}', "--spec-acceptance", "0.8"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "speculative decoding (continuous):" in proc.stdout
    proc = subprocess.run(run[:-2], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "spec_acceptance" in proc.stderr

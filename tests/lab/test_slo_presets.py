"""The lab's presets (the scheduling trade-offs): each runs, shows the trade-off it is named for
when its one knob is flipped, and the options given with it override it. The full sweeps are
benchmarks/slo_tradeoffs.py; these are the one-seed checks that the presets keep meaning
what their descriptions say."""

from __future__ import annotations

import json

import pytest

from iterserve.errors import LabOptionsError
from iterserve.lab.api import run_lab
from iterserve.lab.options import PRESETS, presets_json


def cont(**opts):
    return run_lab(opts)["continuous"]


def test_every_preset_runs_and_describes_itself():
    assert set(PRESETS) == {"slo-overload", "longprompt", "longprompt-heavy", "priority-flood",
                            "kv-pressure"}
    doc = json.loads(json.dumps(presets_json()))          # plain JSON for the page
    for name, p in doc.items():
        assert p["description"] and p["options"]["cost_model"] == "smollm2-cpu"
        r = run_lab({"preset": name})
        assert list(r) == ["continuous"] and r["continuous"]["requests"] == p["options"]["requests"]


def test_given_options_override_the_preset():
    r = cont(preset="kv-pressure", requests=20, max_num_seqs=4)
    assert r["requests"] == 20 and r["slots"] == 4
    r = run_lab({"preset": "kv-pressure", "batching": "both", "requests": 10})
    assert set(r) == {"static", "continuous"}
    assert cont(preset=None, requests=5)["requests"] == 5        # None: no preset


@pytest.mark.parametrize("bad", ["nope", 3, ""])
def test_an_unknown_preset_is_refused_by_name(bad):
    with pytest.raises(LabOptionsError) as e:
        run_lab({"preset": bad})
    assert e.value.option == "preset" and "slo-overload" in str(e.value)


def test_slo_overload_policy_slo_beats_fcfs_on_goodput():
    slo = cont(preset="slo-overload")
    fcfs = cont(preset="slo-overload", scheduling_policy="fcfs")
    assert slo["refused"] > 0 and fcfs["refused"] == 0
    assert slo["goodput_rps"] >= 1.5 * fcfs["goodput_rps"]


def test_longprompt_chunking_caps_the_inter_token_gap():
    on = cont(preset="longprompt", requests=80)
    off = cont(preset="longprompt", requests=80, enable_chunked_prefill=False,
               max_num_batched_tokens=4096)
    assert off["max_itl_s"] >= 3 * on["max_itl_s"]       # a whole 1500+ token prefill
    # Enough long prompts that their stalls are more than 1% of all gaps: p99 sees them.
    assert off["p99_itl_s"] >= 3 * on["p99_itl_s"]
    assert on["p99_ttft_s"] > 0 and off["p99_ttft_s"] > 0


def test_long_prompt_frac_sets_the_share_and_needs_the_longprompt_mix():
    few = run_lab({"preset": "longprompt", "requests": 100, "long_prompt_frac": 0.05,
                   "per_request": True})["continuous"]
    many = run_lab({"preset": "longprompt", "requests": 100, "per_request": True})["continuous"]
    longs = lambda r: sum(1 for q in r["per_request"] if q["prompt_len"] >= 1500)  # noqa: E731
    assert longs(few) < 15 < longs(many) < 45
    with pytest.raises(LabOptionsError) as e:
        run_lab({"long_prompt_frac": 0.3, "prompt_len": [8, 40]})
    assert e.value.option == "long_prompt_frac"


def test_priority_flood_protects_the_interactive_class():
    prio = cont(preset="priority-flood")
    fcfs = cont(preset="priority-flood", scheduling_policy="fcfs")
    assert 0 < prio["urgent_requests"] < prio["requests"]
    assert prio["p99_ttft_s_urgent"] * 2 < fcfs["p99_ttft_s_urgent"]
    assert prio["p99_ttft_s_urgent"] < prio["p99_ttft_s_normal"]


def test_kv_pressure_preempts_and_swap_saves_the_recompute():
    rec = cont(preset="kv-pressure")
    swap = cont(preset="kv-pressure", preemption_mode="swap")
    assert rec["preemptions"] > 0 and swap["preemptions"] > 0
    assert swap["computed_tokens"] < rec["computed_tokens"]     # recompute pays prefill again


def test_the_cli_takes_a_preset(capsys):
    from iterserve.cli import main

    assert main(["lab", "--preset", "kv-pressure", "--requests", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["continuous"] and out["continuous"]["requests"] == 12


def test_presets_follow_the_shipped_fit_speed():
    """A re-fitted smollm2-cpu that runs every step 2.5x faster keeps each preset the same
    experiment: rates x 2.5, time targets / 2.5, so the same steps, in 2.5x less time."""
    from iterserve.core.cost_model import CostModel
    from iterserve.lab.preset_scale import (
        DECODE_STEP, FULL_BATCH_STEP, LONGPROMPT_STEP, REFERENCE_FIT, scale_options, speed)

    ref = CostModel.from_dict(REFERENCE_FIT)
    fast = CostModel.from_dict({k: v / 2.5 for k, v in REFERENCE_FIT.items()})
    assert speed(DECODE_STEP, ref) == 1.0
    assert speed(DECODE_STEP, fast) == pytest.approx(2.5)
    # a fit whose chunks with context cost more: the long-prompt preset slows, decodes not
    attn = CostModel.from_dict({**REFERENCE_FIT, "c_attn": 1e-6})
    assert speed(DECODE_STEP, attn) == 1.0 and speed(LONGPROMPT_STEP, attn) < 0.8
    base = PRESETS["slo-overload"]["options"]
    s = speed(FULL_BATCH_STEP)                  # slo-overload's own (64 slots)
    scaled = scale_options(base, 2.5)
    assert scaled["arrival_rate_s"] == pytest.approx(base["arrival_rate_s"] * 2.5, rel=0.01)
    assert scaled["slo_tpot_ms"] == pytest.approx(base["slo_tpot_ms"] / 2.5, rel=0.01)
    assert scale_options(base, 1.0) == base
    # the same experiment: in steps, the fast fit's run of the scaled preset is the run of
    # the preset on the reference fit (same scheduling decisions, all times / 2.5)
    opts = {**base, "requests": 60}
    a = run_lab({**scale_options(opts, 1 / s), "cost_model": REFERENCE_FIT})["continuous"]
    b = run_lab({**scale_options(opts, 2.5 / s),
                 "cost_model": fast.to_dict()})["continuous"]
    assert b["steps"] == pytest.approx(a["steps"], rel=0.05)
    assert b["slo_met"] == pytest.approx(a["slo_met"], abs=3)
    assert b["time_s"] == pytest.approx(a["time_s"] / 2.5, rel=0.05)

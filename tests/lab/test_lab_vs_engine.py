"""benchmarks/lab_vs_engine.py on a tiny random model: the real engine and the lab serve the
same requests on the same knobs and the report says how far apart they are.

Timing is not checked (a CI machine's load is unknown); what is checked is what makes the
comparison meaningful: the same scheduler code runs the same steps on both sides for a
burst (mix, kv-pressure with preemption), every request got all its tokens, the real
steps' features include attention pairs, and each metric has its lab / real - 1. ~20 s of
CPU (over the ~20 s budget because a comparison needs two engines, mix on the default knobs
and the preset on its own, and a few hundred steps each: the smallest runs that preempt).
"""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lve():
    spec = importlib.util.spec_from_file_location("lab_vs_engine",
                                                  ROOT / "benchmarks" / "lab_vs_engine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lab_vs_engine_reports_the_lab_error_on_mix_and_a_preset(lve, tiny_model_dir, tmp_path,
                                                                 capsys):
    model = tiny_model_dir
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"format": "iterserve-lab-cost-model", "version": 2,
                               "c0": 0.002, "c_seq": 2e-4, "c_kv": 1e-7, "c_prefill_tok": 5e-5,
                               "c_attn": 1e-8, "overhead_s": 2e-4}))
    other = tmp_path / "other.json"        # another fit, the same real run: an A/B of fits
    other.write_text(json.dumps({"c0": 0.004, "c_seq": 2e-4,
                                 "token_corrections": [[1, 0.0], [8, 0.001], [33, 0.002]]}))
    out = tmp_path / "report.json"
    assert lve.main(["--model", str(model), "--cost-model", str(fit),
                     "--workloads", "mix,kv-pressure", "--num-requests", "4",
                     "--preset-requests", "6", "--out", str(out),
                     "--also-cost-models", str(other)]) == 0
    report = json.loads(out.read_text())
    assert report["cost_model_coefficients"]["c_attn"] == 1e-8
    rows = {r["workload"]["name"]: r for r in report["results"]}
    assert set(rows) == {"mix", "kv-pressure"}
    for r in rows.values():
        # the same scheduler on the same knobs and requests: the same steps
        assert r["real_steps"] == r["lab_steps"] > 0
        assert r["real_busy_slot_steps"] == r["lab_busy_slot_steps"]
        assert r["real_wall_s"] > 0 and r["predicted_s"] > 0
        # the report rounds both times to the ms: allow what that rounding can move the ratio
        # (a tiny model's run is a few ms of wall time on a fast machine)
        ratio = r["predicted_s"] / r["real_wall_s"]
        slack = 2e-3 + (1 + ratio) * 5e-4 / r["real_wall_s"]
        assert r["rel_error"] == pytest.approx(ratio - 1, abs=slack)
        b = r["breakdown"]
        assert b["real_attn_pairs"] > 0 and b["fit_overhead_on_real_steps_s"] > 0
    # per-step residuals by token count cover every real step; the other fit's prediction
    # of the same mix run is its own lab run, slower by its larger per-step cost
    res = rows["mix"]["breakdown"]["residuals_by_tokens"]
    assert sum(x["steps"] for x in res) == rows["mix"]["real_steps"]
    assert sum(x["share_of_execute"] for x in res) == pytest.approx(1.0, abs=1e-3)
    alt = rows["mix"]["other_cost_models"][str(other)]
    assert alt["predicted_s"] > rows["mix"]["predicted_s"]
    assert (alt["breakdown"]["cost_model_on_real_steps_s"]
            > rows["mix"]["breakdown"]["cost_model_on_real_steps_s"])
    kv = rows["kv-pressure"]
    assert kv["workload"]["engine_args"]["num_kv_blocks"] == 300
    for k in ("throughput_tokens_per_s", "p99_itl_s", "p99_ttft_s"):
        assert kv["real"][k] > 0 and kv["lab"][k] > 0
        assert kv["lab_error"][k] == pytest.approx(kv["lab"][k] / kv["real"][k] - 1, abs=1e-3)
    assert "kv-pressure:" in capsys.readouterr().out

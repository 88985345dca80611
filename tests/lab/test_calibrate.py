"""`iterserve lab calibrate`: the fit recovers known costs, the CLI writes a usable cost model,
shipped fits are selectable by name, and bad options exit 2."""

import json

import numpy as np
import pytest

from iterserve.cli import main
from iterserve.core.cost_model import COEFFICIENTS, load_cost_model, shipped_cost_models
from iterserve.core.fit import (GridPoint, correction_knots, fit_coefficients,
                                fit_with_corrections, nnls)
from iterserve.errors import CalibrationError, CostModelError
from iterserve.lab.api import run_lab
from iterserve.lab.calibrate import check_point, default_grid, fit_errors, fit_overhead

TRUE = {"c0": 0.025, "c_tok": 1.2e-3, "c_seq": 4e-4, "c_kv": 2e-6, "c_prefill_tok": 3e-4,
        "c_attn": 8e-7}


def _synthetic(grid, coef, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    feats = [p.features() for p in grid]
    y = [coef["c0"] + coef["c_tok"] * t + coef["c_seq"] * s + coef["c_kv"] * kv
         + coef["c_prefill_tok"] * pf + coef.get("c_attn", 0.0) * at
         for t, s, kv, pf, at in feats]
    return feats, [v * (1 + noise * rng.standard_normal()) for v in y]


def test_fit_recovers_known_coefficients_from_exact_linear_timings():
    feats, y = _synthetic(default_grid(), TRUE)
    got = fit_coefficients(feats, y)
    for k in COEFFICIENTS:
        assert got[k] == pytest.approx(TRUE[k], rel=1e-6), k
    assert max(abs(e) for e in fit_errors(got, feats, y)) < 1e-9


def _kernel_rows(tokens: int) -> float:
    """A runner whose GEMMs change kernel with the row count, as the CPU one does: int8
    decode kernels in groups of 4 rows up to 32 rows (one row alone is cheaper), a panel
    GEMM with a fixed cost above."""
    if tokens <= 32:
        return 0.012 if tokens == 1 else 0.05 * -(-tokens // 4)
    return 0.15 + 0.003 * tokens


def test_token_corrections_fit_a_runner_whose_kernels_change_with_the_row_count():
    """The linear terms alone miss such a runner by tens of percent at the shapes `mix`
    runs (a few decodes, a short prompt); the correction by token count, read off at
    every count up to 8 and on both sides of the row limit, fits it, and the linear
    terms stay a sensible seed (no negative cost, the kv price kept)."""
    grid = default_grid()
    feats = [p.features() for p in grid]
    y = [_kernel_rows(t) + 0.002 * s + 1e-5 * kv for t, s, kv, _, _ in feats]
    knots = correction_knots(32, max(f[0] for f in feats))
    assert {1, 2, 3, 4, 5, 6, 7, 8, 32, 33} <= set(knots) and max(knots) == max(
        f[0] for f in feats)
    linear = fit_coefficients(feats, y)
    e_lin = np.abs(fit_errors(linear, feats, y))
    coef, corr = fit_with_corrections(feats, y, knots)
    e = np.abs(fit_errors(coef, feats, y, corr))
    assert e_lin.max() > 0.25 and e.max() < 0.08 and e.mean() < 0.5 * e_lin.mean()
    assert all(v >= 0 for v in coef.values())
    assert coef["c_kv"] == pytest.approx(1e-5, rel=0.3)
    # Shapes off the grid, as the lab meets them: 7 decodes + a 20-token prompt (27 rows),
    # 6 decodes + a 30-token prompt (36 rows).
    from iterserve.core.cost_model import CostModel
    m = CostModel(token_corrections=corr, **coef)
    for tokens, seqs, kv in ((27, 8, 7 * 300 + 20), (36, 7, 6 * 300 + 30)):
        truth = _kernel_rows(tokens) + 0.002 * seqs + 1e-5 * kv
        assert m.runner_time(tokens, seqs, kv, tokens - seqs + 1, 0) == pytest.approx(
            truth, rel=0.12)


def test_engine_scale_is_measured_over_predicted_on_the_engine_steps_and_clipped():
    from iterserve.core.cost_model import CostModel
    from iterserve.lab.calibrate import engine_scale, scaled

    cost = CostModel(c0=0.01, c_seq=0.002, token_corrections=((1, 0.001), (8, -0.002)))
    shapes = [(1, 1, 40, 0, 0), (8, 8, 800, 0, 0), (30, 8, 900, 23, 23 * 23)]
    steps = [(*f, 1.15 * cost.runner_time(*f)) for f in shapes]
    assert engine_scale(cost, steps) == pytest.approx(1.15)
    coef, corr = scaled({"c0": 0.01, "c_seq": 0.002}, cost.token_corrections, 1.15)
    m = CostModel(token_corrections=corr, **coef)
    for f in shapes:
        assert m.runner_time(*f) == pytest.approx(1.15 * cost.runner_time(*f))
    assert engine_scale(cost, [(*f, 10 * cost.runner_time(*f)) for f in shapes]) == 2.0
    # one step slowed by a burst of load from elsewhere does not move it
    burst = [(*f, (1.15 if i else 5.0) * cost.runner_time(*f)) for i, f in
             enumerate(shapes * 3)]
    assert engine_scale(cost, burst) == pytest.approx(1.15)
    assert engine_scale(cost, []) is None


def test_exact_linear_timings_need_no_correction():
    feats, y = _synthetic(default_grid(), TRUE)
    coef, corr = fit_with_corrections(feats, y, correction_knots(32, 264))
    assert max(abs(e) for e in fit_errors(coef, feats, y, corr)) < 0.02
    assert max(abs(v) for _, v in corr) < 0.05 * min(y)


@pytest.mark.parametrize("quick", [False, True])
def test_both_grids_identify_the_attention_term(quick):
    """The grids time chunks deep into a prompt, so c_attn comes back from exact timings
    (and the quick grid, for big models, separates all six coefficients too)."""
    grid = default_grid(quick=quick)
    assert any(p.prefill_context for p in grid)
    feats, y = _synthetic(grid, TRUE)
    got = fit_coefficients(feats, y)
    for k in COEFFICIENTS:
        assert got[k] == pytest.approx(TRUE[k], rel=1e-5), k


def test_a_context_chunk_costs_what_its_attention_pairs_say():
    """The linear model of before (no attention pairs) fitted to chunks at context 0
    underprices a chunk deep into a prompt; the model with c_attn predicts it."""
    grid = default_grid()
    flat = [p for p in grid if not p.prefill_context]
    feats, y = _synthetic(flat, TRUE)
    blind = fit_coefficients([f[:4] for f in feats], y)
    deep = GridPoint(16, 256, prefill_tokens=128, prefill_chunks=1, prefill_context=1500)
    df, dy = _synthetic([deep], TRUE)
    fit_all = fit_coefficients(*_synthetic(grid, TRUE))
    err_blind = fit_errors(blind, df, dy)[0]
    err_fit = fit_errors(fit_all, df, dy)[0]
    assert err_blind < -0.2 and abs(err_fit) < 1e-6


def test_old_four_wide_feature_rows_still_fit():
    coef = {k: v for k, v in TRUE.items() if k != "c_attn"}
    grid = [p for p in default_grid() if not p.prefill_context]
    feats, y = _synthetic(grid, coef)
    got = fit_coefficients([f[:4] for f in feats], y)
    assert got["c_attn"] == 0.0 and got["c0"] == pytest.approx(coef["c0"], rel=1e-6)


def test_overhead_fit_recovers_per_step_and_per_sequence_costs():
    rng = np.random.default_rng(5)
    samples = []
    for _ in range(400):
        n = int(rng.integers(1, 9))
        o = 0.0004 + 0.00005 * n
        if rng.random() < 0.05:
            o += 0.05                                     # a GC pause: the median drops it
        samples.append((n, o * (1 + 0.01 * rng.standard_normal())))
    got = fit_overhead(samples)
    assert got["overhead_s"] == pytest.approx(0.0004, rel=0.05)
    assert got["overhead_seq_s"] == pytest.approx(0.00005, rel=0.05)
    assert fit_overhead([(4, 0.001)] * 3) == {"overhead_s": 0.001, "overhead_seq_s": 0.0}
    assert fit_overhead([]) == {"overhead_s": 0.0, "overhead_seq_s": 0.0}


def test_fit_stays_close_under_two_percent_noise():
    feats, y = _synthetic(default_grid(), TRUE, noise=0.02, seed=1)
    got = fit_coefficients(feats, y)
    errors = fit_errors(got, feats, y)
    assert np.mean(np.abs(errors)) < 0.03
    # What the grid identifies comes back close: the fixed cost, the cost of one decode
    # (a token and a sequence) and of one prompt token. How a decode's cost splits between
    # c_tok and c_seq rests only on the number of prefill chunks, so noise may move it.
    assert got["c0"] == pytest.approx(TRUE["c0"], rel=0.1)
    assert got["c_tok"] + got["c_seq"] == pytest.approx(TRUE["c_tok"] + TRUE["c_seq"], rel=0.1)
    assert got["c_tok"] + got["c_prefill_tok"] == pytest.approx(
        TRUE["c_tok"] + TRUE["c_prefill_tok"], rel=0.1)


def test_fit_never_returns_a_negative_coefficient():
    # Timings that fall with the KV length would need c_kv < 0: NNLS clamps it to 0.
    grid = default_grid()
    feats = [p.features() for p in grid]
    y = [0.05 + 1e-3 * t - 1e-7 * kv for t, _, kv, _, _ in feats]
    got = fit_coefficients(feats, y)
    assert all(v >= 0 for v in got.values())
    assert got["c_kv"] == 0.0


def test_nnls_matches_the_unconstrained_solution_when_it_is_non_negative():
    rng = np.random.default_rng(3)
    a = rng.random((20, 4))
    x = np.array([0.5, 2.0, 0.1, 1.0])
    assert nnls(a, a @ x) == pytest.approx(x, rel=1e-9)


def test_fit_rejects_too_few_points_and_non_positive_times():
    with pytest.raises(CalibrationError, match="at least 5"):
        fit_coefficients([(1, 1, 1, 0)] * 3, [0.1] * 3)
    with pytest.raises(CalibrationError, match="positive"):
        fit_coefficients([(1, 1, 1, 0)] * 6, [0.1] * 5 + [0.0])


def test_grid_point_features_count_what_the_lab_counts():
    # 3 decodes at kv 100 (each reads 101 positions) + 50 prompt tokens in 2 chunks of 25
    p = GridPoint(3, 100, prefill_tokens=50, prefill_chunks=2)
    assert p.features() == (53, 5, 3 * 101 + 50, 50, 2 * (25 * 26 // 2))   # causal pairs
    # ... and chunks 700 tokens into their prompts: each query sees the 700 + itself and before
    p = GridPoint(3, 100, prefill_tokens=50, prefill_chunks=2, prefill_context=700)
    assert p.features() == (53, 5, 3 * 101 + 2 * 725, 50, 2 * (25 * 700 + 25 * 26 // 2))
    assert p.chunk_shapes()[-1] == (700, 25) and "@ctx 700" in p.label()
    with pytest.raises(CalibrationError):
        check_point(GridPoint(2, 10, prefill_context=5))
    with pytest.raises(CalibrationError):
        check_point(GridPoint(prefill_tokens=10, prefill_chunks=0))
    with pytest.raises(CalibrationError):
        check_point(GridPoint())


def test_quick_calibration_on_a_tiny_model_writes_a_cost_model_the_lab_loads(tiny_model_dir,
                                                                            tmp_path, capsys):
    model = tiny_model_dir
    out = tmp_path / "fit.json"
    assert main(["lab", "calibrate", "--model", str(model), "--quick", "--repeats", "2",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "fit error" in err and "load average" in err
    data = json.loads(out.read_text())
    assert data["format"] == "iterserve-lab-cost-model"
    src = data["source"]
    assert src["model"] == model.name and src["grid"] == "quick" and src["repeats"] == 2
    assert len(src["points"]) == len(default_grid(quick=True))
    assert all(p["median_s"] > 0 for p in src["points"])
    assert any(p["attn_pairs"] > 0 for p in src["points"])
    assert src["overhead"]["engine_steps"] > 0
    # the engine run's own forward steps set the level of the runner terms
    es = src["engine_scale"]
    assert es["engine_steps"] > 10 and es["applied"] and 0.5 <= es["factor"] <= 2.0
    assert "engine steps vs the grid's fit: x" in err
    assert [t for t, _ in data["token_corrections"]][:8] == [1, 2, 3, 4, 5, 6, 7, 8]
    cost = load_cost_model(out)
    assert cost.runner_time(1, 1, 33) > 0 and model.name in cost.description
    assert cost.idle_step_s == pytest.approx(max(cost.runner_time(1, 1, 33), cost.c0))
    # the serving loop around the runner was measured: a step costs more than the runner
    assert cost.overhead_s + cost.overhead_seq_s > 0
    assert cost.step_time(4, 4, 100) > cost.runner_time(4, 4, 100)
    # ... and the lab runs with it
    res = run_lab({"requests": 4, "batching": "continuous", "cost_model": data})
    assert res["continuous"]["time_s"] > 0


def test_the_shipped_smollm2_fit_is_selectable_by_name(capsys):
    assert "smollm2-cpu" in shipped_cost_models()
    cost = load_cost_model("smollm2-cpu")
    assert cost.c0 > 0 and "SmolLM2" in cost.description
    assert main(["lab", "--cost-model", "smollm2-cpu", "--requests", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["static"]["time_s"] > 0


def test_an_unknown_cost_model_name_lists_the_shipped_ones():
    with pytest.raises(CostModelError, match="smollm2-cpu"):
        load_cost_model("no-such-model")


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats"),
    (["--model", "/no/such/model"], "does not exist"),
    (["--out", "/no/such/dir/fit.json"], "does not exist"),
])
def test_bad_options_exit_2_with_one_line(argv, message, capsys):
    assert main(["lab", "calibrate", "--quick", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_unknown_flag_exits_2():
    with pytest.raises(SystemExit) as e:
        main(["lab", "calibrate", "--bogus"])
    assert e.value.code == 2


def test_big_models_drop_the_grid_points_whose_kv_does_not_fit_and_share_one_pool():
    from iterserve.lab.calibrate import _build_outputs, fit_grid_to_memory, kv_tokens
    grid = default_grid()
    # a 1.7B model in float32 KV: 393,216 bytes per token; a 2 GiB budget keeps <= 5461 tokens
    kept, dropped = fit_grid_to_memory(grid, 393_216, 2 << 30)
    assert kept and dropped and set(kept) | set(dropped) == set(grid)
    assert all(kv_tokens(p) * 393_216 <= 2 << 30 for p in kept)
    assert GridPoint(32, 1024) in dropped and GridPoint(1, 1024) in kept
    assert len(kept) >= len(COEFFICIENTS)
    # every point starts at block 0: the pool is the largest point's, not the sum
    outs, blocks = _build_outputs(kept, 16, 512)
    assert blocks == max(kv_tokens(p) // 16 for p in kept)
    for out in outs:
        ids = [b for d in out.scheduled_new_reqs for b in d.block_ids]
        assert len(ids) == len(set(ids)) and min(ids) == 0


def test_a_kv_budget_too_small_for_the_fit_is_an_error(tiny_model_dir):
    from iterserve.lab.calibrate import calibrate
    with pytest.raises(CalibrationError, match="kv-budget-gib"):
        calibrate(str(tiny_model_dir), quick=True, kv_budget_gib=1e-6)

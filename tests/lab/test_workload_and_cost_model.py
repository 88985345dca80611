"""Workload drawing, lengths files, range parsing and the cost-model file format."""

import json

import pytest

from iterserve.core.cost_model import CostModel, default_cost_model, load_cost_model
from iterserve.errors import CostModelError, WorkloadError
from iterserve.lab.workload import WorkloadSpec, draw_workload, parse_range, read_lengths_file


def test_parse_range_reads_min_max_and_a_single_number():
    assert parse_range("10-100", "--short") == (10, 100)
    assert parse_range(" 7 ", "--short") == (7, 7)
    for bad in ("10..100", "a-b", "1-2-3", "100-10", "0-5", "-5-10"):
        with pytest.raises(WorkloadError, match="--short"):
            parse_range(bad, "--short")


def test_lengths_file_ignores_blank_lines_and_comments(tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("# header\n\n 12 \n3  # short one\n\t\n400\n")
    assert read_lengths_file(f) == (12, 3, 400)


def test_lengths_file_that_is_not_text_is_an_error(tmp_path):
    f = tmp_path / "l.bin"
    f.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(WorkloadError, match="UTF-8"):
        read_lengths_file(f)


def test_the_draw_is_deterministic_per_seed():
    a = draw_workload(WorkloadSpec(seed=5))
    assert a == draw_workload(WorkloadSpec(seed=5))
    assert a != draw_workload(WorkloadSpec(seed=6))


def test_turning_on_prompts_arrivals_or_priorities_keeps_the_output_lengths():
    base = [r.output_len for r in draw_workload(WorkloadSpec(seed=5))]
    other = draw_workload(WorkloadSpec(seed=5, prompt_len=(10, 20), arrival_rate=0.5,
                                       priority_frac=0.3))
    assert [r.output_len for r in other] == base
    assert {r.priority for r in other} == {0, 1}
    assert all(10 <= r.prompt_len <= 20 for r in other)


def test_poisson_arrivals_have_the_requested_mean_rate():
    reqs = draw_workload(WorkloadSpec(requests=4000, seed=1, arrival_rate=0.5))
    arrivals = [r.arrival for r in reqs]
    assert arrivals == sorted(arrivals)
    assert 0.45 < len(reqs) / arrivals[-1] < 0.55


def test_cost_model_step_time_is_linear_in_its_terms():
    m = CostModel(c0=1.0, c_tok=0.1, c_seq=0.01, c_kv=0.001, c_prefill_tok=0.5,
                  idle_step_s=2.0)
    assert m.step_time(tokens=10, seqs=3, kv_tokens_read=100, prefill_tokens=4) == \
        pytest.approx(1.0 + 1.0 + 0.03 + 0.1 + 2.0)
    assert m.step_time(0, 0, 0) == 2.0           # an idle step


def test_cost_model_file_round_trips_and_idle_defaults_to_c0(tmp_path):
    f = tmp_path / "cost.json"
    f.write_text(json.dumps({"format": "iterserve-lab-cost-model", "version": 1,
                             "description": "fitted on X", "c0": 0.02, "c_tok": 1e-4}))
    m = load_cost_model(f)
    assert (m.c0, m.c_tok, m.c_kv, m.idle_step_s) == (0.02, 1e-4, 0.0, 0.02)
    assert CostModel.from_dict(m.to_dict()) == m


@pytest.mark.parametrize("data, words", [
    ([1, 2], "JSON object"),
    ({"c0": "fast"}, "c0 must be a finite number"),
    ({"c_kv": -1e-9}, "c_kv must be non-negative"),
    ({"c0": 1, "cO": 2}, "unknown key"),
    ({"format": "vidur"}, "format must be"),
    ({"version": 4}, "version must be one of 1, 2, 3"),
    ({"version": True}, "version must be one of"),
])
def test_bad_cost_models_are_rejected_with_the_key_named(data, words):
    with pytest.raises(CostModelError, match=words):
        CostModel.from_dict(data)


def test_missing_cost_model_file_is_a_clear_error(tmp_path):
    with pytest.raises(CostModelError, match="cannot read cost model"):
        load_cost_model(tmp_path / "nope.json")


def test_the_shipped_default_cost_model_loads_and_documents_itself():
    m = default_cost_model()
    assert m.c0 > 0 and m.c_tok > 0 and m.c_kv > 0 and m.description


# --- the attention (context) term and the serving overhead -----------------------------------

def test_step_time_charges_attention_pairs_and_the_serving_overhead():
    m = CostModel(c0=1.0, c_tok=0.1, c_attn=1e-3, overhead_s=0.5, overhead_seq_s=0.25)
    # 2 sequences, 10 tokens, 300 query-key pairs: runner 1 + 1 + 0.3, overhead 0.5 + 0.5
    assert m.runner_time(10, 2, 0, 0, 300) == pytest.approx(2.3)
    assert m.step_time(10, 2, 0, 0, 300) == pytest.approx(3.3)
    assert m.step_time(0, 0, 0) == m.idle_step_s == 0.0
    assert CostModel.from_dict(m.to_dict()) == m


def test_a_version_1_file_loads_with_no_attention_term_and_no_overhead(tmp_path):
    """Fits written before c_attn (version 1, five coefficients) still load and mean what
    they meant: the shipped default is one, and so is any user's old calibration."""
    old = {"format": "iterserve-lab-cost-model", "version": 1, "description": "old fit",
           "c0": 0.007, "c_tok": 0.0, "c_seq": 0.0027, "c_kv": 4.1e-6,
           "c_prefill_tok": 0.002, "idle_step_s": 0.007, "source": {"tool": "x"}}
    f = tmp_path / "old.json"
    f.write_text(json.dumps(old))
    m = load_cost_model(f)
    assert (m.c_attn, m.overhead_s, m.overhead_seq_s) == (0.0, 0.0, 0.0)
    assert m.step_time(9, 9, 2000, 0, 10**6) == pytest.approx(
        0.007 + 0.0027 * 9 + 4.1e-6 * 2000)
    assert m.to_dict()["version"] == 3 and CostModel.from_dict(m.to_dict()) == m
    assert "token_corrections" not in m.to_dict()      # nothing to correct: not written
    assert default_cost_model().c_attn == 0.0


def _one_long_prompt(cost, prompt_len=1000, budget=128):
    from iterserve.core.config import CacheConfig, SchedulerConfig
    from iterserve.lab.simulator import SimSettings, simulate
    from iterserve.lab.workload import RequestSpec

    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                         enable_chunked_prefill=True, max_model_len=prompt_len + 8)
    cc = CacheConfig(num_kv_blocks=200, block_size=16)
    res = simulate([RequestSpec(0, 0, prompt_len, 2, True, 0)],
                   SimSettings(sc, cc, prefill_ignored=False), cost, record=True)
    return res


def test_the_simulator_charges_each_chunk_its_query_key_pairs():
    """A 1000-token prompt in 128-token chunks: chunk k (ending at e_k) costs c_attn x its
    its causal pairs (its tokens x the context before it, plus its own triangle) on top of
    the linear price; the decode after it pays no attention term."""
    base = CostModel(c0=0.01, c_tok=1e-4, c_seq=1e-3, c_kv=1e-6, c_prefill_tok=1e-4)
    with_attn = CostModel.from_dict({**base.to_dict(), "c_attn": 2e-8})
    a, b = _one_long_prompt(base), _one_long_prompt(with_attn)
    assert a.steps == b.steps
    ends = list(range(128, 1000, 128)) + [1000]
    pairs = sum((e - s) * s + (e - s) * (e - s + 1) // 2 for s, e in zip([0] + ends[:-1], ends))
    extra = float(b.step_start_s[-1] - a.step_start_s[-1])
    assert extra == pytest.approx(2e-8 * pairs, rel=1e-9)
    # ... so each full 128-token chunk costs more than the one before it
    d = [float(x) for x in (b.step_start_s[1:] - b.step_start_s[:-1])][:len(ends) - 1]
    assert all(x < y for x, y in zip(d, d[1:]))


def test_the_simulator_adds_the_serving_overhead_to_every_busy_step():
    plain = CostModel(c0=0.01, c_tok=1e-4)
    over = CostModel(c0=0.01, c_tok=1e-4, overhead_s=0.002, overhead_seq_s=0.001)
    a, b = _one_long_prompt(plain), _one_long_prompt(over)
    # one sequence in every step: 3 ms more per step
    assert float(b.step_start_s[-1] - a.step_start_s[-1]) == pytest.approx(0.003 * a.steps)


def test_token_corrections_interpolate_extrapolate_per_token_and_round_trip(tmp_path):
    """corr(tokens) is linear between the token counts it was read off at, holds its first
    value below them and goes on per token beyond the last (a 2k-token prompt gets 8x the
    256-token step's correction, not the same); a file with corrections loads back."""
    m = CostModel(c0=0.01, c_seq=0.001,
                  token_corrections=((1, 0.0), (16, 0.004), (33, -0.002)))
    assert m.correction(1) == 0.0 and m.correction(16) == pytest.approx(0.004)
    assert m.correction(8.5) == pytest.approx(0.002)
    assert m.correction(0) == 0.0 and m.correction(33) == pytest.approx(-0.002)
    assert m.correction(66) == pytest.approx(-0.004)
    assert m.correction(500) == pytest.approx(-0.002 * 500 / 33)
    big = CostModel(c0=0.01, c_tok=1e-3, token_corrections=((128, -0.02), (256, -0.06)))
    assert big.correction(2048) == pytest.approx(-0.48)
    assert big.runner_time(2048, 1, 0) == pytest.approx(0.01 + 2.048 - 0.48)
    assert m.runner_time(16, 1, 0) == pytest.approx(0.01 + 0.001 + 0.004)
    assert m.step_time(33, 1, 0) == pytest.approx(0.011 - 0.002)
    f = tmp_path / "fit.json"
    f.write_text(json.dumps(m.to_dict()))
    assert load_cost_model(f) == m
    assert m.to_dict()["token_corrections"] == [[1, 0.0], [16, 0.004], [33, -0.002]]


def test_a_negative_correction_never_takes_a_step_below_a_tenth_of_the_linear_terms():
    m = CostModel(c0=0.01, token_corrections=((1, -1.0), (2, -1.0)))
    assert m.runner_time(1, 1, 0) == pytest.approx(0.001)
    assert m.step_time(5, 1, 0) > 0


@pytest.mark.parametrize("bad, message", [
    ([[1, 0.0], [1, 0.1]], "strictly increasing"),
    ([[3, 0.0], [2, 0.1]], "strictly increasing"),
    ([[0, 0.0]], "tokens >= 1"),
    ([[1.5, 0.0]], "tokens >= 1"),
    ([[1, float("nan")]], "finite"),
    ([[1, 0.0, 2]], "each entry"),
    ({"1": 0.0}, "list of"),
])
def test_bad_token_corrections_name_the_key(bad, message):
    with pytest.raises(CostModelError, match="token_corrections") as e:
        CostModel.from_dict({"c0": 0.01, "token_corrections": bad})
    assert message in str(e.value)


def test_linear_equivalent_is_the_closest_linear_model_not_the_joint_fits_linear_part():
    """For a shipped fit that must stay linear: the linear terms refitted to the joint
    fit's own predictions, not its linear part alone (which leans on corrections of -30%)."""
    lin = dict(c0=0.028, c_tok=1.4e-3, c_seq=2.8e-3, c_kv=1.4e-6)
    joint = CostModel(**lin, token_corrections=((1, -0.01), (8, -0.015), (16, -0.02),
                                                (128, -0.06), (512, -0.25)))
    eq = joint.linear_equivalent()
    assert eq.token_corrections == () and eq.linear_equivalent() is eq
    for shape in ((8, 8, 8 * 300, 0, 0), (128, 1, 128, 128, 128 * 128),
                  (40, 8, 7 * 300 + 33, 33, 33 * 33)):
        want = joint.runner_time(*shape)
        assert abs(CostModel(**lin).runner_time(*shape) / want - 1) > 0.2
        assert eq.runner_time(*shape) == pytest.approx(want, rel=0.12)

"""Workload drawing, lengths files, range parsing and the cost-model file format."""

import json

import pytest

from iterserve.lab.cost_model import (
    CostModel, CostModelError, default_cost_model, load_cost_model)
from iterserve.lab.workload import (
    WorkloadError, WorkloadSpec, draw_workload, parse_range, read_lengths_file)


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
    ({"version": 2}, "version must be 1"),
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

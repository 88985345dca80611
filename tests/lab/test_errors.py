"""Bad input gets a clear error: LabOptionsError from run_lab, exit code 2 from the CLI."""

import pytest

from iterserve.cli import main
from iterserve.errors import LabOptionsError
from iterserve.lab.api import run_lab


def cli(capsys, *args):
    try:
        code = main(["lab", *args])
    except SystemExit as e:                      # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("options, option, words", [
    ({"slotz": 4}, "slotz", "unknown option"),
    ({"batching": "dynamic"}, "batching", "static, continuous, both"),
    ({"max_num_seqs": 0}, "max_num_seqs", "at least 1"),
    ({"max_num_seqs": "8"}, "max_num_seqs", "integer"),
    ({"requests": 0}, "requests", "at least 1"),
    ({"lengths": [3, -1]}, "lengths", "at least 1"),
    ({"lengths": []}, "lengths", "non-empty"),
    ({"lengths": [2, 3], "requests": 5}, "requests", "lengths"),
    ({"short": [100, 10]}, "short", "below minimum"),
    ({"long": [0, 10]}, "long", "at least 1"),
    ({"short_frac": 1.5}, "short_frac", "at most 1"),
    ({"arrival_rate": 0}, "arrival_rate", "greater than 0"),
    ({"arrival_rate": 1e-9}, "arrival_rate", "at most"),
    ({"prompt_len": [10]}, "prompt_len", "two integers"),
    ({"enable_chunked_prefill": "yes"}, "enable_chunked_prefill", "true or false"),
    ({"preemption_mode": "drop"}, "preemption_mode", "recompute, swap"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy", "fcfs, priority"),
    ({"num_kv_blocks": 2, "prompt_len": [100, 100]}, "num_kv_blocks", "cannot hold"),
    ({"max_num_batched_tokens": 50, "prompt_len": [100, 100], "enable_chunked_prefill": False},
     "max_num_batched_tokens", "chunked prefill"),
    ({"cost_model": {"c0": -1}}, "cost_model", "non-negative"),
    ({"cost_model": {"c_gpu": 1}}, "cost_model", "unknown key"),
    ({"per_request": 1}, "per_request", "true or false"),
])
def test_bad_options_raise_an_error_naming_the_option(options, option, words):
    with pytest.raises(LabOptionsError) as exc:
        run_lab(options)
    assert exc.value.option == option
    assert option in str(exc.value) and words in str(exc.value)


def test_cli_zero_slots_exits_2_with_a_message(capsys):
    code, out, err = cli(capsys, "--max-num-seqs", "0")
    assert code == 2 and out == ""
    assert "max_num_seqs: must be at least 1" in err


def test_cli_unknown_choice_exits_2(capsys):
    code, _, err = cli(capsys, "--batching", "dynamic")
    assert code == 2 and "invalid choice" in err


def test_cli_malformed_range_exits_2(capsys):
    code, _, err = cli(capsys, "--short", "10..100")
    assert code == 2 and "--short" in err and "MIN-MAX" in err


def test_cli_unreadable_lengths_file_exits_2(capsys, tmp_path):
    code, _, err = cli(capsys, "--lengths", str(tmp_path / "missing.txt"))
    assert code == 2 and "cannot read lengths file" in err and "missing.txt" in err


def test_cli_malformed_lengths_file_names_the_line(capsys, tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("# answers\n12\n\nseven\n")
    code, _, err = cli(capsys, "--lengths", str(f))
    assert code == 2 and f"{f}:4:" in err and "'seven'" in err


def test_cli_negative_length_in_file_exits_2(capsys, tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("5\n-3\n")
    code, _, err = cli(capsys, "--lengths", str(f))
    assert code == 2 and f"{f}:2:" in err and "at least 1" in err


def test_cli_empty_lengths_file_exits_2(capsys, tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("# nothing\n\n")
    code, _, err = cli(capsys, "--lengths", str(f))
    assert code == 2 and "no output lengths" in err


def test_cli_bad_cost_model_file_exits_2(capsys, tmp_path):
    f = tmp_path / "cost.json"
    f.write_text("{not json")
    code, _, err = cli(capsys, "--cost-model", str(f))
    assert code == 2 and "not valid JSON" in err


def test_cli_non_numeric_value_exits_2(capsys):
    code, _, err = cli(capsys, "--requests", "many")
    assert code == 2 and "--requests" in err


def test_cli_unwritable_trace_path_exits_2(capsys, tmp_path):
    code, _, err = cli(capsys, "--requests", "4", "--trace", str(tmp_path / "no" / "t.json"))
    assert code == 2 and "cannot write" in err


@pytest.mark.parametrize("old, new", [("slots", "max_num_seqs"),
                                      ("policy", "scheduling_policy"),
                                      ("chunked_prefill", "enable_chunked_prefill")])
def test_a_former_option_name_is_refused_naming_the_new_one(old, new):
    # Not silently ignored (a script with {"slots": 4} would run the default 8).
    with pytest.raises(LabOptionsError) as exc:
        run_lab({old: None})
    assert exc.value.option == old and str(exc.value) == f"{old}: renamed to {new}"


@pytest.mark.parametrize("args, new", [(["--slots", "4"], "--max-num-seqs"),
                                       (["--policy", "priority"], "--scheduling-policy"),
                                       (["--chunked-prefill", "off"], "--enable-chunked-prefill")])
def test_cli_former_flag_exits_2_naming_the_new_one(capsys, args, new):
    code, out, err = cli(capsys, *args)
    assert code == 2 and out == ""
    assert f"{args[0]}: renamed to {new}" in err


def test_cli_knob_flags_are_the_serve_spellings(capsys):
    # --no-enable-chunked-prefill / --scheduling-policy as `iterserve serve` spells them.
    code, out, _ = cli(capsys, "--json", "--batching", "continuous", "--requests", "6",
                       "--max-num-seqs", "2", "--prompt-len", "100-100",
                       "--max-num-batched-tokens", "1000", "--no-enable-chunked-prefill",
                       "--scheduling-policy", "priority")
    import json

    got = json.loads(out)
    assert code == 0 and got == run_lab({
        "batching": "continuous", "requests": 6, "max_num_seqs": 2, "prompt_len": [100, 100],
        "max_num_batched_tokens": 1000, "enable_chunked_prefill": False,
        "scheduling_policy": "priority"})
    assert got["continuous"]["slots"] == 2
    code, _, err = cli(capsys, "--requests", "4", "--prompt-len", "100-100",
                       "--max-num-batched-tokens", "50", "--no-enable-chunked-prefill")
    assert code == 2 and "chunked prefill" in err

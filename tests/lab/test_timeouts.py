"""request_timeout, queue_timeout (simulated steps) and max_queued_requests in the lab.

The engine's Scheduler ends a request whose deadline passed with finish_reason timeout (in
schedule(), with the tokens made so far) and add_request refuses an arrival when the queue
is full; the lab counts both and keeps them out of the latency statistics.
"""

import json

import pytest

from iterserve.cli import main
from iterserve.errors import LabOptionsError
from iterserve.lab.api import run_lab


def run(**opts):
    return run_lab({"batching": "continuous", "per_request": True, **opts})["continuous"]


def test_queue_timeout_ends_a_request_never_admitted_in_time():
    # One slot: 4 runs 0-3, 3 is admitted at step 4 (before its deadline 5) and runs 4-6;
    # 2 is still waiting at step 5 and ends there with no token.
    r = run(lengths=[4, 3, 2], max_num_seqs=1, queue_timeout=5)
    recs = {p["id"]: p for p in r["per_request"]}
    assert r["timed_out"] == 1 and r["tokens"] == 7
    assert [p["finish_reason"] for p in r["per_request"]] == ["length", "length", "timeout"]
    assert recs["req-000002"]["output_tokens"] == 0 and recs["req-000002"]["finish"] == 5
    assert r["mean_latency"] == (4 + 7) / 2          # over the completed requests


def test_request_timeout_cuts_a_running_request_short():
    # Deadline 4: the long request has made 4 of its 10 tokens when schedule() ends it.
    r = run(lengths=[10, 2], max_num_seqs=2, request_timeout=4)
    recs = {p["id"]: p for p in r["per_request"]}
    assert recs["req-000000"]["finish_reason"] == "timeout"
    assert recs["req-000000"]["output_tokens"] == 4 < recs["req-000000"]["output_len"]
    assert recs["req-000000"]["finish"] == 4
    assert recs["req-000001"]["finish_reason"] == "length"
    assert recs["req-000001"]["output_tokens"] == 2
    assert r["timed_out"] == 1 and r["tokens"] == 6
    assert r["mean_latency"] == 2


def test_a_full_queue_refuses_arrivals_and_counts_them():
    # All five arrive at step 0 before the first schedule(): two fit the queue.
    r = run(lengths=[3] * 5, max_num_seqs=1, max_queued_requests=2)
    assert r["refused_queue_full"] == 3 and r["requests"] == 5
    assert r["tokens"] == 6 and r["steps"] == 6
    assert len(r["per_request"]) == 2


def test_timeouts_on_a_drawn_workload_keep_the_books_straight():
    for seed in range(5):
        opts = dict(requests=60, seed=seed, arrival_rate=1.0, prompt_len=[20, 80],
                    request_timeout=150.0, queue_timeout=40.0, max_queued_requests=20)
        r = run(**opts)
        recs = r["per_request"]
        assert len(recs) == 60 - r["refused_queue_full"]
        assert sum(p["finish_reason"] == "timeout" for p in recs) == r["timed_out"] > 0
        assert r["tokens"] == sum(p["output_tokens"] for p in recs)
        for p in recs:
            if p["finish_reason"] == "length":
                assert p["output_tokens"] == p["output_len"]
                assert p["finish"] - p["arrival"] <= 150
            else:
                assert p["output_tokens"] < p["output_len"]
                assert p["finish"] - p["arrival"] <= 150
        # Same seed, same answer (the lab is deterministic).
        assert run(**opts) == r


def test_without_the_knobs_the_report_has_no_new_keys():
    r = run_lab({"requests": 10})
    for mode in r.values():
        assert "timed_out" not in mode and "refused_queue_full" not in mode


@pytest.mark.parametrize("options, option, words", [
    ({"request_timeout": 0}, "request_timeout", "greater than 0"),
    ({"queue_timeout": -1.0}, "queue_timeout", "greater than 0"),
    ({"max_queued_requests": -1}, "max_queued_requests", "at least 0"),
    ({"request_timeout": 10, "arrival_rate_s": 2.0}, "request_timeout", "simulated steps"),
])
def test_bad_timeout_options_name_the_option(options, option, words):
    with pytest.raises(LabOptionsError) as exc:
        run_lab(options)
    assert exc.value.option == option and words in str(exc.value)


def test_cli_flags_reach_the_scheduler_and_the_table_shows_the_counts(capsys):
    args = ["--batching", "continuous", "--requests", "30", "--arrival-rate", "1",
            "--prompt-len", "20-80", "--request-timeout", "150", "--queue-timeout", "40",
            "--max-queued-requests", "10"]
    assert main(["lab", "--json", *args]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == run_lab({"batching": "continuous", "requests": 30, "arrival_rate": 1.0,
                           "prompt_len": [20, 80], "request_timeout": 150.0,
                           "queue_timeout": 40.0, "max_queued_requests": 10})
    assert main(["lab", *args]) == 0
    text = capsys.readouterr().out
    assert "timed out" in text and "refused (queue full)" in text
    assert "simulated steps" in main_help(capsys)


def main_help(capsys):
    with pytest.raises(SystemExit):
        main(["lab", "--help"])
    return capsys.readouterr().out

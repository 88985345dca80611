"""The CLI's table, --json, --trace and --plot outputs are valid and agree with run_lab."""

import json

from iterserve.cli import main
from iterserve.lab.api import run_lab


def test_default_run_prints_both_modes_side_by_side_and_the_speed_up(capsys):
    assert main(["lab"]) == 0
    out = capsys.readouterr().out
    assert "static" in out and "continuous" in out
    assert "2,119" in out and "945" in out and "34.4%" in out and "77.2%" in out
    assert "speed-up" in out


def test_json_output_is_the_run_lab_result(capsys):
    assert main(["lab", "--json", "--requests", "12", "--max-num-seqs", "4", "--short", "5-20",
                 "--long", "30-40", "--seed", "3"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == run_lab({"requests": 12, "max_num_seqs": 4, "short": [5, 20], "long": [30, 40],
                           "seed": 3})


def test_per_request_flag_adds_records_and_timeline(capsys, tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("3\n1  # a one-token answer\n2\n")
    assert main(["lab", "--per-request", "--lengths", str(f), "--max-num-seqs", "2",
                 "--batching", "continuous"]) == 0
    got = json.loads(capsys.readouterr().out)["continuous"]
    assert [p["finish"] for p in got["per_request"]] == [3, 1, 3]
    assert got["timeline"]["running"] == [2, 2, 2]


def test_prefill_options_reach_the_scheduler(capsys):
    assert main(["lab", "--json", "--batching", "continuous", "--requests", "30",
                 "--prompt-len", "50-100", "--num-kv-blocks", "60", "--block-size", "16",
                 "--preemption-mode", "swap", "--no-enable-chunked-prefill",
                 "--max-num-batched-tokens", "1024", "--scheduling-policy", "priority",
                 "--priority-frac", "0.5", "--arrival-rate", "2"]) == 0
    got = json.loads(capsys.readouterr().out)["continuous"]
    assert got["preemptions"] > 0 and "p99_ttft" in got


def test_trace_file_is_a_valid_chrome_trace_following_each_request(capsys, tmp_path):
    path = tmp_path / "trace.json"
    assert main(["lab", "--lengths", str(_lengths(tmp_path)), "--max-num-seqs", "2",
                 "--trace", str(path)]) == 0
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    for e in events:
        assert {"ph", "name", "pid", "tid"} <= set(e)
        if e["ph"] != "M":
            assert e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["cat"] in ("prefill", "decode")
    slices = [e for e in events if e["ph"] == "X"]
    # Static: 3 requests, 3 slices; continuous: 3 more, on slots 0 and 1 (tids 1, 2).
    assert len(slices) == 6 and {e["tid"] for e in slices} == {1, 2}
    assert {e["pid"] for e in slices} == {1, 2}
    begins = [e for e in events if e["ph"] == "b" and e["cat"] == "request"]
    ends = [e for e in events if e["ph"] == "e" and e["cat"] == "request"]
    assert len(begins) == len(ends)
    names = {e["name"] for e in begins}
    assert {"req-000000", "req-000001", "req-000002", "queued"} <= names


def test_plot_file_is_a_png_with_one_panel_per_mode(capsys, tmp_path):
    import matplotlib.image

    path = tmp_path / "gantt.png"
    assert main(["lab", "--requests", "16", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(str(path))
    assert img.shape[0] > 100 and img.shape[1] > 100


def _lengths(tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("3\n1\n2\n")
    return f


def test_serve_runs_the_app_without_a_model(monkeypatch):
    import uvicorn

    import iterserve.server.app as app_module

    calls = {}
    monkeypatch.setattr(app_module, "create_app", lambda engine=None, **kw: ("app", engine))
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port: calls.update(
        app=app, host=host, port=port))
    assert main(["lab", "--serve", "--port", "8123"]) == 0
    assert calls == {"app": ("app", None), "host": "127.0.0.1", "port": 8123}


def test_trace_shows_prefill_phases_and_preempted_waits(tmp_path):
    from iterserve.lab.api import plan_lab, simulate_plan
    from iterserve.lab.trace import chrome_trace

    plan = plan_lab({"batching": "continuous", "requests": 40, "max_num_seqs": 8,
                     "prompt_len": [50, 100], "num_kv_blocks": 60})
    results = simulate_plan(plan, record=True)
    events = chrome_trace(results)["traceEvents"]
    assert {e["cat"] for e in events if e["ph"] == "X"} == {"prefill", "decode"}
    waits = [e for e in events if e["ph"] == "b" and e["name"] == "preempted"]
    assert waits and all(e["args"]["end_step"] > e["args"]["start_step"] for e in waits)
    json.dumps(events)

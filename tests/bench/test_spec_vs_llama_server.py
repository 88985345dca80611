"""spec_vs_llama_server's arms and report: a grid of synthetic acceptances, and gains taken
over the same round's arm without speculation, summarised as medians over the rounds."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "spec_vs_llama_server", ROOT / "benchmarks" / "spec_vs_llama_server.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


m = _load()


def test_a_grid_gives_each_acceptance_its_adaptive_and_every_draft_arm():
    sets = [[0.5, 0.25], [0.9, 0.81]]
    arms = m.synthetic_arms(sets)
    assert [a for a, _ in arms] == ["off", "synthetic a=0.5", "synthetic a=0.5 every draft",
                                    "synthetic a=0.9", "synthetic a=0.9 every draft"]
    cfg = json.loads(arms[4][1][1])
    assert cfg == {"method": "synthetic", "acceptance_rates": [0.9, 0.81], "adaptive": False}
    peer = m.llama_synthetic_arms(sets, Path("draft.gguf"))
    assert peer[3][0] == "ngram-mod synthetic a=0.9" and "0.9,0.81" in peer[3][1]
    # one rate set: the labels the single-set results already use
    assert [a for a, _ in m.synthetic_arms([[0.8]])] == ["off", "synthetic",
                                                          "synthetic every draft"]


def _row(engine, arm, rep, tok_s, slots=1):
    return {"engine": engine, "arm": arm, "slots": slots, "repeat": rep,
            "output_tok_per_s": tok_s}


def test_gains_are_over_the_same_rounds_off_and_summarised_as_medians():
    rows = [_row("iterserve", "off", 0, 100.0), _row("iterserve", "suffix", 0, 210.0),
            _row("iterserve", "off", 1, 50.0), _row("iterserve", "suffix", 1, 90.0),
            _row("iterserve", "off", 2, 80.0), _row("iterserve", "suffix", 2, 200.0),
            _row("llama-server", "off", 0, 40.0)]
    m.add_ratios(rows)
    # a slow round (1) lowers both of its arms: its gain is 1.8x, not 90/100
    assert [round(r["vs_own_off"], 2) for r in rows if r["arm"] == "suffix"] == [2.1, 1.8, 2.5]
    assert rows[1]["vs_llama_server_off"] == 210.0 / 40.0
    assert "vs_llama_server_off" not in rows[3]       # no peer arm in that round
    med = {(x["engine"], x["arm"]): x for x in m.arm_medians(rows)}
    s = med[("iterserve", "suffix")]
    assert s["repeats"] == 3 and s["output_tok_per_s"] == 200.0
    assert s["vs_own_off"] == 2.1 and s["vs_own_off_range"] == [1.8, 2.5]
    assert [x["arm"] for x in m.arm_medians(rows)][:2] == ["off", "suffix"]

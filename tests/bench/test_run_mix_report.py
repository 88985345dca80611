"""run_mix's report: ratios to llama-server F16 -np 8 first, engines sorted by throughput."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(name, rel):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


run_mix = _load("run_mix", "benchmarks/run_mix.py")


def serve_doc(engine, tok_s):
    stat = {"median_ms": 10.0, "p99_ms": 20.0}
    return {"engine": engine, "summary": {
        "output_throughput": tok_s, "total_token_throughput": tok_s * 1.2, "duration_s": 60.0,
        "ttft": stat, "itl": stat, "failed": 0}}


def test_the_table_leads_with_ratios_to_the_reference_and_sorts_by_throughput():
    rows = [run_mix.row(serve_doc("llama-server F16 -np 8", 100.0)),
            run_mix.row(serve_doc("iterserve -max-num-seqs 8", 150.0)),
            run_mix.row({"engine": "HF static generate 8", "output_throughput": 30.0,
                         "total_token_throughput": 35.0, "wall_s": 200.0})]
    md = run_mix.markdown(rows, ["vLLM: skipped (no GPU)"],
                          {"cpu": "X", "cpus_usable": 2, "platform": "linux", "loadavg": [1, 1, 1]})
    lines = [ln for ln in md.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert [ln.split(" | ")[0] for ln in lines] == [
        "| iterserve -max-num-seqs 8", "| llama-server F16 -np 8", "| HF static generate 8"]
    assert "| 1.50x |" in lines[0] and "| 1.00x |" in lines[1] and "| 0.30x |" in lines[2]
    assert "- / -" in lines[2]              # offline peers have no per-token latencies
    assert "vLLM: skipped" in md and "2 usable CPUs" in md

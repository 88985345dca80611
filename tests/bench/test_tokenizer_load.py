"""benchmarks/bench_tokenizer_load.py on a tiny GGUF: both ways build the same tokenizer, and
the JSON has the two timings."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_tokenizer_load  # noqa: E402


def test_both_loads_give_the_same_tokenizer_and_are_timed(tmp_path):
    from fixtures.tiny_gguf import write_tiny_llama_gguf
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path)
    out = tmp_path / "r.json"
    assert bench_tokenizer_load.main([str(path), "--repeats", "2", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["same_tokens"] and row["gguf_reader_s"] > 0 and row["from_path_s"] > 0

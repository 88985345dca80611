"""benchmarks/profile_decode.py: where a decode step's time goes.

A real engine on a tiny random Q4_0 GGUF (the fused decode path, as on the 1.7B file) runs a
few profiled steps (~5 s): every ms of a step must land in exactly one row (the rows add up to
the timed step, none is negative: the wrappers nest as the breakdown assumes), the native
phase timers must give the layer GEMMs per weight type, and the table must show them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import profile_decode  # noqa: E402
from iterserve.model import kernels  # noqa: E402

pytestmark = pytest.mark.skipif(not (kernels._cpu_has_avx2_fma() and kernels._compiler()),
                                reason="needs an x86-64 AVX2/FMA CPU and a C compiler")

CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=512, rms_norm_eps=1e-5, rope_theta=1e4,
           max_position_embeddings=256, tie_word_embeddings=False)


def test_profile_rows_add_up_to_the_step_and_split_the_layer_gemms_by_type(tmp_path):
    from fixtures.tiny_gguf import write_random_llama_gguf
    path = tmp_path / "m.gguf"
    write_random_llama_gguf(path, CFG, "Q4_0")
    engine = profile_decode.warm_engine(2, 6, str(path))
    assert engine.executor.fused_decode                    # the path a 1.7B GGUF decodes on
    doc = profile_decode.profile(engine, 6, top=10)
    rows = {r["what"]: r["ms"] for r in doc["breakdown_ms"]}
    assert sum(rows.values()) == pytest.approx(doc["step_ms_timed_mean"], abs=0.02)
    assert doc["minor_page_faults_per_step"] >= 0
    assert all(v > -0.05 for v in rows.values()), rows     # remainders: nesting holds
    for part in ("layers: gemm q/k/v", "layers: gemm o", "layers: gemm gate/up",
                 "layers: gemm down", "layers: attention", "sampler"):
        assert rows[part] > 0, part
    assert set(doc["gemm_by_type_ms"]) == {"Q4_0"}
    gemms = sum(rows[f"layers: gemm {p}"] for p in ("q/k/v", "o", "gate/up", "down"))
    assert doc["gemm_by_type_ms"]["Q4_0"] == pytest.approx(gemms, rel=0.05, abs=0.01)
    head = next(r for r in doc["breakdown_ms"] if r["what"].startswith("LM head"))
    assert head["weight_bytes"] > 0 and "native" in head["what"]
    py = profile_decode.python_only(engine, 5)
    assert 0 < py["python_only_step_thread_cpu_ms_median"] < doc["step_ms_plain_median"] * 2
    assert engine.executor.model._fused._fn is not None          # the kernels are back
    from iterserve.model import kernels
    assert not getattr(kernels._lib().iterserve_qgemm, "__name__", "") == "<lambda>"
    doc.update(py, batch=2, model="m.gguf", threads=1, load_1m=0.0)
    md = profile_decode.table(doc)
    assert "| layers: gemm gate/up |" in md and "| Q4_0 |" in md and "**sum**" in md
    assert "Python alone (every native call a no-op" in md

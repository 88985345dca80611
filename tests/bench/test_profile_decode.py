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
    stubbed = set(profile_decode.native_work_entries())
    assert py["python_only_native_calls"].get("decode_layers (fused)", 0) >= 5
    assert set(py["python_only_native_calls"]) <= stubbed | {"decode_layers (fused)"}
    fn = engine.executor.model._fused._fn                         # the kernels are back
    assert fn.__name__ == "iterserve_decode_layers_kv"
    lib = kernels._lib()
    assert all(getattr(lib, n).__name__ == n for n in stubbed)
    doc.update(py, batch=2, model="m.gguf", threads=1, load_1m=0.0)
    md = profile_decode.table(doc)
    assert "| layers: gemm gate/up |" in md and "| Q4_0 |" in md and "**sum**" in md
    assert "Python alone (every native call a no-op" in md


def test_python_alone_stubs_every_native_entry_that_does_work():
    """"Python alone" stubs the kernel library's function table, not a hand-kept list (which
    can miss a kernel added later): every
    entry the wrappers call that takes a pointer is stubbed; what stays real are pure integer
    queries (ISA and dispatch decisions), so the step keeps its Python path."""
    import re
    stubbed = set(profile_decode.native_work_entries())
    assert {"iterserve_qgemm", "iterserve_gemm", "iterserve_linear_kernel", "iterserve_k_bf16",
            "iterserve_k_f16", "iterserve_prefill_attention", "iterserve_decode_attention_kv",
            "iterserve_decode_layers_kv", "iterserve_rmsnorm", "iterserve_dequant"} <= stubbed
    src = "".join(p.read_text() for p in Path(kernels.__file__).parent.glob("*.py"))
    called = set(re.findall(r"(?:\blib|\b_lib\(\))\.(iterserve_\w+)", src))
    assert "iterserve_prefill_attention" in called and len(called) > 15
    table = kernels._abi.ARGTYPES
    for name in called - stubbed - {"iterserve_abi", "iterserve_configure",
                                    "iterserve_config_state"}:
        assert name in table, f"{name} is called but not in kernels._abi.ARGTYPES"
        assert all(t is not kernels._abi._p for t in table[name][1]), \
            f"{name} takes a pointer (does work) but Python alone would not stub it"

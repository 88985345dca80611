"""The GGUF-native kernels (kernels/qgemm.c, dequant.c) over blocks exactly as a file holds them.

Per type: `dequant` must equal gguf-py's `quants.dequantize` bit for bit, and `qgemm` must equal
gguf-py's dequantisation + a float matmul within fp32 summation tolerance for 1, 7, 32 and 300
rows, writing only its column range of a wider output. Blocks come from gguf-py's quantisers
where it has one, else random bytes under sane f16 scales (valid blocks for these types).
The wrappers must reject bad tensors with ValueError, and the kernels must degrade (report
unavailable) rather than fail.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.gguf_blocks import TYPES, gguf_blocks
from iterserve.errors import KernelsUnavailable
from iterserve.model import kernels

pytestmark = pytest.mark.skipif(not (kernels._cpu_has_avx2_fma() and kernels._compiler()),
                                reason="needs an x86-64 AVX2/FMA/F16C CPU and a C compiler")



def assert_fp32_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """out == x @ w.T up to fp32 summation error: |diff| <= 4e-6 * (|x| @ |w|.T) (+ a tiny
    floor), i.e. relative to the sum of the products' magnitudes, not to the result's (random
    K-quant blocks give large weights whose products cancel)."""
    bound = 4e-6 * (x.abs() @ w.abs().T) + 1e-7
    diff = (out - x @ w.T).abs()
    assert (diff <= bound).all(), f"max excess {(diff - bound).max().item()}"


def test_library_loads_and_reports_features_and_types():
    assert kernels.available(), kernels.unavailable
    assert {"avx2", "fma", "f16c"} <= kernels.features()
    from gguf import GGMLQuantizationType as Q
    for name in TYPES:
        assert kernels.supports_dequant(Q[name]) and kernels.supports_qgemm(Q[name]), name
    assert not kernels.supports_qgemm(Q.Q8_1) and not kernels.supports_dequant(Q.IQ2_XXS)


@pytest.mark.parametrize("name", TYPES)
def test_dequant_is_bit_identical_to_gguf_py(name):
    t, raw, ref = gguf_blocks(name, 37, 512, seed=1)
    out = kernels.dequant(t, raw, 512, torch.empty(37, 512))
    assert torch.equal(out, ref)
    # a slice of rows (an embedding lookup) and a strided output
    wide = torch.full((5, 600), 7.0)
    kernels.dequant(t, raw[10:15], 512, wide[:, 40:552])
    assert torch.equal(wide[:, 40:552], ref[10:15])
    assert (wide[:, :40] == 7).all() and (wide[:, 552:] == 7).all()


def test_float_types_dequantise_any_row_length():
    for name in ("F32", "F16", "BF16"):
        t, raw, ref = gguf_blocks(name, 3, 37)
        assert torch.equal(kernels.dequant(t, raw, 37, torch.empty(3, 37)), ref)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_qgemm_equals_dequantise_plus_matmul(name, rows):
    t, raw, w = gguf_blocks(name, 70, 512, seed=rows)
    x = torch.randn(rows, 512)
    out = torch.full((rows, 80), 3.0)
    kernels.qgemm(t, raw, 512, x, out, col0=4)
    assert_fp32_close(out[:, 4:74], x, w)
    assert (out[:, :4] == 3).all() and (out[:, 74:] == 3).all()       # only its columns


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0"])
@pytest.mark.parametrize("threads", [1, 2])
def test_qgemm_long_rows_and_thread_splits(name, threads, monkeypatch):
    """K = 2,560: activation tiles exceed the L1 budget and are summed over K chunks; 300
    columns split unevenly over threads and column chunks."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    t, raw, w = gguf_blocks(name, 300, 2560, seed=threads)
    for rows in (1, 5, 8, 12):
        x = torch.randn(rows, 2560)
        out = torch.empty(rows, 300)
        kernels.qgemm(t, raw, 2560, x, out)
        assert_fp32_close(out, x, w)


def test_segments_of_different_types_fill_one_output():
    """A Q4_K_M file's fused q/k/v: three segments of three types, side by side."""
    segs = [gguf_blocks("Q4_K", 64, 256, 1), gguf_blocks("Q6_K", 32, 256, 2),
            gguf_blocks("Q5_0", 32, 256, 3)]
    x = torch.randn(6, 256)
    out = torch.empty(6, 128)
    col = 0
    for t, raw, _ in segs:
        kernels.qgemm(t, raw, 256, x, out, col0=col)
        col += raw.shape[0]
    assert_fp32_close(out, x, torch.cat([w for _, _, w in segs]))


def test_wrappers_reject_bad_tensors_with_value_error():
    t, raw, _ = gguf_blocks("Q4_0", 8, 64)
    x, out = torch.randn(2, 64), torch.empty(2, 8)
    kernels.qgemm(t, raw, 64, x, out)                              # the good call
    bad = [
        (t, raw.view(torch.int8), 64, x, out, 0),                  # not uint8
        (t, raw, 96, x, out, 0),                                   # rows too short for k
        (t, raw, 63, x, out, 0),                                   # k not a block multiple
        (t, raw[:, :-2], 64, x, out, 0),                           # truncated rows
        (t, raw.t().contiguous().t(), 64, x, out, 0),              # rows not contiguous
        (t, raw, 64, x.double(), out, 0),                          # float64 activations
        (t, raw, 64, torch.randn(64, 2).t(), out, 0),              # strided activation rows
        (t, raw, 64, torch.randn(2, 32), out, 0),                  # wrong k in x
        (t, raw, 64, x, torch.empty(2, 7), 0),                     # output too narrow
        (t, raw, 64, x, torch.empty(2, 12), 5),                    # col0 + N past the end
        (t, raw, 64, x, torch.empty(3, 8), 0),                     # row counts differ
        (9, raw, 64, x, out, 0),                                   # Q8_1: no kernel
    ]
    for args in bad:
        with pytest.raises(ValueError):
            kernels.qgemm(*args)
    with pytest.raises(ValueError):
        kernels.dequant(t, raw, 64, torch.empty(8, 63))
    with pytest.raises(ValueError):
        kernels.dequant(t, raw, 64, torch.empty(8, 64, dtype=torch.float16))


def test_decode_attention_rejects_tables_outside_the_pool():
    q, out = torch.randn(2, 4, 16), torch.empty(2, 4, 16)
    pool = torch.randn(8 * 4, 2 * 16)
    lens = torch.tensor([5, 3], dtype=torch.int32)
    good = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    kernels.decode_attention(q, pool, pool, good, lens, 0, 4, 0.25, out)
    with pytest.raises(ValueError, match="block table"):
        kernels.decode_attention(q, pool, pool, torch.tensor([[1, 8], [3, 0]], dtype=torch.int32),
                                 lens, 0, 4, 0.25, out)
    with pytest.raises(ValueError, match="length"):
        kernels.decode_attention(q, pool, pool, good, torch.tensor([9, 3], dtype=torch.int32),
                                 0, 4, 0.25, out)
    with pytest.raises(ValueError):
        kernels.decode_attention(q, pool, pool, good.long(), lens, 0, 4, 0.25, out)


def test_disabled_kernels_report_unavailable_and_wrappers_raise(monkeypatch):
    monkeypatch.setenv("ITERSERVE_NATIVE_KERNELS", "0")
    kernels.clear_cache()
    try:
        assert not kernels.available() and "ITERSERVE_NATIVE_KERNELS" in kernels.unavailable
        assert not kernels.supports_qgemm(2)
        assert kernels.decode_attention() is None
        assert "avx2" in kernels.features()          # still detected, from /proc/cpuinfo
        t, raw, _ = gguf_blocks("Q4_0", 8, 64)
        with pytest.raises(KernelsUnavailable):
            kernels.qgemm(t, raw, 64, torch.randn(1, 64), torch.empty(1, 8))
        assert not kernels.DecodeLayers.supported([])
    finally:
        monkeypatch.delenv("ITERSERVE_NATIVE_KERNELS")
        kernels.clear_cache()
    assert kernels.available()


def test_a_broken_compiler_degrades(monkeypatch, tmp_path):
    monkeypatch.setenv("ITERSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    kernels.clear_cache()
    try:
        assert not kernels.available() and "failed" in kernels.unavailable
    finally:
        kernels.clear_cache()


# --- the register kernels of every type, per instruction set -----------------------------------
# IQ4_NL and MXFP4 have AVX-512 register kernels (a byte shuffle of their codebooks); with
# AVX2 forced "registers" is the generic kernel for them
REGISTER_TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "F16", "BF16",
                  "F32", "IQ4_NL", "MXFP4"]
ISAS = ["avx2"] + (["avx512"] if "avx512f" in kernels.features() else [])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", REGISTER_TYPES)
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_register_kernel_of_each_isa_equals_dequantise_plus_matmul(name, rows, isa):
    """The type's register kernel itself (qgemm_path "registers": no hand-over to the panel
    GEMM at 32 and 300 rows), AVX2 and AVX-512 forced; K = 768 (3 K-quant super-blocks)."""
    t, raw, w = gguf_blocks(name, 70, 768, seed=rows)
    x = torch.randn(rows, 768)
    out = torch.full((rows, 80), 3.0)
    kernels.qgemm_path("registers", t, raw, 768, x, out, col0=4)
    assert_fp32_close(out[:, 4:74], x, w)
    assert (out[:, :4] == 3).all() and (out[:, 74:] == 3).all()       # only its columns


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", REGISTER_TYPES)
def test_register_kernel_decodes_every_weight_exactly(name, isa):
    """x = the identity: each output is one weight times 1 plus zeros, so the kernel's in-register
    decoding must equal gguf-py's dequantisation bit for bit (summation order cannot matter)."""
    t, raw, w = gguf_blocks(name, 40, 512, seed=7)
    out = torch.empty(512, 40)
    kernels.qgemm_path("registers", t, raw, 512, torch.eye(512), out)
    assert torch.equal(out, w.T)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "BF16", "MXFP4"])
def test_register_kernel_long_rows_and_threads(name, isa, monkeypatch):
    """K = 8,192 with 1-8 rows: activation tiles over 64 KB are summed over K chunks; two
    threads split 300 columns unevenly."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    t, raw, w = gguf_blocks(name, 300, 8192, seed=5)
    for rows in (1, 3, 8):
        x = torch.randn(rows, 8192)
        out = torch.empty(rows, 300)
        kernels.qgemm_path("registers", t, raw, 8192, x, out)
        assert_fp32_close(out, x, w)

"""The prefill GEMM over encoded weights (kernels/prefill.c, `kernels.gemm`).

Per type and per instruction set (also for the decode kernels of Q4_0 / Q4_1 / Q8_0) (the AVX-512 12x32 micro-kernel and the AVX2 6x16 one, both
run on an AVX-512 CPU through `kernels.gemm_isa`): the result must equal gguf-py's
dequantisation + a float matmul within fp32 summation tolerance, for row counts that leave
partial micro-tiles, weight row counts that leave a partial panel, K over several chunks, and
it must write only its column range of a wider output. layers.Linear must route calls of more
than QUANT_MAX_ROWS rows to it (and no float tile must be decoded then).

The int8-activation prefill GEMM (kernels/prefill8.c, `kernels.gemm_int8`) is checked the way
tests/model/test_int8_kernel.py checks the decode one: against gguf-py's dequantisation times
the *same 8-bit* activations to fp32 summation error (the integer part is exact), and against
the float activations within the bound the rounding allows; per type and ISA, ragged row
counts, a partial panel, K of 10 super-blocks, two threads; and the activation mode must route
`gemm` (what prefill calls) to it or to the float path.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.gguf_blocks import TYPES, gguf_blocks
from gguf import GGMLQuantizationType
from iterserve.model import kernels

pytestmark = pytest.mark.skipif(not (kernels._cpu_has_avx2_fma() and kernels._compiler()),
                                reason="needs an x86-64 AVX2/FMA/F16C CPU and a C compiler")

ISAS = ["avx2"] + (["avx512"] if "avx512f" in kernels.features() else [])


def assert_fp32_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """out == x @ w.T up to fp32 summation error, relative to sum |x_i w_i| (see
    test_gguf_kernels.py)."""
    bound = 4e-6 * (x.abs() @ w.abs().T) + 1e-7
    diff = (out - x @ w.T).abs()
    assert (diff <= bound).all(), f"max excess {(diff - bound).max().item()}"


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", TYPES)
def test_gemm_equals_dequantise_plus_matmul(name, isa):
    # n = 70: two full panels of 32 and one of 6; k = 768: three K chunks of 256
    t, raw, w = gguf_blocks(name, 70, 768, seed=3)
    for rows in (1, 13, 33, 100):                   # partial 12- and 6-row micro-tiles
        x = torch.randn(rows, 768)
        out = torch.full((rows, 80), 3.0)
        kernels.gemm(t, raw, 768, x, out, col0=4)
        assert_fp32_close(out[:, 4:74], x, w)
        assert (out[:, :4] == 3).all() and (out[:, 74:] == 3).all()   # only its columns


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_thread_splits_strided_activations_and_odd_panels(isa, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    for name, n in (("Q4_1", 33), ("Q4_K", 17), ("F32", 300)):
        t, raw, w = gguf_blocks(name, n, 512, seed=n)
        # row strides 600 and 1024 (x rows that share L1 sets)
        for x in (torch.randn(64, 600)[:, 10:522], torch.randn(64, 1024)[:, :512]):
            out = torch.empty(64, n)
            kernels.gemm(t, raw, 512, x, out)
            assert_fp32_close(out, x, w)


def test_gemm_rejects_bad_arguments_with_value_error():
    t, raw, _ = gguf_blocks("Q4_0", 8, 64)
    x, out = torch.randn(40, 64), torch.empty(40, 8)
    kernels.gemm(t, raw, 64, x, out)
    bad = [(t, raw, 63, x, out, 0), (t, raw, 64, x.double(), out, 0),
           (t, raw, 64, x, torch.empty(40, 7), 0), (t, raw, 64, x, torch.empty(41, 8), 0),
           (t, raw, 64, torch.randn(64, 40).t(), out, 0), (9, raw, 64, x, out, 0)]
    for args in bad:
        with pytest.raises(ValueError):
            kernels.gemm(*args)
    tf, rawf, _ = gguf_blocks("F16", 8, 40)             # float types: k % 32 == 0
    with pytest.raises(ValueError):
        kernels.gemm(tf, rawf, 40, torch.randn(40, 40), out)


def test_linear_sends_prefill_rows_to_the_panel_gemm(monkeypatch):
    from iterserve.model import layers, weights
    from iterserve.model.weights import EncodedWeight
    segs = [gguf_blocks("Q4_K", 64, 512, 1), gguf_blocks("Q6_K", 32, 512, 2),
            gguf_blocks("IQ4_NL", 32, 512, 3)]
    lin = layers.Linear(512, 128)
    lin.set_weight(EncodedWeight([(t, raw) for t, raw, _ in segs], 512))
    assert lin.use_quant(True)
    calls = []
    real = kernels.gemm
    monkeypatch.setattr(kernels, "gemm", lambda *a, **kw: (calls.append(a[0]), real(*a, **kw)))

    def no_tiles(*a, **kw):
        raise AssertionError("a float tile was decoded")
    monkeypatch.setattr(layers, "decode_rows", no_tiles)
    x = torch.randn(layers.QUANT_MAX_ROWS + 1, 512)
    assert_fp32_close(lin(x), x, torch.cat([w for _, _, w in segs]))
    assert calls == [t for t, _, _ in segs]
    calls.clear()
    lin(torch.randn(layers.QUANT_MAX_ROWS, 512))          # decode rows: not the panel GEMM
    assert calls == []
    assert weights.TILE_BYTES                               # the reference path still exists
    lin.use_quant(False)
    monkeypatch.undo()
    assert_fp32_close(lin(x), x, torch.cat([w for _, _, w in segs]))


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_decode_qgemm_of_each_isa_equals_dequantise_plus_matmul(name, isa):
    """qgemm's Q4_0 / Q4_1 / Q8_0 kernels have AVX-512 variants (two blocks' halves per zmm,
    4 accumulators per row up to 3 rows): every row count of a decode tile, and K = 2,560
    (activation tiles summed over K chunks)."""
    for k in (512, 2560):
        t, raw, w = gguf_blocks(name, 70, k, seed=k)
        for rows in (1, 2, 3, 4, 5, 8, 13, 32):
            x = torch.randn(rows, k)
            out = torch.full((rows, 80), 3.0)
            kernels.qgemm(t, raw, k, x, out, col0=4)
            assert_fp32_close(out[:, 4:74], x, w)
            assert (out[:, :4] == 3).all() and (out[:, 74:] == 3).all()


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q5_K", "Q5_0", "Q5_1"])
def test_gemm_row_blocks_and_register_panel_decoders(name, isa):
    """The K-quant / Q5 panels decoded in registers (blocks512.h) and activation rows in
    balanced blocks of at most 256 (300 rows -> two blocks of 156 / 144), K = 512."""
    t, raw, w = gguf_blocks(name, 40, 512, seed=11)
    x = torch.randn(300, 512)
    out = torch.empty(300, 40)
    kernels.gemm(t, raw, 512, x, out)
    assert_fp32_close(out, x, w)


# --- the int8-activation prefill GEMM (kernels/prefill8.c, `kernels.gemm_int8`) -------------

INT8_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
INT8_ISAS = ["avx2"] + (["avx512vnni"] if {"avx512f", "avx512bw", "avx512vl", "avx512vnni"}
                        <= kernels.features() else [])


def quantised32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as the kernel quantises it, dequantised: blocks of 32, d = max|x| / 127, round half
    to even; each element's d)."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv)
    return (q * d).reshape(m, k), d.expand(m, k // 32, 32).reshape(m, k)


def assert_int8_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """out == (x quantised to 8 bits) @ w.T up to fp32 summation error (the integer part is
    exact), and within the bound the rounding allows of x @ w.T: sum_j |w_j| d_j / 2."""
    xq, d = quantised32(x)
    w64 = w.double()
    mag = xq.double().abs() @ w64.abs().T
    diff = (out.double() - xq.double() @ w64.T).abs()
    assert (diff <= 4e-6 * mag + 1e-9).all(), f"max excess {(diff - 4e-6 * mag).max().item()}"
    bound = (d.double() / 2) @ w64.abs().T + 4e-6 * mag + 1e-9
    assert ((out.double() - x.double() @ w64.T).abs() <= bound).all()


@pytest.mark.parametrize("isa8", INT8_ISAS, indirect=True)
@pytest.mark.parametrize("name", INT8_TYPES)
def test_int8_gemm_equals_quantised_activations_times_dequantised_weights(name, isa8):
    if not kernels.supports_gemm_int8(int(GGMLQuantizationType[name])):
        pytest.skip(f"no int8 prefill GEMM for {name} on {isa8} (vpmaddubsw would saturate)")
    # n = 70: two full panels of 32 and one of 6; K = 768 (3 super-blocks, 24 blocks of 32)
    t, raw, w = gguf_blocks(name, 70, 768, seed=5)
    for rows in (1, 5, 7, 33, 100):          # partial 6- (AVX-512) and 4-row (AVX2) tiles
        x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
        x[0, 32:64] = 0.0                    # an all-zero activation block (scale 0)
        out = torch.full((rows, 80), 3.0)
        kernels.gemm_int8(t, raw, 768, x, out, col0=4)
        assert (out[:, :4] == 3).all() and (out[:, 74:] == 3).all()    # only its columns
        assert_int8_close(out[:, 4:74], x, w)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_0"])
def test_int8_gemm_long_k_strided_rows_threads_and_isas_agree(name, threads, monkeypatch):
    """K = 2,560 (not a power of two, 10 super-blocks), strided x rows, 97 columns (3 full
    panels + 1), two threads splitting rows for the quantisation and panels for the GEMM;
    AVX2 and AVX-512 compute the same integers, so they agree to summation order."""
    monkeypatch.setattr(kernels.ops, "_threads", lambda: threads)
    k = 2560
    t, raw, w = gguf_blocks(name, 97, k, seed=7)
    x = torch.randn(45, k + 64)[:, 32:32 + k]
    outs = []
    for isa_name in INT8_ISAS:
        kernels.int8_isa(isa_name)
        out = torch.empty(45, 97)
        kernels.gemm_int8(t, raw, k, x, out)
        assert_int8_close(out, x, w)
        outs.append(out)
    kernels.int8_isa()
    if len(outs) == 2:
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("isa8", INT8_ISAS, indirect=True)
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_int8_gemm_grouped_panel_decode_of_32_element_types(name, isa8):
    """prefill8.c decodes the 32-element types' panels 8 blocks of a row at a time where K is
    whole groups of 8 blocks (else one block at a time): for 1-17 blocks (grouped at 8 and
    16), at the decode row counts that hand over (4, 14, 32), the result is right."""
    if not kernels.supports_gemm_int8(int(GGMLQuantizationType[name])):
        pytest.skip(f"no int8 prefill GEMM for {name} on {isa8} (vpmaddubsw would saturate)")
    for blocks in (1, 7, 8, 9, 16, 17):
        k = 32 * blocks
        t, raw, w = gguf_blocks(name, 41, k, seed=blocks)          # a panel and 9 columns
        for rows in (4, 14, 32):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            grouped = torch.empty(rows, 41)
            kernels.gemm_int8(t, raw, k, x, grouped)
            assert_int8_close(grouped, x, w)


def test_int8_gemm_rejects_bad_arguments_and_types():
    t, raw, _ = gguf_blocks("Q4_K", 8, 256)
    with pytest.raises(ValueError):
        kernels.gemm_int8(t, raw, 255, torch.randn(40, 255), torch.empty(40, 8))
    with pytest.raises(ValueError):
        kernels.gemm_int8(t, raw, 256, torch.randn(40, 256), torch.empty(40, 7))
    tf, rawf, _ = gguf_blocks("F16", 8, 64)
    assert not kernels.supports_gemm_int8(tf)
    with pytest.raises(ValueError):
        kernels.gemm_int8(tf, rawf, 64, torch.randn(40, 64), torch.empty(40, 8))


@pytest.mark.parametrize("isa8", INT8_ISAS, indirect=True)
def test_activation_mode_routes_the_prefill_gemm(isa8):
    """`gemm` (what layers.Linear calls for prefill rows) runs the float panel GEMM under
    --kernel-activations float (fp32 tolerance), the int8 one under int8 and, from 33 rows,
    under auto (exactly gemm_int8's result); types without an int8 GEMM here (F16, Q2_K; Q8_0
    on AVX2) stay float in every mode."""
    for name in ("Q4_K", "Q6_K", "Q8_0", "F16", "Q2_K"):
        t, raw, w = gguf_blocks(name, 40, 512, seed=2)
        x = torch.randn(64, 512)
        ref8 = torch.empty(64, 40)
        int8 = kernels.supports_gemm_int8(t)
        if int8:
            kernels.gemm_int8(t, raw, 512, x, ref8)
        for mode in ("float", "int8", "auto"):
            kernels.set_activations(mode)
            out = torch.empty(64, 40)
            kernels.gemm(t, raw, 512, x, out)
            if int8 and mode in ("int8", "auto"):
                assert torch.equal(out, ref8), (name, mode)
            elif mode == "auto" and kernels.bf16_takes(t, 64):
                # F16 in auto on an avx512bf16 CPU: bf16 dot products (test_bf16_kernel.py)
                ref16 = torch.empty(64, 40)
                kernels.qgemm_bf16(t, raw, 512, x, ref16, path="panel")
                assert torch.equal(out, ref16), (name, mode)
            else:
                assert_fp32_close(out, x, w)
    kernels.set_activations("auto")
    t, raw, w = gguf_blocks("Q4_K", 40, 512, seed=2)
    x = torch.randn(32, 512)                  # 32 rows: not a prefill call for auto
    out = torch.empty(32, 40)
    kernels.gemm(t, raw, 512, x, out)
    assert_fp32_close(out, x, w)
    kernels.set_activations("float")


# --- the kernel build (kernels/__init__.py `_build`): files compiled in parallel ---------------

def test_parallel_build_compiles_each_file_once_under_the_lock(tmp_path, monkeypatch):
    """Two threads build the same (small) source set into an empty cache at once: the lock
    makes one of them compile each file once (object files in parallel, then one link), the
    other waits and gets the same .so; no temporary build directory is left behind, the
    library loads, and a changed source is a new key (a new build)."""
    import ctypes
    import subprocess
    import threading
    kdir = kernels.build._DIR
    # A self-contained set: both attention kernels share prefill_attention.c's ISA choice
    # (attention_core.h), which reads config.c's CPU probe.
    srcs = [kdir / "elementwise.c", kdir / "decode_attention.c", kdir / "prefill_attention.c",
            kdir / "config.c"]
    monkeypatch.setenv("ITERSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels.build, "_SOURCES", srcs)
    compiles = []
    real_run = subprocess.run

    def spy(cmd, *a, **kw):
        if "-c" in cmd:
            compiles.append(cmd[cmd.index("-c") + 1])
        return real_run(cmd, *a, **kw)
    monkeypatch.setattr(kernels.build.subprocess, "run", spy)
    got = []
    threads = [threading.Thread(target=lambda: got.append(kernels._build(kernels._compiler())))
               for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(got) == 2 and got[0] == got[1] and got[0].exists()
    assert sorted(compiles) == sorted(map(str, srcs))            # each file once
    assert not list((tmp_path / "kernels").glob(".build-*"))     # temporaries removed
    lib = ctypes.CDLL(str(got[0]))
    assert hasattr(lib, "iterserve_rmsnorm") and hasattr(lib, "iterserve_decode_attention")
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return }\n")
    monkeypatch.setattr(kernels.build, "_SOURCES", [*srcs, broken])
    with pytest.raises(RuntimeError, match="broken.c"):
        kernels._build(kernels._compiler())
    assert not list((tmp_path / "kernels").glob(".build-*"))
    assert len(list((tmp_path / "kernels").glob("iterserve-*.so"))) == 1

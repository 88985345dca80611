"""Streamed decode kernels for F16 weights (kernels/f16dot.c: AVX-512F and AVX2 + F16C).

Each f16 weight is widened exactly and multiplied in float32, so the kernels must equal
gguf-py's dequantisation times x in float64 to float32 summation error, at every row count
(1..16, and beyond when forced), on both ISAs, for weight-row counts that leave a tail after
the groups and K that is not a multiple of the kernels' 64-element step; `qgemm` must route
F16 decode steps (1..16 rows, every activation mode) through them bit for bit and leave other
row counts and types alone; and on a tiny all-F16 GGUF the fused decode layers must equal the per-module path
bit for bit and the torch fallback to float32 rounding.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from iterserve.model import kernels

F16 = 1
ISAS = ["avx2", "avx512"]

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")


def _isa_or_skip(isa: str) -> None:
    if isa == "avx512" and "avx512f" not in kernels.features():
        pytest.skip("no AVX-512F on this CPU")


def _weight(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).half()
    return w.view(torch.uint8).view(n, 2 * k)


def _gguf_dequant(wu: torch.Tensor, n: int, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    return torch.from_numpy(np.ascontiguousarray(
        dequantize(wu.numpy(), GGMLQuantizationType.F16), dtype=np.float64)).view(n, k)


def _check(out: torch.Tensor, x: torch.Tensor, wu: torch.Tensor) -> None:
    n, k = out.shape[1], x.shape[1]
    wd = _gguf_dequant(wu, n, k)
    ref = x.double() @ wd.t()
    scale = x.double().abs() @ wd.abs().t()
    # float32 sums of k exact products (f16 x f32 is exact in float64 terms up to one
    # rounding per product): |err| <= ~k * 2^-24 * sum |x w|; well inside that
    bound = 2 * k * 2.0 ** -24 * scale + 1e-30
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max().item()}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", list(range(1, 17)) + [24])
def test_every_row_count_equals_gguf_dequant_times_x(isa, m):
    """n = 77 = 3 * 24 + 5: a tail after every group size; k = 160: 2 steps of 64 + 32."""
    _isa_or_skip(isa)
    n, k = 77, 160
    wu = _weight(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 100))
    out = torch.full((m, n), float("nan"))
    kernels.qgemm_f16(wu, k, x, out, 0, isa)
    _check(out, x, wu)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (2, 3, 96), (3, 9, 32), (5, 25, 224),
                                   (8, 64, 2048), (12, 70, 352), (16, 31, 8192)])
def test_odd_shapes(isa, m, n, k):
    _isa_or_skip(isa)
    wu = _weight(n, k, seed=n)
    x = torch.randn(m, k)
    out = torch.full((m, n), float("nan"))
    kernels.qgemm_f16(wu, k, x, out, 0, isa)
    _check(out, x, wu)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 11])
def test_strided_activations_and_a_column_offset(isa, m):
    _isa_or_skip(isa)
    n, k = 45, 192
    wu = _weight(n, k)
    big = torch.randn(m, k + 40)
    x = big[:, 8:8 + k]                                   # row stride k + 40
    out = torch.full((m, n + 20), -7.0)
    kernels.qgemm_f16(wu, k, x, out, 13, isa)
    _check(out[:, 13:13 + n], x.contiguous(), wu)
    assert (out[:, :13] == -7).all() and (out[:, 13 + n:] == -7).all()


@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_two_threads_split_the_weight_rows_without_changing_a_sum(m):
    n, k = 301, 2048
    wu = _weight(n, k)
    x = torch.randn(m, k)
    outs, old = [], torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.full((m, n), float("nan"))
            kernels.qgemm_f16(wu, k, x, out)
            outs.append(out)
    finally:
        torch.set_num_threads(old)
    _check(outs[1], x, wu)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("isa", ISAS)
def test_qgemm_routes_f16_decode_steps_through_the_streamed_kernel_in_every_mode(isa):
    _isa_or_skip(isa)
    n, k = 50, 256
    wu = _weight(n, k)
    try:
        assert kernels.gemm_isa(isa) == isa
        for m in (1, 2, 8, 16, 17, 40):
            x = torch.randn(m, k)
            direct = torch.empty(m, n)
            kernels.qgemm_f16(wu, k, x, direct)
            for mode in ("float", "auto", "int8"):
                kernels.set_activations(mode)
                # up to 16 rows, but where auto runs F16 on the bf16 panel (avx512bf16 CPUs,
                # from 16 rows: bf16dot.c) that one keeps the call
                takes = m <= 16 and not kernels.bf16_takes(F16, m)
                assert kernels.f16_takes(m) == takes
                assert takes or m >= 16
                got = torch.empty(m, n)
                kernels.qgemm(F16, wu, k, x, got)
                if takes:
                    assert torch.equal(got, direct), (m, mode)    # the same kernel
                else:
                    tol = 2.0 ** -8 if mode == "auto" and kernels.bf16_takes(F16, m) else 1e-5
                    scale = x.abs().double() @ _gguf_dequant(wu, n, k).abs().t()
                    ref = x.double() @ _gguf_dequant(wu, n, k).t()
                    assert ((got.double() - ref).abs() <= tol * scale + 1e-6).all()
    finally:
        kernels.set_activations("float")
        kernels.gemm_isa()


def test_bad_arguments_raise():
    wu = _weight(8, 64)
    x, out = torch.randn(2, 64), torch.empty(2, 8)
    with pytest.raises(ValueError):
        kernels.qgemm_f16(wu, 64, torch.randn(2, 32), out)
    with pytest.raises(ValueError):
        kernels.qgemm_f16(wu, 64, x, torch.empty(2, 4))
    with pytest.raises(KeyError):
        kernels.qgemm_f16(wu, 64, x, out, 0, "sideways")


# --- a tiny all-F16 GGUF: fused == per-module, and against the torch fallback --------------

ALL_F16 = {name: "F16" for name in ("attn_q.weight", "attn_k.weight", "attn_v.weight",
                                    "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
                                    "ffn_down.weight", "output.weight", "token_embd.weight")}


@pytest.fixture(scope="module")
def f16_gguf(tmp_path_factory):
    from fixtures.tiny_gguf import write_tiny_llama_gguf
    path = tmp_path_factory.mktemp("f16") / "allf16.gguf"
    write_tiny_llama_gguf(path, seed=7, tensor_types=ALL_F16)
    return path


def _run(path, fused: bool, native: bool = True, decode_steps: int = 6):
    """Prefill three prompts, then decode all three: logits of every step, fused calls."""
    from fixtures.tiny_models import Blocks, advance, chunk, greedy, request, step
    from iterserve.model.loader import load_model
    from iterserve.model.runner import ModelRunner
    loaded = load_model(str(path))
    seen = []

    def sampler(logits, requests):
        seen.append(logits.clone())
        return greedy(logits, requests)

    runner = ModelRunner(loaded, num_blocks=48, block_size=4, sampler=sampler,
                         native_kernels=native)
    calls = []
    if native:
        assert runner.fused_decode
        if not fused:
            assert not loaded.model.use_fused_decode(False)
        inner = loaded.model._decode_layers
        loaded.model._decode_layers = lambda *a: (calls.append(a[0].shape[0]), inner(*a))[1]
    blocks = Blocks(48, 4)
    reqs = [request("a", list(range(5, 30))), request("b", list(range(40, 47))),
            request("c", [3, 1, 4])]
    out = step(*(chunk(blocks, r) for r in reqs))
    advance(out, runner.execute(out))
    for s in range(decode_steps):
        out = step(*(chunk(blocks, r, 1) for r in reqs), step_no=1 + s)
        advance(out, runner.execute(out))
    return seen, calls, [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("mode", ["auto", "float"])
def test_all_f16_gguf_fused_equals_per_module_and_the_torch_path(f16_gguf, mode):
    kernels.set_activations(mode)
    try:
        assert kernels.f16_takes(3)
        on, calls_on, tok_on = _run(f16_gguf, True)
        off, calls_off, tok_off = _run(f16_gguf, False)
        assert calls_on == [3] * 6 and calls_off == []
        assert tok_on == tok_off
        for a, b in zip(on, off):
            assert torch.equal(a, b)
        ref, _, tok_ref = _run(f16_gguf, True, native=False)
        assert tok_ref == tok_on
        for a, b in zip(on, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    finally:
        kernels.set_activations("float")

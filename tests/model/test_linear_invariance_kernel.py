"""Batch invariance of the linear kernels (kernels.KernelConfig.batch_invariant, dispatch.c).

With the configuration's batch_invariant on, a row's output must be bit for bit the same
whatever else the call holds: the row alone, inside decode batches of 1..N rows, inside
prefill-sized calls past every hand-over row count, through `qgemm` (decode) and `gemm`
(prefill) alike, for every GGUF type with a native kernel, both activation modes and the
float types; across the two ISAs of a CPU that has AVX-512 (the kernels keep lanes =
output columns, so AVX2 and AVX-512 agree); and through the fused decode layers against
the per-module path. The results must stay right (the torch reference within the modes'
tolerances).
"""

from __future__ import annotations

import pytest
import torch

from fixtures.gguf_blocks import gguf_blocks
from iterserve.model import kernels

pytestmark = pytest.mark.skipif(not (kernels._cpu_has_avx2_fma() and kernels._compiler()),
                                reason="needs an x86-64 AVX2/FMA CPU and a C compiler")

INT8_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
FLOAT_ONLY = ["F32", "F16", "BF16", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"]
ROWS = [1, 2, 3, 5, 8, 12, 16, 17, 24, 32, 33, 48, 64]     # decode tiles, hand-overs, prefill


@pytest.fixture
def invariant():
    kernels.set_batch_invariant(True)
    yield
    kernels.set_batch_invariant(False)
    kernels.set_activations("float")


def _k(name: str) -> int:
    return 768 if name.endswith("_K") or name.startswith("IQ4_XS") else 576


def _alone_and_in_batches(name: str, mode: str, seed: int = 0):
    """(row 0 alone, row 0 of every batch) through qgemm and gemm, and the reference."""
    k, n = _k(name), 45
    t, w, ref = gguf_blocks(name, n, k, seed=seed)
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(max(ROWS), k, generator=g) * 0.7
    kernels.set_activations(mode)
    alone = torch.empty(1, n)
    kernels.qgemm(t, w, k, big[:1].clone(), alone)
    outs = []
    for m in ROWS:
        x = torch.cat([big[:1], torch.randn(m - 1, k, generator=g)]) if m > 1 else big[:1]
        for fn in (kernels.qgemm, kernels.gemm):
            if fn is kernels.qgemm and m > 32:
                continue
            y = torch.empty(m, n)
            fn(t, w, k, x.contiguous(), y)
            outs.append((m, fn.__name__, y[0].clone()))
    return alone[0], outs, big[0].double() @ ref.double().T, ref


@pytest.mark.parametrize("mode", ["int8", "auto"])
@pytest.mark.parametrize("name", INT8_TYPES)
def test_int8_kernels_give_a_row_the_same_bits_in_any_batch(name, mode, invariant):
    alone, outs, exact, ref = _alone_and_in_batches(name, mode, seed=INT8_TYPES.index(name))
    for m, fn, y in outs:
        assert torch.equal(y, alone), (m, fn)
    # still the int8 scheme's accuracy: ~1% of sum |x w| at most
    scale = ref.abs().double().sum(1).max()
    assert ((alone.double() - exact).abs() <= 0.01 * scale).all()


@pytest.mark.parametrize("name", INT8_TYPES + FLOAT_ONLY)
def test_float_mode_gives_a_row_the_same_bits_in_any_batch(name, invariant):
    alone, outs, exact, ref = _alone_and_in_batches(name, "float", seed=3)
    for m, fn, y in outs:
        assert torch.equal(y, alone), (m, fn)
    torch.testing.assert_close(alone.double(), exact, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_auto_mode_float_types_give_a_row_the_same_bits_in_any_batch(name, invariant):
    alone, outs, exact, ref = _alone_and_in_batches(name, "auto", seed=5)
    for m, fn, y in outs:
        assert torch.equal(y, alone), (m, fn)


def test_threads_split_outputs_not_k(invariant, monkeypatch):
    """One and two threads (threads split columns): the same bits."""
    for name in ("Q4_K", "Q4_0", "F16"):
        k, n = _k(name), 203
        t, w, _ = gguf_blocks(name, n, k, seed=9)
        x = torch.randn(20, k)
        outs = []
        for mode in ("auto", "float"):
            kernels.set_activations(mode)
            for threads in (1, 2):
                monkeypatch.setattr(kernels.ops, "_threads", lambda threads=threads: threads)
                y = torch.empty(20, n)
                kernels.qgemm(t, w, k, x, y)
                outs.append((mode, y))
        assert torch.equal(outs[0][1], outs[1][1]) and torch.equal(outs[2][1], outs[3][1])


def test_avx2_and_avx512_agree_bit_for_bit(invariant):
    """Where the CPU has AVX-512 the kernels of both ISAs keep lanes = output columns, so the
    same call gives the same bits (this catches an AVX-512 path that breaks the order)."""
    if not {"avx512f", "avx512bw", "avx512vl"} <= kernels.features():
        pytest.skip("the CPU has no AVX-512")
    try:
        for name in INT8_TYPES + ["F16", "F32", "Q3_K"]:
            k = _k(name)
            t, w, _ = gguf_blocks(name, 45, k, seed=2)
            for mode in ("auto", "float"):
                kernels.set_activations(mode)
                for m in (1, 7, 40):
                    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                    got = []
                    for isa in ("avx2", None):
                        kernels.gemm_isa(isa)
                        y = torch.empty(m, 45)
                        (kernels.qgemm if m <= 32 else kernels.gemm)(t, w, k, x, y)
                        got.append(y)
                    assert torch.equal(got[0], got[1]), (name, mode, m)
    finally:
        kernels.gemm_isa(None)


def test_default_routing_is_unchanged_without_the_flag():
    """Off (the default) the table keeps its measured kernels."""
    kernels.set_activations("auto")
    try:
        assert kernels.route(12, 1) != "dec8" and kernels.route(12, 1) == "int8"
        kernels.set_batch_invariant(True)
        assert kernels.route(12, 1) == "dec8" and kernels.route(1, 4) == "panel"
    finally:
        kernels.set_batch_invariant(False)
        kernels.set_activations("float")


def test_fused_decode_layers_equal_the_per_module_path_and_a_row_is_batch_invariant(tmp_path):
    """On a tiny all-quantised GGUF, batch_invariant on: the fused decode layers equal the
    per-module path bit for bit at every batch size, and sequence 0's logits at each step are
    the same whether it decodes alone or beside 1..7 others."""
    from fixtures.tiny_gguf import load_all_quant_model
    from fixtures.tiny_models import greedy_steps
    loaded = load_all_quant_model(tmp_path / "allquant.gguf", seed=7)
    kernels.set_batch_invariant(True)
    try:
        prompts = [[3 + i, 7, 11 + i, 5] for i in range(8)]
        solo = greedy_steps(loaded, prompts[:1], "auto", True, 4, num_blocks=80, block_size=4)[1]
        for b in (1, 3, 8):
            fused = greedy_steps(loaded, prompts[:b], "auto", True, 4, num_blocks=80,
                                 block_size=4)[1]
            plain = greedy_steps(loaded, prompts[:b], "auto", False, 4, num_blocks=80,
                                 block_size=4)[1]
            for f, p, s in zip(fused, plain, solo):
                assert torch.equal(f, p)
                assert torch.equal(f[0], s[0]), b
    finally:
        kernels.set_batch_invariant(False)
        kernels.set_activations("float")

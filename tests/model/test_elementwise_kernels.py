"""The native elementwise kernels (kernels/elementwise.c) against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from iterserve.model import kernels
from iterserve.model.layers import RMSNorm

pytestmark = pytest.mark.skipif(not (kernels._cpu_has_avx2_fma() and kernels._compiler()),
                                reason="needs an x86-64 AVX2/FMA CPU and a C compiler")


@pytest.mark.parametrize("rows, dim", [(1, 576), (7, 64), (3, 37), (256, 96)])
def test_rmsnorm_equals_the_torch_path(rows, dim):
    lib = kernels.elementwise()
    assert lib is not None, kernels.unavailable
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    x = torch.randn(rows, dim) * 3
    ref = norm(x)                                   # torch ops (no _native set)
    norm._native = lib.iterserve_rmsnorm
    torch.testing.assert_close(norm(x), ref, rtol=1e-5, atol=1e-6)
    # a non-contiguous view falls back to torch ops rather than reading the wrong memory
    view = torch.randn(rows, 2 * dim)[:, :dim]
    native = norm(view)
    norm._native = None
    torch.testing.assert_close(native, norm(view))


@pytest.mark.parametrize("rows, inter", [(1, 1536), (5, 12), (9, 64)])
def test_silu_mul_equals_torch_including_extreme_inputs(rows, inter):
    lib = kernels.elementwise()
    gu = torch.randn(rows, 2 * inter) * 4
    gu[0, :4] = torch.tensor([-100.0, 100.0, -1e4, 1e4])[: min(4, inter)]
    y = torch.empty(rows, inter)
    lib.iterserve_silu_mul(gu.data_ptr(), y.data_ptr(), rows, inter)
    gate, up = gu.split([inter, inter], dim=-1)
    torch.testing.assert_close(y, F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("d", [64, 16, 6])
def test_rope_in_place_equals_apply_rope_on_a_strided_qkv_buffer(d):
    from iterserve.model.layers import apply_rope
    lib = kernels.elementwise()
    T, heads, extra = 5, 4, 3 * d                  # rows also hold v (and more) after q/k
    qkv = torch.randn(T, heads * d + extra)
    cos, sin = torch.randn(T, 1, d), torch.randn(T, 1, d)
    ref = apply_rope(qkv[:, :heads * d].view(T, heads, d), cos, sin)
    untouched = qkv[:, heads * d:].clone()
    lib.iterserve_rope(qkv.data_ptr(), T, qkv.shape[1], heads, d, cos.data_ptr(), sin.data_ptr())
    torch.testing.assert_close(qkv[:, :heads * d].view(T, heads, d), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, heads * d:], untouched)

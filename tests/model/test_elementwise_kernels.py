"""The native elementwise kernels (kernels/elementwise.c) against the torch ops they replace,
through their checked wrappers (bad tensors raise ValueError, never reach the C code)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from iterserve.model import kernels
from iterserve.model.layers import RMSNorm

pytestmark = pytest.mark.skipif(not (kernels._cpu_has_avx2_fma() and kernels._compiler()),
                                reason="needs an x86-64 AVX2/FMA/F16C CPU and a C compiler")


@pytest.mark.parametrize("rows, dim", [(1, 576), (7, 64), (3, 37), (256, 96)])
def test_rmsnorm_equals_the_torch_path(rows, dim):
    assert kernels.available(), kernels.unavailable
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    x = torch.randn(rows, dim) * 3
    ref = norm(x)                                   # torch ops (no _native set)
    norm._native = kernels.rmsnorm
    torch.testing.assert_close(norm(x), ref, rtol=1e-5, atol=1e-6)
    # a non-contiguous view falls back to torch ops rather than reading the wrong memory
    view = torch.randn(rows, 2 * dim)[:, :dim]
    native = norm(view)
    norm._native = None
    torch.testing.assert_close(native, norm(view))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.rmsnorm(torch.randn(2, 2 * dim)[:, :dim], norm.weight.detach(), 1e-5,
                        torch.empty(2, dim))
    with pytest.raises(ValueError):
        kernels.rmsnorm(x, torch.ones(dim + 1), 1e-5, torch.empty_like(x))


@pytest.mark.parametrize("rows, inter", [(1, 1536), (5, 12), (9, 64)])
def test_silu_mul_equals_torch_including_extreme_inputs(rows, inter):
    gu = torch.randn(rows, 2 * inter) * 4
    gu[0, :4] = torch.tensor([-100.0, 100.0, -1e4, 1e4])[: min(4, inter)]
    y = kernels.silu_mul(gu, torch.empty(rows, inter))
    gate, up = gu.split([inter, inter], dim=-1)
    torch.testing.assert_close(y, F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(y).all()
    with pytest.raises(ValueError):
        kernels.silu_mul(gu, torch.empty(rows, inter + 1))
    with pytest.raises(ValueError, match="float32"):
        kernels.silu_mul(gu.double(), torch.empty(rows, inter))


@pytest.mark.parametrize("d", [64, 16, 6])
def test_rope_in_place_equals_apply_rope_on_a_strided_qkv_buffer(d):
    from iterserve.model.layers import apply_rope
    T, heads, extra = 5, 4, 3 * d                  # rows also hold v (and more) after q/k
    qkv = torch.randn(T, heads * d + extra)
    cos, sin = torch.randn(T, 1, d), torch.randn(T, 1, d)
    ref = apply_rope(qkv[:, :heads * d].view(T, heads, d), cos, sin)
    untouched = qkv[:, heads * d:].clone()
    kernels.rope(qkv, heads, d, cos, sin)
    torch.testing.assert_close(qkv[:, :heads * d].view(T, heads, d), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, heads * d:], untouched)
    with pytest.raises(ValueError):
        kernels.rope(qkv, heads + 4, d, cos, sin)              # more heads than the row holds
    with pytest.raises(ValueError):
        kernels.rope(qkv, heads, d, cos[:-1], sin[:-1])         # cos/sin for fewer rows


def test_qk_norm_in_place_equals_rmsnorm_per_head():
    T, H, kvh, d = 3, 4, 2, 16
    qkv = torch.randn(T, (H + 2 * kvh) * d)
    qw, kw = torch.randn(d), torch.randn(d)
    q_ref, k_ref = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    with torch.no_grad():
        q_ref.weight.copy_(qw)
        k_ref.weight.copy_(kw)
    q = q_ref(qkv[:, :H * d].reshape(T, H, d))
    k = k_ref(qkv[:, H * d:(H + kvh) * d].reshape(T, kvh, d))
    v = qkv[:, (H + kvh) * d:].clone()
    kernels.qk_norm(qkv, H, kvh, d, qw, kw, 1e-6)
    torch.testing.assert_close(qkv[:, :H * d].view(T, H, d), q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(qkv[:, H * d:(H + kvh) * d].view(T, kvh, d), k, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkv[:, (H + kvh) * d:], v)

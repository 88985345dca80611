"""Attention sinks (gpt-oss: one learned logit per query head in every softmax, a key with a
zero value) on the native kernels: decode and prefill-chunk attention against a reference
softmax with the sink column, both vector builds, float32 / f16 / bf16 pools, sliding
windows; a row's bits the same as a decode and inside a chunk; paged_attention with sinks
equal to the eager path it replaces on a step of decodes and chunks."""

from __future__ import annotations

import random

import pytest
import torch

from iterserve.model import kernels
from iterserve.model.attention import build_metadata, native_step, paged_attention
from iterserve.model.attention_eager import eager_paged_attention

pytestmark = pytest.mark.skipif(not (kernels._cpu_has_avx2_fma() and kernels._compiler()),
                                reason="needs an x86-64 AVX2/FMA CPU and a C compiler")


def _reference(q, pk, pv, start, n, table, bs, window, scale, kvh, d, sinks):
    """softmax([q.k * scale, sink]) without the sink column, times V (HF gpt-oss's order)."""
    total = start + n
    H = q.shape[1]
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(total)])
    kc = pk.index_select(0, slots).double().view(total, kvh, d).repeat_interleave(H // kvh, 1)
    vc = pv.index_select(0, slots).double().view(total, kvh, d).repeat_interleave(H // kvh, 1)
    scores = torch.einsum("chd,lhd->hcl", q.double(), kc) * scale
    qp, kp = torch.arange(start, total)[:, None], torch.arange(total)[None, :]
    allowed = kp <= qp
    if window:
        allowed &= (qp - kp) < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    scores = torch.cat([scores, sinks.double()[:, None, None].expand(H, n, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :-1]
    return torch.einsum("hcl,lhd->chd", probs, vc).float()


def _pools(H, kvh, d, dtype, bs, nblocks, seed):
    g = torch.Generator().manual_seed(seed)
    pk = torch.randn(nblocks * bs, kvh * d, generator=g).to(dtype)
    pv = torch.randn(nblocks * bs, kvh * d, generator=g).to(dtype)
    # sinks from far below the scores (no effect) to far above them (most of the mass)
    sinks = torch.linspace(-30.0, 6.0, H)[torch.randperm(H, generator=g)].contiguous()
    return g, pk, pv, sinks


@pytest.mark.parametrize("H, kvh, d, isa", [(8, 2, 64, "avx2"), (6, 6, 16, "avx2"),
                                            (8, 2, 64, "avx512"), (4, 1, 48, "avx512")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 7])
def test_prefill_chunks_with_sinks_equal_the_reference(H, kvh, d, isa, dtype, window):
    if isa == "avx512" and kernels.prefill_attention_isa(16, "avx512") != "avx512":
        pytest.skip("no AVX-512 F/BW/VL on this CPU")
    assert kernels.prefill_attention_isa(d, isa) == isa
    bs, nblocks = 16, 60
    g, pk, pv, sinks = _pools(H, kvh, d, dtype, bs, nblocks, seed=H + d)
    chunks = [(0, 5), (130, 37), (3, 1), (200, 70)]    # with and without context, > a tile
    free = list(range(nblocks))
    random.Random(d).shuffle(free)
    tables = [[free.pop() for _ in range((s + n + bs - 1) // bs)] for s, n in chunks]
    q_starts = [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    q = torch.randn(sum(n for _, n in chunks), H, d, generator=g)
    mb = max(map(len, tables))
    i32 = dict(dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    kernels.prefill_attention(q, pk, pv, torch.tensor(q_starts, **i32),
                              torch.tensor([s for s, _ in chunks], **i32),
                              torch.tensor([n for _, n in chunks], **i32),
                              torch.tensor([t + [0] * (mb - len(t)) for t in tables], **i32),
                              window, bs, d ** -0.5, out, isa=isa, sinks=sinks)
    for (start, n), table, r in zip(chunks, tables, q_starts):
        ref = _reference(q[r:r + n], pk, pv, start, n, table, bs, window, d ** -0.5, kvh, d,
                         sinks)
        torch.testing.assert_close(out[r:r + n], ref, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [0, 100])
def test_decodes_with_sinks_equal_the_reference_and_their_rows_inside_a_chunk(dtype, window):
    """Decodes of several lengths (one segment, several segments, a window) against the
    reference; each decode row bit for bit the same position computed as the last row of
    a prefill chunk over the same context (the batch-invariance rule, sinks included)."""
    H, kvh, d, bs, nblocks = 8, 2, 64, 16, 80
    g, pk, pv, sinks = _pools(H, kvh, d, dtype, bs, nblocks, seed=5)
    lens = [1, 40, 129, 300, 517]
    free = list(range(nblocks))
    random.Random(1).shuffle(free)
    tables = [[free.pop() for _ in range((n + bs - 1) // bs)] for n in lens]
    mb = max(map(len, tables))
    i32 = dict(dtype=torch.int32)
    t = torch.tensor([tb + [0] * (mb - len(tb)) for tb in tables], **i32)
    q = torch.randn(len(lens), H, d, generator=g)
    fn = kernels.decode_attention()
    assert fn is not None, kernels.unavailable
    out = fn(q, pk, pv, t, torch.tensor(lens, **i32), window, bs, d ** -0.5,
             torch.empty_like(q), sinks)
    plain = fn(q, pk, pv, t, torch.tensor(lens, **i32), window, bs, d ** -0.5,
               torch.empty_like(q))
    assert not torch.equal(out, plain)                       # the sinks took some mass
    for i, n in enumerate(lens):
        ref = _reference(q[i:i + 1], pk, pv, n - 1, 1, tables[i], bs, window, d ** -0.5,
                         kvh, d, sinks)
        torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-5, atol=2e-5)
        # the same query as the last row of a chunk of 3 ending at the same position
        c = min(3, n)
        qc = torch.randn(c, H, d, generator=g)
        qc[-1] = q[i]
        oc = torch.empty_like(qc)
        kernels.prefill_attention(qc, pk, pv, torch.tensor([0], **i32),
                                  torch.tensor([n - c], **i32), torch.tensor([c], **i32),
                                  t[i:i + 1].contiguous(), window, bs, d ** -0.5, oc,
                                  sinks=sinks)
        assert torch.equal(oc[-1], out[i]), f"decode of length {n}"


def test_sinks_are_checked():
    H, kvh, d, bs = 4, 2, 16, 4
    q = torch.randn(1, H, d)
    pk = pv = torch.randn(8 * bs, kvh * d)
    args = (torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
            0, bs, 0.25, torch.empty_like(q))
    for bad in (torch.zeros(H + 1), torch.zeros(H, dtype=torch.float64), torch.zeros(2 * H)[::2]):
        with pytest.raises(ValueError, match="sinks"):
            kernels.decode_attention(q, pk, pv, *args, bad)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("pool", [torch.float32, torch.float16])
def test_paged_attention_with_sinks_equals_the_eager_path(window, pool):
    """A step of decodes, a chunk on a cached prefix and a first chunk: the native kernels
    with sinks against attention_eager's explicit scores (what gpt-oss layers ran before)."""
    d, kvh, H, bs = 16, 2, 6, 4
    g = torch.Generator().manual_seed(3)
    free = list(range(200))
    random.Random(3).shuffle(free)
    shapes = [(9, 1), (30, 1), (0, 11), (17, 6), (40, 23)]
    seqs = [(s, n, [free.pop() for _ in range((s + n + bs - 1) // bs)]) for s, n in shapes]
    T = sum(n for _, n in shapes)
    pk = torch.randn(200 * bs, kvh * d, generator=g).to(pool)
    pv = torch.randn(200 * bs, kvh * d, generator=g).to(pool)
    q, k, v = (torch.randn(T, h, d, generator=g) for h in (H, kvh, kvh))
    sinks = torch.randn(H, generator=g) * 2
    meta = build_metadata(seqs, bs, window, torch.device("cpu"), torch.float32,
                          decode_kernel=kernels.decode_attention())
    assert native_step(meta)
    pools = [(pk.clone(), pv.clone()) for _ in range(2)]
    native = paged_attention(q, k, v, *pools[0], meta, d ** -0.5, sinks=sinks)
    eager = eager_paged_attention(q, k, v, *pools[1], meta, d ** -0.5, None, sinks)
    torch.testing.assert_close(native, eager, rtol=1e-5, atol=1e-5)
    torch_meta = build_metadata(seqs, bs, window, torch.device("cpu"), torch.float32)
    assert not native_step(torch_meta)
    with pytest.raises(ValueError, match="native kernels"):
        paged_attention(q, k, v, *pools[0], torch_meta, d ** -0.5, sinks=sinks)

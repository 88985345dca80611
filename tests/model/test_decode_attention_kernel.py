"""The native decode attention (kernels/decode_attention.c) against the torch path it replaces:
same outputs for unpadded mixed context lengths, shuffled block tables, grouped-query heads,
sliding windows, and decodes mixed with a prefill chunk in one step."""

from __future__ import annotations

import random

import pytest
import torch

from iterserve.model import kernels
from iterserve.model.attention import build_metadata, paged_attention

pytestmark = pytest.mark.skipif(not (kernels._cpu_has_avx2_fma() and kernels._compiler()),
                                reason="needs an x86-64 AVX2/FMA CPU and a C compiler")


def _case(lens, prefill, d, kvh, heads, bs=4, num_blocks=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    seqs = []
    for n in lens:                                  # decodes: context n, the new token at n-1
        table = [free.pop() for _ in range((n + bs - 1) // bs)]
        seqs.append((n - 1, 1, table))
    if prefill:
        start, n = prefill
        seqs.append((start, n, [free.pop() for _ in range((start + n + bs - 1) // bs)]))
    T = len(lens) + (prefill[1] if prefill else 0)
    pool_k = torch.randn(num_blocks * bs, kvh * d, generator=g)
    pool_v = torch.randn(num_blocks * bs, kvh * d, generator=g)
    q = torch.randn(T, heads, d, generator=g)
    k = torch.randn(T, kvh, d, generator=g)
    v = torch.randn(T, kvh, d, generator=g)
    return seqs, pool_k, pool_v, q, k, v


@pytest.mark.parametrize("d, kvh, heads", [(16, 2, 6), (64, 3, 9), (8, 1, 1), (32, 4, 4)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("prefill", [None, (6, 7)])
def test_native_decode_attention_equals_the_torch_path(d, kvh, heads, window, prefill):
    fn = kernels.decode_attention()
    assert fn is not None, kernels.unavailable
    lens = [1, 3, 17, 40, 9, 8]
    seqs, pk, pv, q, k, v = _case(lens, prefill, d, kvh, heads, seed=d + heads)
    scale = d ** -0.5
    outs = []
    for kernel in (fn, None):
        meta = build_metadata(seqs, 4, window, torch.device("cpu"), torch.float32,
                              decode_kernel=kernel)
        assert (meta.decode_kernel is None) == (kernel is None)
        outs.append(paged_attention(q, k, v, pk.clone(), pv.clone(), meta, scale))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_long_contexts_and_many_sequences():
    fn = kernels.decode_attention()
    lens = [random.Random(i).randint(1, 700) for i in range(20)]
    seqs, pk, pv, q, k, v = _case(lens, None, 64, 3, 9, bs=16, num_blocks=1024, seed=7)
    outs = [paged_attention(q, k, v, pk.clone(), pv.clone(),
                            build_metadata(seqs, 16, None, torch.device("cpu"), torch.float32,
                                           decode_kernel=kern), 0.125)
            for kern in (fn, None)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("lens", [[700], [1000, 5], [129, 257, 3]])
def test_long_contexts_split_into_runs_merge_to_the_same_result(lens, window):
    """Few sequences with long contexts are split into runs of positions (flash-decoding),
    each with its own softmax max and sum, merged at the end: the merge must be exact."""
    fn = kernels.decode_attention()
    seqs, pk, pv, q, k, v = _case(lens, None, 64, 3, 9, bs=16, num_blocks=160, seed=len(lens))
    outs = [paged_attention(q, k, v, pk.clone(), pv.clone(),
                            build_metadata(seqs, 16, window, torch.device("cpu"), torch.float32,
                                           decode_kernel=kern), 0.125)
            for kern in (fn, None)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d, kvh, heads", [(64, 3, 9), (16, 2, 6), (64, 32, 32)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("lens", [[1, 3, 17, 40, 9, 8], [700, 2]])
def test_f16_pools_read_the_same_values_as_float32_pools_holding_them(d, kvh, heads, window,
                                                                      lens):
    """--kv-cache-dtype float16: the kernel widens each f16 K/V element (F16C) and runs the
    float32 arithmetic unchanged, so it equals the float32 kernel over the same rounded values
    bit for bit, and the torch path over the f16 pool to float32 rounding."""
    fn = kernels.decode_attention()
    seqs, pk, pv, q, k, v = _case(lens, None, d, kvh, heads, bs=16, num_blocks=96, seed=d)
    pk16, pv16 = pk.half(), pv.half()
    k, v = k.half().float(), v.half().float()     # the new rows too: exact in either pool
    outs = {}
    for name, kp, vp, kern in (("f16", pk16, pv16, fn), ("f32", pk16.float(), pv16.float(), fn),
                               ("torch", pk16, pv16, None)):
        meta = build_metadata(seqs, 16, window, torch.device("cpu"), torch.float32,
                              decode_kernel=kern)
        outs[name] = paged_attention(q, k, v, kp.clone(), vp.clone(), meta, d ** -0.5)
    assert torch.equal(outs["f16"], outs["f32"])
    torch.testing.assert_close(outs["f16"], outs["torch"], rtol=1e-5, atol=1e-5)


def test_pools_of_two_dtypes_or_bf16_are_refused():
    seqs, pk, pv, q, k, v = _case([3, 5], None, 16, 2, 4)
    meta = build_metadata(seqs, 4, None, torch.device("cpu"), torch.float32,
                          decode_kernel=kernels.decode_attention())
    args = (meta.decode_tables, meta.decode_lens, 0, 4, 0.25, torch.empty(2, 4, 16))
    with pytest.raises(ValueError, match="kpool is torch.float16, vpool"):
        kernels.decode_attention(q[:2].contiguous(), pk.half(), pv, *args)
    with pytest.raises(ValueError, match="float32 or float16"):
        kernels.decode_attention(q[:2].contiguous(), pk.bfloat16(), pv.bfloat16(), *args)


def _verify_rows(ctx, k, bs, seed, distinct_tables=False):
    """A request verifying k drafts: k + 1 decode rows at positions ctx-1 .. ctx-1+k, all
    over one block table (or, with `distinct_tables`, each over a table of its own holding
    the same K/V: rows that look alike but are not one context)."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = (ctx + k + bs - 1) // bs
    num_blocks = n_blocks * (k + 1) + 8
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    table = [free.pop() for _ in range(n_blocks)]
    pk = torch.randn(num_blocks * bs, 3 * 64, generator=g)
    pv = torch.randn(num_blocks * bs, 3 * 64, generator=g)
    tables = [list(table) for _ in range(k + 1)]
    if distinct_tables:
        for i in range(1, k + 1):                    # a copy of the blocks, elsewhere
            tables[i] = [free.pop() for _ in range(n_blocks)]
            for a, b in zip(table, tables[i]):
                pk[b * bs:(b + 1) * bs] = pk[a * bs:(a + 1) * bs]
                pv[b * bs:(b + 1) * bs] = pv[a * bs:(a + 1) * bs]
    width = max(len(t) for t in tables)
    t = torch.tensor([row + [0] * (width - len(row)) for row in tables], dtype=torch.int32)
    lens = torch.tensor([ctx + i for i in range(k + 1)], dtype=torch.int32)
    q = torch.randn(k + 1, 9, 64, generator=g)
    return q, pk, pv, t, lens


@pytest.mark.parametrize("ctx, k", [(1, 4), (60, 8), (127, 3), (300, 16), (700, 5), (64, 1)])
@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("pool", ["f32", "f16"])
@pytest.mark.parametrize("distinct", [False, True])
def test_rows_of_one_context_in_one_call_equal_each_row_alone(ctx, k, window, pool, distinct):
    """Speculative verification sends a request's last token and its k drafts as k + 1
    consecutive decode rows; the kernel walks their context once for all of them. Each row
    must equal the same row computed alone bit for bit (the one-order rule), across segment
    and block edges, with a sliding window, beside other sequences, and also when the rows'
    tables differ (then they are not grouped, and still equal)."""
    fn = kernels.decode_attention()
    assert fn is not None, kernels.unavailable
    bs = 16
    q, pk, pv, tables, lens = _verify_rows(ctx, k, bs, seed=ctx + k, distinct_tables=distinct)
    if pool == "f16":
        pk, pv = pk.half(), pv.half()
    # another sequence on each side, so the group sits inside a batch
    other = _verify_rows(50, 0, bs, seed=3)
    off = pk.shape[0] // bs
    pk2, pv2 = torch.cat([pk, other[1].to(pk.dtype)]), torch.cat([pv, other[2].to(pv.dtype)])
    width = max(tables.shape[1], other[3].shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))
    all_q = torch.cat([other[0], q, other[0]])
    all_t = torch.cat([pad(other[3] + off), pad(tables), pad(other[3] + off)]).contiguous()
    all_l = torch.cat([other[4], lens, other[4]])
    together = fn(all_q.contiguous(), pk2, pv2, all_t, all_l, window, bs, 0.125,
                  torch.empty_like(all_q))
    for i in range(all_q.shape[0]):
        alone = fn(all_q[i:i + 1].contiguous(), pk2, pv2, all_t[i:i + 1].contiguous(),
                   all_l[i:i + 1].contiguous(), window, bs, 0.125,
                   torch.empty_like(all_q[i:i + 1]))
        assert torch.equal(together[i], alone[0]), f"row {i}"

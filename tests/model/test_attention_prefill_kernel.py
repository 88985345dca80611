"""The native prefill attention (kernels/prefill_attention.c) against the torch path it
replaces and against HF transformers: several chunks with and without cached context in one
call, shuffled block tables, grouped-query heads, sliding windows, float32 / f16 / bf16
pools, both vector builds (AVX2 and AVX-512), bad indices refused, and the engine's tokens
with chunked prefill, a prefix-cache hit and recompute preemption unchanged."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from iterserve.model import attention, kernels
from iterserve.model.attention import build_metadata, paged_attention

pytestmark = pytest.mark.skipif(not (kernels._cpu_has_avx2_fma() and kernels._compiler()),
                                reason="needs an x86-64 AVX2/FMA CPU and a C compiler")


def _reference(q, pk, pv, start, n, table, bs, window, scale, kvh, d):
    """Plain SDPA over the gathered context with a boolean causal (+ window) mask."""
    total = start + n
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(total)])
    kc = pk.index_select(0, slots).float().view(total, kvh, d).transpose(0, 1).unsqueeze(0)
    vc = pv.index_select(0, slots).float().view(total, kvh, d).transpose(0, 1).unsqueeze(0)
    qp, kp = torch.arange(start, total)[:, None], torch.arange(total)[None, :]
    allowed = kp <= qp
    if window:
        allowed &= (qp - kp) < window
    return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kc, vc,
                                          attn_mask=allowed, scale=scale,
                                          enable_gqa=True).squeeze(0).transpose(0, 1)


def _chunks_case(chunks, H, kvh, d, dtype, bs, num_blocks=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    pk = torch.randn(num_blocks * bs, kvh * d, generator=g).to(dtype)
    pv = torch.randn(num_blocks * bs, kvh * d, generator=g).to(dtype)
    tables, q_starts, row = [], [], 0
    for start, n in chunks:
        tables.append([free.pop() for _ in range((start + n + bs - 1) // bs)])
        q_starts.append(row)
        row += n
    q = torch.randn(row, H, d, generator=g)
    mb = max(len(t) for t in tables)
    i32 = dict(dtype=torch.int32)
    args = (torch.tensor(q_starts, **i32), torch.tensor([c[0] for c in chunks], **i32),
            torch.tensor([c[1] for c in chunks], **i32),
            torch.tensor([t + [0] * (mb - len(t)) for t in tables], **i32))
    return q, pk, pv, tables, q_starts, args


# The AVX-512 build takes head dims that are multiples of 16 (others run the AVX2 one), so
# its cases use 48 where the AVX2 ones use 8; each case asserts the build it ran.
_SHAPES = [(9, 3, 64), (4, 4, 32), (6, 2, 16), (8, 1, 128), (12, 2, 80), (50, 1, 16)]


@pytest.mark.parametrize("H, kvh, d, isa", [(*s, "avx2") for s in _SHAPES + [(5, 5, 8)]]
                         + [(*s, "avx512") for s in _SHAPES + [(5, 5, 48)]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 7, 100])
def test_prefill_kernel_equals_sdpa_over_the_gathered_context(H, kvh, d, dtype, window, isa):
    if isa == "avx512" and kernels.prefill_attention_isa(16, "avx512") != "avx512":
        pytest.skip("no AVX-512 F/BW/VL on this CPU")
    assert kernels.prefill_attention_isa(d, isa) == isa       # the build this case is about
    # chunks without context, with context, of 1 token, longer than a key tile (64)
    chunks = [(0, 5), (130, 37), (3, 1), (260, 70), (0, 64)]
    bs = 16 if d > 16 else 4
    q, pk, pv, tables, q_starts, args = _chunks_case(chunks, H, kvh, d, dtype, bs, seed=H * d)
    out = torch.full_like(q, float("nan"))
    kernels.prefill_attention(q, pk, pv, *args, window, bs, d ** -0.5, out, isa=isa)
    for (start, n), table, r in zip(chunks, tables, q_starts):
        ref = _reference(q[r:r + n], pk, pv, start, n, table, bs, window, d ** -0.5, kvh, d)
        torch.testing.assert_close(out[r:r + n], ref, rtol=1e-5, atol=2e-5)


def test_the_isa_dispatch_is_reported():
    assert kernels.prefill_attention_isa(64, "avx2") == "avx2"
    want = "avx512" if "avx512f" in kernels.features() else "avx2"
    assert kernels.prefill_attention_isa(64) == want
    assert kernels.prefill_attention_isa(72, "avx512") == "avx2"      # 72 % 16 != 0


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_native_equals_torch_path_with_decodes_and_chunks(window):
    """One step of decodes + chunks with context + a first chunk, through paged_attention
    (new K/V written into the pools first), native metadata vs the torch path's."""
    d, kvh, H, bs = 16, 2, 6, 4
    g = torch.Generator().manual_seed(3)
    free = list(range(200))
    random.Random(3).shuffle(free)
    shapes = [(9, 1), (30, 1), (0, 11), (17, 6), (40, 23)]     # (start, n): decodes first
    seqs = [(s, n, [free.pop() for _ in range((s + n + bs - 1) // bs)]) for s, n in shapes]
    T = sum(n for _, n in shapes)
    pk, pv = torch.randn(200 * bs, kvh * d, generator=g), torch.randn(200 * bs, kvh * d, generator=g)
    q, k, v = (torch.randn(T, h, d, generator=g) for h in (H, kvh, kvh))
    metas = [build_metadata(seqs, bs, window, torch.device("cpu"), torch.float32,
                            decode_kernel=kern) for kern in (kernels.decode_attention(), None)]
    assert metas[0].prefill_chunks is not None and not metas[0].prefills
    assert metas[1].prefill_chunks is None and len(metas[1].prefills) == 3
    assert torch.equal(metas[0].slot_mapping, metas[1].slot_mapping)
    pools = [(pk.clone(), pv.clone()) for _ in metas]
    outs = [paged_attention(q, k, v, a, b, m, d ** -0.5) for (a, b), m in zip(pools, metas)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])


def test_the_chunks_are_checked_once_and_each_layer_call_is_lean(monkeypatch):
    """The step's tables and row ranges are checked (with reductions) when the metadata is
    built; every layer's `run` after that does no reduction over them, and still refuses a
    q too short for the chunks."""
    bs, d, kvh, H = 4, 16, 2, 4
    seqs = [(0, 5, [3, 1]), (6, 3, [0, 2, 4])]
    meta = build_metadata(seqs, bs, None, torch.device("cpu"), torch.float32,
                          decode_kernel=kernels.decode_attention())
    chunks = meta.prefill_chunks
    assert chunks.rows == 8 and chunks.tables.shape == (2, 3)
    pk, pv = torch.randn(5 * bs, kvh * d), torch.randn(5 * bs, kvh * d)
    q = torch.randn(8, H, d)
    ref = kernels.prefill_attention(q, pk, pv, chunks.q_starts, chunks.ctx, chunks.qlens,
                                    chunks.tables, 0, bs, 0.25, torch.empty_like(q))

    def no_reduction(*a, **k):
        raise AssertionError("a per-layer call reduced over the step's tables")

    for name in ("min", "max", "sum", "any", "all"):
        monkeypatch.setattr(torch.Tensor, name, no_reduction)
    for _ in range(3):                                     # three "layers"
        out = chunks.run(q, pk, pv, 0.25, torch.empty_like(q))
        assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="rows lie outside"):
        chunks.run(q[:7], pk, pv, 0.25, torch.empty_like(q[:7]))


def test_prefill_native_off_keeps_the_torch_path(monkeypatch):
    monkeypatch.setattr(attention, "PREFILL_NATIVE", False)
    meta = build_metadata([(4, 3, [0, 1])], 4, None, torch.device("cpu"), torch.float32,
                          decode_kernel=kernels.decode_attention())
    assert meta.prefill_chunks is None and len(meta.prefills) == 1


def test_bad_indices_and_arguments_are_refused():
    q, pk, pv, _, _, (qs, ctx, lens, tables) = _chunks_case([(10, 6), (0, 4)], 4, 2, 16,
                                                             torch.float32, 4, num_blocks=20)
    out = torch.empty_like(q)
    call = kernels.prefill_attention
    bad = tables.clone()
    bad[0, 1] = 20                                          # a block past the pool
    with pytest.raises(ValueError, match="outside the KV pool"):
        call(q, pk, pv, qs, ctx, lens, bad, 0, 4, 0.25, out)
    bad[0, 1] = -1
    with pytest.raises(ValueError, match="outside the KV pool"):
        call(q, pk, pv, qs, ctx, lens, bad, 0, 4, 0.25, out)
    with pytest.raises(ValueError, match="context length"):   # 10 + 6 > 4 blocks of 4
        call(q, pk, pv, qs, torch.tensor([11, 0], dtype=torch.int32), lens, tables, 0, 4, 0.25, out)
    with pytest.raises(ValueError, match="context length"):
        call(q, pk, pv, qs, ctx, torch.tensor([6, 0], dtype=torch.int32), tables, 0, 4, 0.25, out)
    with pytest.raises(ValueError, match="rows lie outside"):
        call(q, pk, pv, torch.tensor([0, 7], dtype=torch.int32), ctx, lens, tables, 0, 4, 0.25, out)
    with pytest.raises(ValueError, match="int32"):
        call(q, pk, pv, qs.long(), ctx, lens, tables, 0, 4, 0.25, out)
    with pytest.raises(ValueError, match="float32"):
        call(q.double(), pk, pv, qs, ctx, lens, tables, 0, 4, 0.25, out)
    with pytest.raises(ValueError, match="kpool"):
        call(q, pk.double(), pv.double(), qs, ctx, lens, tables, 0, 4, 0.25, out)
    with pytest.raises(ValueError, match="share"):
        call(torch.empty(10, 3, 16), pk, pv, qs, ctx, lens, tables, 0, 4, 0.25,
             torch.empty(10, 3, 16))


# --- the engine: chunked prefill, prefix-cache hits, recompute preemption ----------------------

GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts():
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(37)]
    return [shared + [rng.randrange(3, 500) for _ in range(k)] for k in (9, 21, 2, 30)]


def _generate(model_dir, prompts, **kw):
    from iterserve import LLM, SamplingParams
    llm = LLM(str(model_dir), block_size=4, max_num_batched_tokens=16, max_model_len=96, **kw)
    outs = []
    for i, batch in enumerate((prompts[:1], prompts[1:])):     # the first fills the cache
        res = llm.generate([{"prompt_token_ids": p} for p in batch],
                           SamplingParams(**GREEDY), use_tqdm=False)
        outs += [(o.outputs[0].token_ids, o.num_cached_tokens) for o in res]
    stats = llm.engine.scheduler_stats()
    return outs, stats.num_preemptions_total


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_engine_tokens_with_prefix_hits_and_recompute_preemption(tiny_model_dir, monkeypatch, kv):
    calls = []
    real = kernels.PrefillChunks.run

    def counted(chunks, *a, **k):
        calls.append(int(chunks.qlens.sum()))        # query rows computed natively
        return real(chunks, *a, **k)

    monkeypatch.setattr(kernels.PrefillChunks, "run", counted)
    made = []
    real_init = kernels.PrefillChunks.__init__
    monkeypatch.setattr(kernels.PrefillChunks, "__init__",
                        lambda self, *a: made.append(1) or real_init(self, *a))
    prompts = _prompts()
    kw = dict(num_kv_blocks=24, enable_prefix_caching=True, preemption_mode="recompute",
              kv_cache_dtype=kv)
    native, pre_native = _generate(tiny_model_dir, prompts, **kw)
    assert calls, "the native prefill attention was not used"
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    assert len(calls) == len(made) * layers                  # checked once a step, run a layer
    monkeypatch.setattr(attention, "PREFILL_NATIVE", False)
    n_calls = len(calls)
    torch_path, pre_torch = _generate(tiny_model_dir, prompts, **kw)
    assert len(calls) == n_calls
    assert native == torch_path
    assert any(cached > 0 for _, cached in native[1:])      # a prefix-cache hit happened
    assert pre_native > 0 and pre_torch > 0                 # and recompute preemption
    if kv == "float32":                                      # and both equal HF transformers
        from fixtures.tiny_models import load_hf_reference
        hf = load_hf_reference(tiny_model_dir)
        for p, (toks, _) in zip(prompts, native):
            ids = torch.tensor([p])
            ref = hf.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
            assert toks == ref[0, len(p):].tolist()


def test_sliding_window_model_through_the_engine_matches_hf(tmp_path, monkeypatch):
    """A Mistral-style sliding window (6) with prompts chunked 8 tokens at a time: every
    chunk after the first attends over a window that starts inside the cached context."""
    from fixtures.tiny_models import load_hf_reference, make_tiny_model_dir
    from iterserve import LLM, SamplingParams

    d = make_tiny_model_dir(tmp_path, "mistral", sliding_window=6)
    calls = []
    real = kernels.PrefillChunks.run
    monkeypatch.setattr(kernels.PrefillChunks, "run",
                        lambda c, *a, **k: calls.append(c.window) or real(c, *a, **k))
    llm = LLM(str(d), block_size=4, max_num_batched_tokens=8, max_model_len=64,
              num_kv_blocks=64)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (30, 13)]
    res = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert calls and set(calls) == {6}                     # the window reached the kernel
    hf = load_hf_reference(d)
    for p, o in zip(prompts, res):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert o.outputs[0].token_ids == ref[0, len(p):].tolist()

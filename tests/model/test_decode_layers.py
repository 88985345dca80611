"""All decoder layers of a decode-only step in one native call (kernels.DecodeLayers,
model/kernels/decode_layers.c).

The fused call chains the same kernels in the same order as the per-module native path, so a
model must give bit-identical logits with it on and off (llama, Qwen2's q/k/v bias, Qwen3's
q/k norm); with weights split into row segments of different types it must equal the same
per-module composition of the kernel wrappers bit for bit; it must only be taken for
decode-only steps the block kernel covers, must not be used where its preconditions fail, and
must reject bad specs and bad step tensors with ValueError before touching anything.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.gguf_blocks import gguf_blocks
from fixtures.tiny_gguf import load_all_quant_model, write_tiny_llama_gguf
from fixtures.tiny_models import Blocks, advance, chunk, greedy, request, step
from iterserve.model import kernels, layers

pytestmark = pytest.mark.skipif(not (kernels._cpu_has_avx2_fma() and kernels._compiler()),
                                reason="needs an x86-64 AVX2/FMA CPU and a C compiler")

@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def quant_model(request, tmp_path_factory):
    return load_all_quant_model(tmp_path_factory.mktemp("q") / "allquant.gguf", seed=5,
                                arch=request.param)


def _run(loaded, fused: bool, decode_steps: int = 9):
    """Prefill three prompts (one in two chunks), then decode; logits of every step and how
    many steps took the fused call."""
    from iterserve.model.runner import ModelRunner
    seen = []

    def sampler(logits, requests):
        seen.append(logits.clone())
        return greedy(logits, requests)

    runner = ModelRunner(loaded, num_blocks=48, block_size=4, sampler=sampler)
    assert runner.fused_decode
    if not fused:
        assert not loaded.model.use_fused_decode(False)
    calls = []
    inner = loaded.model._decode_layers
    loaded.model._decode_layers = lambda *a: (calls.append(a[0].shape[0]), inner(*a))[1]
    try:
        blocks = Blocks(48, 4)
        a = request("a", list(range(5, 30)))
        b = request("b", list(range(40, 47)))
        c = request("c", [3, 1, 4])
        out = step(chunk(blocks, a, 12), chunk(blocks, b), chunk(blocks, c))
        advance(out, runner.execute(out))
        out = step(chunk(blocks, b, 1), chunk(blocks, c, 1), chunk(blocks, a), step_no=1)
        advance(out, runner.execute(out))
        for s in range(decode_steps):
            out = step(*(chunk(blocks, r, 1) for r in (a, b, c)), step_no=2 + s)
            advance(out, runner.execute(out))
    finally:
        del loaded.model._decode_layers
    return seen, calls, [r.output_token_ids for r in (a, b, c)]


def test_fused_decode_layers_equal_the_per_module_path_bit_for_bit(quant_model):
    on, calls_on, tokens_on = _run(quant_model, True)
    off, calls_off, tokens_off = _run(quant_model, False)
    assert calls_on == [3] * 9          # every decode-only step, none of the prefill steps
    assert calls_off == []
    assert tokens_on == tokens_off
    assert len(on) == len(off)
    for x, y in zip(on, off):
        assert torch.equal(x, y)


def test_steps_with_more_rows_than_the_block_kernel_takes_use_the_module_path(quant_model,
                                                                               monkeypatch):
    monkeypatch.setattr(layers, "QUANT_MAX_ROWS", 2)
    _, calls, _ = _run(quant_model, True, decode_steps=3)
    assert calls == []


def test_fused_decode_is_off_without_the_block_kernel_or_native_ops(quant_model):
    from iterserve.model.runner import ModelRunner
    runner = ModelRunner(quant_model, num_blocks=8, block_size=4, sampler=greedy,
                         quant_kernels=False)
    assert not runner.fused_decode and quant_model.model._fused is None
    runner = ModelRunner(quant_model, num_blocks=8, block_size=4, sampler=greedy,
                         native_kernels=False)
    assert not runner.fused_decode and quant_model.model._fused is None


def test_float_weights_keep_the_module_path(tmp_path):
    """The default tiny GGUF stores q/k/v in three types, so qkv has no blocks: not fused."""
    from iterserve.model.loader import load_model
    from iterserve.model.runner import ModelRunner
    path = tmp_path / "mixed.gguf"
    write_tiny_llama_gguf(path, seed=1)
    loaded = load_model(str(path))
    runner = ModelRunner(loaded, num_blocks=8, block_size=4, sampler=greedy)
    assert not runner.fused_decode


# --- DecodeLayers directly: mixed-type segments, bias, q/k norm ------------------------------

H, KVH, D, HIDDEN, INTER, EPS = 4, 2, 64, 256, 512, 1e-5
QSZ, KVSZ = H * D, KVH * D


def _segments(spec, k, seed):
    """[(type, blocks)] for the (type name, rows) list, and the float reference weights."""
    out = []
    for j, (name, rows) in enumerate(spec):
        t, raw, _ = gguf_blocks(name, rows, k, seed=seed + j, scale=(1e-4, 1e-3))
        out.append((t, raw))
    return out


def _specs(nlayers=2, bias=True, qk_norm=True):
    g = torch.Generator().manual_seed(0)

    def vec(n, base=1.0):
        return base + 0.1 * torch.randn(n, generator=g)

    specs = []
    for i in range(nlayers):
        specs.append(kernels.LayerSpec(
            ln1=vec(HIDDEN), ln2=vec(HIDDEN),
            qkv=_segments([("Q4_K", QSZ), ("Q6_K", KVSZ), ("Q5_0", KVSZ)], HIDDEN, 10 * i),
            o=_segments([("Q8_0", HIDDEN)], QSZ, 10 * i + 4),
            gate_up=_segments([("Q4_K", INTER), ("Q5_K", INTER)], HIDDEN, 10 * i + 5),
            down=_segments([("Q6_K", HIDDEN)], INTER, 10 * i + 7),
            qkv_bias=vec(QSZ + 2 * KVSZ, 0.0) if bias else None,
            q_norm=vec(D) if qk_norm else None, k_norm=vec(D) if qk_norm else None))
    return specs


def _per_module(specs, h, cos, sin, slots, tables, lens, bs, scale, kp, vp):
    """The per-module native path, written with the kernel wrappers (as the model calls them)."""
    T = h.shape[0]

    def gemm(segments, x, n):
        y, col = torch.empty(T, n), 0
        for t, w in segments:
            kernels.qgemm(t, w, x.shape[1], x, y, col)
            col += w.shape[0]
        return y

    for i, s in enumerate(specs):
        x = kernels.rmsnorm(h, s.ln1, EPS, torch.empty_like(h))
        qkv = gemm(s.qkv, x, QSZ + 2 * KVSZ)
        if s.qkv_bias is not None:
            qkv.add_(s.qkv_bias)
        if s.q_norm is not None:
            kernels.qk_norm(qkv, H, KVH, D, s.q_norm, s.k_norm, EPS)
        kernels.rope(qkv, H + KVH, D, cos, sin)
        kp[i].index_copy_(0, slots, qkv[:, QSZ:QSZ + KVSZ])
        vp[i].index_copy_(0, slots, qkv[:, QSZ + KVSZ:])
        q = qkv[:, :QSZ].contiguous().view(T, H, D)
        a = kernels.decode_attention(q, kp[i], vp[i], tables, lens, 0, bs, scale,
                                     torch.empty_like(q))
        h = h + gemm(s.o, a.view(T, QSZ), HIDDEN)
        x = kernels.rmsnorm(h, s.ln2, EPS, torch.empty_like(h))
        act = kernels.silu_mul(gemm(s.gate_up, x, 2 * INTER), torch.empty(T, INTER))
        h = h + gemm(s.down, act, HIDDEN)
    return h


def _step(T=3, bs=4, nblocks=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([5, 9, 2][:T], dtype=torch.int32)
    tables = torch.tensor([[3, 7, 0], [1, 2, 5], [8, 0, 0]][:T], dtype=torch.int32)
    slots = torch.tensor([int(tables[s, (lens[s] - 1) // bs]) * bs + int(lens[s] - 1) % bs
                          for s in range(T)], dtype=torch.int64)
    pools = [torch.randn(nblocks * bs, KVSZ, generator=g) for _ in range(4)]
    cos, sin = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    return torch.randn(T, HIDDEN, generator=g), cos, sin, slots, tables, lens, bs, pools


@pytest.mark.parametrize("bias, qk_norm", [(False, False), (True, False), (False, True),
                                           (True, True)])
def test_decode_layers_over_mixed_type_segments_equal_the_per_module_wrappers(bias, qk_norm):
    specs = _specs(bias=bias, qk_norm=qk_norm)
    assert kernels.DecodeLayers.supported(specs)
    fused = kernels.DecodeLayers(specs, HIDDEN, H, KVH, D, INTER, EPS)
    h, cos, sin, slots, tables, lens, bs, pools = _step()
    kp, vp = [p.clone() for p in pools[:2]], [p.clone() for p in pools[2:]]
    ref = _per_module(specs, h.clone(), cos, sin, slots, tables, lens, bs, 0.125,
                      [p.clone() for p in kp], [p.clone() for p in vp])
    out = fused.run(h, cos, sin, slots, tables, lens, 0, bs, 0.125, kp, vp)
    assert out is h and torch.isfinite(h).all()
    assert torch.equal(h, ref)
    # the K/V of this step went to the pools at their slots
    assert not torch.equal(kp[0][slots], pools[0][slots])


def test_decode_layers_reject_bad_specs_and_bad_steps_before_touching_anything():
    specs = _specs(nlayers=1)
    fused = kernels.DecodeLayers(specs, HIDDEN, H, KVH, D, INTER, EPS)
    h, cos, sin, slots, tables, lens, bs, pools = _step()
    kp, vp = pools[:1], pools[2:3]
    before = [t.clone() for t in (h, kp[0], vp[0])]
    bad_runs = [
        dict(slot_mapping=torch.tensor([0, 1, 12 * 4], dtype=torch.int64)),   # slot past pool
        dict(slot_mapping=slots.int()),                                      # wrong dtype
        dict(tables=torch.tensor([[3, 7, 0], [1, 99, 5], [8, 0, 0]], dtype=torch.int32)),
        dict(lens=torch.tensor([5, 13, 2], dtype=torch.int32)),              # past its table
        dict(cos=cos[:2]),
        dict(k_pools=[]),
        dict(h=h.double()),
    ]
    for bad in bad_runs:
        args = dict(h=h, cos=cos, sin=sin, slot_mapping=slots, tables=tables, lens=lens,
                    window=0, block_size=bs, scale=0.125, k_pools=kp, v_pools=vp)
        args.update(bad)
        with pytest.raises(ValueError):
            fused.run(**args)
    for t, b in zip((h, kp[0], vp[0]), before):
        assert torch.equal(t, b)
    import dataclasses
    for change in (dict(qkv=specs[0].qkv[:2]),                      # rows do not add up
                   dict(k_norm=None),                                # q_norm without k_norm
                   dict(ln1=specs[0].ln1[:-1]),
                   dict(down=[(specs[0].down[0][0], specs[0].down[0][1][:, :-2])])):
        with pytest.raises(ValueError):
            kernels.DecodeLayers([dataclasses.replace(specs[0], **change)], HIDDEN, H, KVH, D,
                                 INTER, EPS)
    no_kernel = dataclasses.replace(specs[0], o=[(9, specs[0].o[0][1])])     # Q8_1
    assert not kernels.DecodeLayers.supported([no_kernel])
    with pytest.raises(ValueError):
        kernels.DecodeLayers([no_kernel], HIDDEN, H, KVH, D, INTER, EPS)

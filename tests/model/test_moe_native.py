"""Mixture-of-Experts layers on the native kernels (model/kernels/moe.c, kernels.MoeBlock).

Qwen3-MoE and Mixtral checkpoints with their Linears re-encoded as Q8_0 blocks (the router
kept dense float32, as a GGUF's F32 router loads), so the experts run where a GGUF's do:
- moe.c's routing picks the experts and weights torch's softmax / top-k picks;
- the block's output equals the Python loop over experts (moe.py) on the same kernels;
- the fused decode step (decode_layers.c with MoE layers) gives the same logits bit for bit
  as the per-module path, and greedy tokens equal the torch-routed path's;
- under --batch-invariant a token's logits do not depend on the rows beside it, and no
  result depends on the thread count;
- gpt-oss (router bias, top-k softmax, expert biases, clamped SwiGLU; HF's interleaved
  gate/up rows or the GGUF's halves; MXFP4 or re-encoded experts) takes the same block and
  agrees with the torch path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fixtures.tiny_models import (Blocks, advance, chunk, greedy, make_tiny_model_dir, request,
                                  step)
from iterserve.model import kernels
from iterserve.model.layers import Linear
from iterserve.model.loader import load_model
from iterserve.model.moe import SparseMoE
from iterserve.model.runner import ModelRunner
from iterserve.model.weights import EncodedWeight

pytestmark = pytest.mark.skipif(not (kernels._cpu_has_avx2_fma() and kernels._compiler()),
                                reason="needs an x86-64 AVX2/FMA CPU and a C compiler")

Q8_0 = 8


def _encode_q8(loaded) -> None:
    """Every Linear but the routers as Q8_0 blocks (gguf-py's quantiser), as a Q8_0 GGUF."""
    from gguf import GGMLQuantizationType, quants
    model = loaded.model
    routers = {id(m.router) for m in model.modules() if isinstance(m, SparseMoE)}
    for m in model.modules():
        if isinstance(m, Linear) and id(m) not in routers and m.weight is not None:
            w = m.weight.detach().float().numpy()
            blocks = quants.quantize(w, GGMLQuantizationType.Q8_0)
            m.set_weight(EncodedWeight([(Q8_0, torch.from_numpy(np.ascontiguousarray(blocks)))],
                                       m.in_features))
    model.use_quant(True)
    model.use_native_ops(True)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def q8_model(request, tmp_path_factory):
    d = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param,
                            **({"mlp_only_layers": []} if request.param == "qwen3_moe" else {}))
    loaded = load_model(str(d))
    _encode_q8(loaded)
    return loaded


def _moes(loaded) -> list[SparseMoE]:
    return [m for m in loaded.model.modules() if isinstance(m, SparseMoE)]


def test_every_moe_layer_takes_the_native_block(q8_model):
    moes = _moes(q8_model)
    assert moes and all(m._block is not None and m._route is not None for m in moes)
    assert q8_model.model.config.llama_like
    assert ModelRunner(q8_model, num_blocks=32, block_size=4, sampler=greedy).fused_decode


@pytest.mark.parametrize("norm", [True, False])
def test_routing_matches_torch_softmax_topk(norm):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(37, 16, generator=g) * 3
    w, ids = kernels.moe_route(logits, 4, norm)
    probs = torch.softmax(logits, dim=-1)
    top, idx = torch.topk(probs, 4, dim=-1)
    if norm:
        top = top / top.sum(dim=-1, keepdim=True)
    assert torch.equal(ids, idx)
    torch.testing.assert_close(w, top, rtol=1e-6, atol=1e-7)


def test_routing_ties_go_to_the_lower_expert():
    w, ids = kernels.moe_route(torch.tensor([[1.0, 2.0, 2.0, 2.0]]), 2, True)
    assert ids.tolist() == [[1, 2]]
    assert w.tolist() == [[0.5, 0.5]]


@pytest.mark.parametrize("T", [1, 3, 32])
def test_block_equals_the_python_loop_over_experts(q8_model, T):
    moe = _moes(q8_model)[0]
    x = torch.randn(T, moe.hidden, generator=torch.Generator().manual_seed(T))
    native = moe(x)
    block, moe._block = moe._block, None
    try:
        loop = moe(x)
    finally:
        moe._block = block
    torch.testing.assert_close(native, loop, rtol=1e-5, atol=1e-6)


def test_large_steps_keep_the_loop_and_moe_c_routing(q8_model):
    """A prefill-sized step (> QUANT_MAX_ROWS rows) runs the loop over the prefill GEMMs;
    its rows agree with the same rows run as decode-sized steps."""
    moe = _moes(q8_model)[0]
    calls = []
    inner = moe._block.forward
    moe._block.forward = lambda x: (calls.append(x.shape[0]), inner(x))[1]
    try:
        x = torch.randn(40, moe.hidden, generator=torch.Generator().manual_seed(4))
        big = moe(x)
        assert calls == []
        small = torch.cat([moe(x[i:i + 8]) for i in range(0, 40, 8)])
        assert calls == [8] * 5
    finally:
        del moe._block.forward
    torch.testing.assert_close(big, small, rtol=2e-2, atol=2e-3)


def _decode(loaded, fused: bool, steps: int = 8):
    """Prefill three prompts (one in two chunks), then decode them together: every step's
    logits and each request's tokens, with the fused decode step on or off."""
    seen = []

    def sampler(logits, requests):
        seen.append(logits.clone())
        return greedy(logits, requests)

    runner = ModelRunner(loaded, num_blocks=64, block_size=4, sampler=sampler)
    assert runner.fused_decode
    if not fused:
        assert not loaded.model.use_fused_decode(False)
    calls = []
    inner = loaded.model._decode_layers
    loaded.model._decode_layers = lambda *a: (calls.append(a[0].shape[0]), inner(*a))[1]
    try:
        blocks = Blocks(64, 4)
        a, b, c = (request("a", list(range(5, 30))), request("b", list(range(40, 47))),
                   request("c", [3, 1, 4]))
        out = step(chunk(blocks, a, 12), chunk(blocks, b), chunk(blocks, c))
        advance(out, runner.execute(out))
        out = step(chunk(blocks, b, 1), chunk(blocks, c, 1), chunk(blocks, a), step_no=1)
        advance(out, runner.execute(out))
        for s in range(steps):
            out = step(*(chunk(blocks, r, 1) for r in (a, b, c)), step_no=2 + s)
            advance(out, runner.execute(out))
    finally:
        del loaded.model._decode_layers
        loaded.model.use_fused_decode(True)
    return seen, [r.output_token_ids for r in (a, b, c)], calls


def _assert_fused_equals_per_module(loaded) -> None:
    """Every decode-only step took the fused call, with the same tokens and logit bits as
    the per-module path."""
    on, tok_on, calls = _decode(loaded, fused=True)
    off, tok_off, calls_off = _decode(loaded, fused=False)
    assert calls and all(n == 3 for n in calls) and not calls_off
    assert tok_on == tok_off
    for x, y in zip(on, off):
        assert torch.equal(x, y)


def test_fused_decode_with_experts_is_bit_identical_to_per_module(q8_model):
    _assert_fused_equals_per_module(q8_model)


def test_native_experts_agree_with_the_torch_path(q8_model):
    """The same encoded weights with the native ops off (torch routing, the Python loop):
    the same greedy tokens, logits within float rounding."""
    native, tok_native, _ = _decode(q8_model, fused=True)
    seen = []

    def sampler(logits, requests):
        seen.append(logits.clone())
        return greedy(logits, requests)

    runner = ModelRunner(q8_model, num_blocks=64, block_size=4, sampler=sampler)
    try:
        for m in _moes(q8_model):
            assert not m.use_native(False)
        assert not q8_model.model.use_fused_decode(True)     # an MoE layer without its block
        blocks = Blocks(64, 4)
        a, b, c = (request("a", list(range(5, 30))), request("b", list(range(40, 47))),
                   request("c", [3, 1, 4]))
        out = step(chunk(blocks, a, 12), chunk(blocks, b), chunk(blocks, c))
        advance(out, runner.execute(out))
        out = step(chunk(blocks, b, 1), chunk(blocks, c, 1), chunk(blocks, a), step_no=1)
        advance(out, runner.execute(out))
        for s in range(8):
            out = step(*(chunk(blocks, r, 1) for r in (a, b, c)), step_no=2 + s)
            advance(out, runner.execute(out))
    finally:
        q8_model.model.use_native_ops(True)
        q8_model.model.use_fused_decode(True)
    assert [r.output_token_ids for r in (a, b, c)] == tok_native
    for x, y in zip(native, seen):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)


def test_batch_invariant_block_rows_do_not_depend_on_their_neighbours(q8_model):
    moe = _moes(q8_model)[0]
    x = torch.randn(6, moe.hidden, generator=torch.Generator().manual_seed(9))
    was = kernels.config().batch_invariant
    kernels.set_batch_invariant(True)
    try:
        together = moe(x)
        alone = torch.cat([moe(x[i:i + 1]) for i in range(6)])
    finally:
        kernels.set_batch_invariant(was)
    assert torch.equal(together, alone)


@pytest.fixture(scope="module", params=["q8_0-interleaved", "mxfp4"])
def oss_model(request, tmp_path_factory):
    """gpt-oss: its HF layout re-encoded as Q8_0 (gate/up rows interleaved), or its MXFP4
    checkpoint as it is (the experts' own blocks)."""
    from fixtures.tiny_mxfp4 import make_tiny_gpt_oss_mxfp4
    d = tmp_path_factory.mktemp(request.param)
    if request.param == "mxfp4":
        loaded = load_model(str(make_tiny_gpt_oss_mxfp4(d)[1]))
        loaded.model.use_quant(True)
        loaded.model.use_native_ops(True)
    else:
        loaded = load_model(str(make_tiny_model_dir(d, "gpt_oss")))
        _encode_q8(loaded)
    return loaded


def test_gpt_oss_takes_the_native_block(oss_model):
    """Router bias, top-k softmax, expert biases, the clamped SwiGLU: moe.c runs them all."""
    c = oss_model.model.config
    assert c.native_moe and not c.llama_like and c.decode_layers_fit
    moes = _moes(oss_model)
    assert moes and all(m._block is not None and m._route is not None for m in moes)
    assert all(e._native_oai is not None for m in moes for e in m.experts)


def test_gpt_oss_fused_decode_is_bit_identical_to_per_module(oss_model):
    """gpt-oss's decode steps in one native call (decode_layers.c with each layer's window,
    sinks and o bias): every step's logits the same bits as the per-module path, past the
    sliding window (6 tokens in the tiny model; the prompts are up to 25)."""
    assert {w for w in oss_model.config.layer_windows()} == {None, 6}
    if not oss_model.model.use_fused_decode(True):
        pytest.skip("attention weights left dense in this checkpoint: no fused call")
    _assert_fused_equals_per_module(oss_model)


def test_topk_softmax_routing_matches_torch():
    logits = torch.randn(29, 32, generator=torch.Generator().manual_seed(2)) * 3
    w, ids = kernels.moe_route(logits, 4, False, "topk_softmax")
    top, idx = torch.topk(logits, 4, dim=-1)
    assert torch.equal(ids, idx)
    torch.testing.assert_close(w, torch.softmax(top, dim=-1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("interleaved", [False, True])
def test_swiglu_oai_kernel_matches_torch(interleaved):
    """Both layouts and a tail of fewer than eight columns, values beyond the clamp limit."""
    gu = torch.randn(5, 2 * 43, generator=torch.Generator().manual_seed(3)) * 6
    gate, up = (gu[:, 0::2], gu[:, 1::2]) if interleaved else (gu[:, :43], gu[:, 43:])
    g, u = gate.clamp(max=7.0), up.clamp(min=-7.0, max=7.0)
    want = (u + 1) * (g * torch.sigmoid(g * 1.702))
    got = kernels.swiglu_oai(gu, torch.empty(5, 43), interleaved, 1.702, 7.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T", [1, 3, 32])
def test_gpt_oss_block_equals_the_python_loop(oss_model, T):
    moe = _moes(oss_model)[0]
    x = torch.randn(T, moe.hidden, generator=torch.Generator().manual_seed(T))
    native = moe(x)
    block, moe._block = moe._block, None
    try:
        loop = moe(x)
    finally:
        moe._block = block
    torch.testing.assert_close(native, loop, rtol=1e-5, atol=1e-6)


def _greedy_run(loaded, steps: int = 8):
    """Prefill three prompts, then decode them together: each step's logits and the tokens."""
    seen = []

    def sampler(logits, requests):
        seen.append(logits.clone())
        return greedy(logits, requests)

    runner = ModelRunner(loaded, num_blocks=64, block_size=4, sampler=sampler)
    blocks = Blocks(64, 4)
    a, b, c = (request("a", list(range(5, 30))), request("b", list(range(40, 47))),
               request("c", [3, 1, 4]))
    out = step(chunk(blocks, a, 12), chunk(blocks, b), chunk(blocks, c))
    advance(out, runner.execute(out))
    out = step(chunk(blocks, b, 1), chunk(blocks, c, 1), chunk(blocks, a), step_no=1)
    advance(out, runner.execute(out))
    for s in range(steps):
        out = step(*(chunk(blocks, r, 1) for r in (a, b, c)), step_no=2 + s)
        advance(out, runner.execute(out))
    return seen, [r.output_token_ids for r in (a, b, c)]


def test_gpt_oss_native_experts_agree_with_the_torch_path(oss_model):
    """The same weights with the native ops off (torch routing and activation, the Python
    loop): the same greedy tokens, logits within float rounding."""
    native, tok_native = _greedy_run(oss_model)
    try:
        for m in _moes(oss_model):
            assert not m.use_native(False)
        for m in oss_model.model.modules():
            if hasattr(m, "_native_oai"):
                m._native_oai = None
        torch_path, tok_torch = _greedy_run(oss_model)
    finally:
        oss_model.model.use_native_ops(True)
    assert tok_torch == tok_native
    for x, y in zip(native, torch_path):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)


def test_gpt_oss_block_is_batch_invariant(oss_model):
    moe = _moes(oss_model)[0]
    x = torch.randn(6, moe.hidden, generator=torch.Generator().manual_seed(9))
    was = kernels.config().batch_invariant
    kernels.set_batch_invariant(True)
    try:
        together = moe(x)
        alone = torch.cat([moe(x[i:i + 1]) for i in range(6)])
    finally:
        kernels.set_batch_invariant(was)
    assert torch.equal(together, alone)


def test_block_rejects_bad_shapes(q8_model):
    moe = _moes(q8_model)[0]
    with pytest.raises(ValueError):
        moe._block.forward(torch.zeros(2, moe.hidden + 1))
    with pytest.raises(ValueError):
        moe._block.forward(torch.zeros(2, moe.hidden, dtype=torch.float64))
    e = moe.experts[0]
    gu = list(e.gate_up_proj.encoded.segments)
    with pytest.raises(ValueError):
        kernels.MoeBlock([(0, moe.router.weight.detach().view(torch.uint8))], [gu],
                         [gu], moe.hidden, e.inter, 1, True)       # down has gate_up's rows
    with pytest.raises(ValueError):
        kernels.MoeBlock([(0, moe.router.weight.detach().view(torch.uint8))], [gu], [], moe.hidden,
                         e.inter, 1, True)


@pytest.mark.parametrize("T", [1, 5])
def test_block_does_not_depend_on_the_thread_count(q8_model, T):
    """The threads split rows of one parallel region (moe.c): one thread or two, each output
    row is the same single-thread kernel's."""
    moe = _moes(q8_model)[0]
    x = torch.randn(T, moe.hidden, generator=torch.Generator().manual_seed(11))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = moe(x)
        torch.set_num_threads(2)
        two = moe(x)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)

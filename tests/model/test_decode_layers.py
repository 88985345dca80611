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


def test_mixed_type_weights_take_the_fused_call_as_segments(tmp_path):
    """The default tiny GGUF stores q/k/v in three types: qkv is three row segments, each
    with a native qgemm, so the fused call runs (one segment per run of parts of one type)."""
    from iterserve.model.loader import load_model
    from iterserve.model.runner import ModelRunner
    path = tmp_path / "mixed.gguf"
    write_tiny_llama_gguf(path, seed=1)
    loaded = load_model(str(path))
    runner = ModelRunner(loaded, num_blocks=8, block_size=4, sampler=greedy)
    assert len(loaded.model.layers[0].self_attn.qkv_proj.quant.segments) == 3
    assert runner.fused_decode == all(kernels.supports_qgemm(t) for t in (0, 1, 2))


def test_f16_kv_cache_takes_the_fused_call_and_equals_the_per_module_path(tmp_path):
    """--kv-cache-dtype float16: the fused call writes K/V rounded to nearest even (F16C) as
    the per-module path's torch .to(float16) does, and reads them through the same kernel, so
    the logits are bit-identical with the fused call on and off."""
    from iterserve.model.loader import load_model
    path = tmp_path / "allquant.gguf"
    load_all_quant_model(path, seed=5)
    loaded = load_model(str(path), kv_cache_dtype="float16")
    on, calls_on, tokens_on = _run(loaded, True)
    off, calls_off, tokens_off = _run(loaded, False)
    assert calls_on == [3] * 9 and calls_off == []
    assert tokens_on == tokens_off
    for x, y in zip(on, off):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tied", [True, False])
def test_hf_half_checkpoints_decode_on_the_native_kernels_in_their_own_encoding(
        tmp_path, dtype, tied, monkeypatch):
    """An HF bf16 / fp16 directory: every Linear, the LM head included (tied or not), runs
    on kernels.qgemm over its BF16 / F16 rows (no float32 copy, no oneDNN), and decode-only
    steps take the fused call."""
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file, save_file
    from fixtures.tiny_models import make_tiny_model_dir
    from iterserve.model.layers import Linear
    from iterserve.model.loader import load_model
    from iterserve.model.runner import ModelRunner

    d = make_tiny_model_dir(tmp_path, tie_word_embeddings=tied)
    st = load_file(str(d / "model.safetensors"))
    save_file({k: v.to(dtype) for k, v in st.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    lm = load_model(str(d))
    want = int(Q.BF16 if dtype == torch.bfloat16 else Q.F16)
    runner = ModelRunner(lm, num_blocks=16, block_size=4, sampler=greedy)
    linears = [m for m in lm.model.modules() if isinstance(m, Linear)]
    assert all(m.weight is None and m.encoded.types == [want] for m in linears)
    assert all(m.compute_path() == "native" for m in linears)
    assert runner.fused_decode and not runner.packed
    head_calls = []
    real = kernels.qgemm
    monkeypatch.setattr(kernels, "qgemm", lambda t, w, *a: (
        head_calls.append((int(t), w.shape[0])), real(t, w, *a))[1])
    blocks = Blocks(16, 4)
    r = request("r", [5, 6, 7, 8, 9])
    out = step(chunk(blocks, r))
    advance(out, runner.execute(out))
    out = step(chunk(blocks, r, 1), step_no=1)
    advance(out, runner.execute(out))
    assert (want, lm.config.vocab_size) in head_calls     # the LM head, in its own type


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("tied", [True, False])
def test_gguf_lm_head_runs_on_the_native_kernel_tied_or_not(tmp_path, qtype, tied):
    from fixtures.tiny_gguf import write_random_llama_gguf
    from iterserve.model.loader import load_model
    from iterserve.model.runner import ModelRunner
    cfg = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=512, rms_norm_eps=1e-5,
               rope_theta=1e4, max_position_embeddings=128, tie_word_embeddings=tied)
    write_random_llama_gguf(tmp_path / "m.gguf", cfg, qtype)
    lm = load_model(str(tmp_path / "m.gguf"))
    runner = ModelRunner(lm, num_blocks=8, block_size=4, sampler=greedy)
    head = lm.model.lm_head
    assert (head.encoded is lm.model.embed_tokens.encoded) == tied
    assert head.compute_path() == "native" and runner.fused_decode


def test_phase_timers_change_no_result_and_account_for_the_call(quant_model):
    """decode_layers.c's opt-in phase timers (benchmarks/profile_decode.py): the same logits
    bit for bit with them on; every GEMM role, the attention and each segment's weight type
    get time, and the phases add up to no more than the whole call."""
    import ctypes
    fn = kernels._lib().iterserve_decode_profile
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p]
    n = fn(None)
    off, _, _ = _run(quant_model, fused=True)
    types = {int(t) for layer in quant_model.model.layers
             for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                         layer.mlp.gate_up_proj, layer.mlp.down_proj)
             for t, _ in lin.encoded.segments}
    shares = []
    for _ in range(3):
        acc = (ctypes.c_double * n)()
        fn(ctypes.addressof(acc))
        try:
            on, _, _ = _run(quant_model, fused=True)
        finally:
            fn(None)
        assert len(on) == len(off) and all(torch.equal(a, b) for a, b in zip(on, off))
        phases, call = list(acc[:11]), acc[11]
        assert all(phases[i] > 0 for i in (0, 1, 5, 6, 8, 10))    # norms, 4 GEMMs, attention
        assert 0 < sum(phases) <= call
        timed = {t for t in range(n - 16) if acc[16 + t] > 0}
        assert timed == types
        # Each segment's interval lies inside its GEMM role's, so the per-type sum cannot
        # exceed the roles' sum; the gap is the clock reads and the loop around the segments.
        gemms = phases[1] + phases[6] + phases[8] + phases[10]
        assert sum(acc[16:]) <= gemms * (1 + 1e-9)
        shares.append(sum(acc[16:]) / gemms)
        if shares[-1] >= 0.5:
            break
    # On this tiny model one GEMM takes microseconds, so a clock read that costs a syscall
    # or one descheduling of the process is a visible share of a step (a loaded 2-core
    # machine measured 0.67 where a quiet one gives 0.98): the best of three runs must
    # still put most of the GEMM time in the per-type slots.
    assert max(shares) >= 0.5, shares

"""The native kernels at the model level (model/kernels/, model/weights.py).

The library builds into an empty cache dir and is reused from it, and a model loaded from an
all-quantised GGUF gives the same logits with the kernels on as with them off (which also
proves the blocks were un-permuted and fused right). Per-type kernel accuracy against gguf-py
is tests/model/test_gguf_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.gguf_blocks import gguf_blocks
from fixtures.tiny_gguf import load_all_quant_model, write_tiny_llama_gguf
from fixtures.tiny_models import Blocks, advance, chunk, greedy, greedy_steps, request, step
from iterserve.model import kernels

pytestmark = pytest.mark.skipif(not (kernels._cpu_has_avx2_fma() and kernels._compiler()),
                                reason="needs an x86-64 AVX2/FMA CPU and a C compiler")

def test_the_built_library_is_cached_and_a_second_build_compiles_nothing(monkeypatch):
    """The full source set, once built (by whichever test loaded the kernels first: on a
    fresh machine that is a compile into the empty cache), is one .so in the cache dir, and
    asking for it again compiles nothing. Compiling into an empty dir, the lock and a
    failing file are tests/model/test_prefill_kernel.py's small-source build test: a
    second full build here would cost a minute of CI for what that one shows."""
    import subprocess
    assert kernels.available(), kernels.unavailable
    runs = []
    real_run = subprocess.run

    def spy(cmd, *a, **kw):
        runs.append(cmd)
        return real_run(cmd, *a, **kw)
    monkeypatch.setattr(kernels.build.subprocess, "run", spy)
    path = kernels._build(kernels._compiler())
    assert path.parent == kernels.build.cache_dir() and path.exists()
    assert path in list(kernels.build.cache_dir().glob("iterserve-*.so"))
    assert not [c for c in runs if "-c" in c or "-o" in c]        # cached: no rebuild


KQ_MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256)


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory):
    return load_all_quant_model(tmp_path_factory.mktemp("q") / "allquant.gguf", seed=3)


def _run(loaded, quant: bool):
    """Prefill two prompts (one in two chunks), then decode 6 steps; logits of every step."""
    from iterserve.model.runner import ModelRunner
    logits_seen = []

    def sampler(logits, requests):
        logits_seen.append(logits.clone())
        return greedy(logits, requests)

    runner = ModelRunner(loaded, num_blocks=32, block_size=4, sampler=sampler, quant_kernels=quant)
    blocks = Blocks(32, 4)
    a, b = request("a", list(range(5, 30))), request("b", list(range(40, 47)))
    out = step(chunk(blocks, a, 12), chunk(blocks, b))
    advance(out, runner.execute(out))
    out = step(chunk(blocks, b, 1), chunk(blocks, a), step_no=1)
    advance(out, runner.execute(out))
    for s in range(6):
        out = step(chunk(blocks, a, 1), chunk(blocks, b, 1), step_no=2 + s)
        advance(out, runner.execute(out))
    return runner, logits_seen, a.output_token_ids + b.output_token_ids


def test_all_quantised_gguf_gives_the_same_logits_with_the_kernel_on_and_off(quant_model):
    cfg = quant_model.config
    on, logits_on, tokens_on = _run(quant_model, True)
    assert on.quantized
    linears = [m for m in quant_model.model.modules() if m.__class__.__name__ == "Linear"]
    assert len(linears) == 4 * cfg.num_layers + 1 and all(m.quant is not None for m in linears)
    assert all(m._qgemm is not None for m in linears)
    off, logits_off, tokens_off = _run(quant_model, False)
    assert not off.quantized and all(m._qgemm is None for m in linears)
    assert tokens_on == tokens_off
    for x, y in zip(logits_on, logits_off):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_disabling_native_kernels_falls_back_to_float_weights(quant_model, monkeypatch):
    from iterserve.model.runner import ModelRunner
    monkeypatch.setenv("ITERSERVE_NATIVE_KERNELS", "0")
    kernels.clear_cache()
    try:
        runner = ModelRunner(quant_model, num_blocks=8, block_size=4, sampler=greedy)
        assert not runner.quantized and "ITERSERVE_NATIVE_KERNELS" in kernels.unavailable
    finally:
        kernels.clear_cache()


def test_mixed_type_fused_layers_keep_one_segment_per_type(tmp_path):
    """The default tiny GGUF stores q/k/v in three different types: qkv is three segments
    (one row segment per run of parts of the same type)."""
    from gguf import GGMLQuantizationType as Q
    from iterserve.model.loader import load_model
    path = tmp_path / "mixed.gguf"
    write_tiny_llama_gguf(path)
    model = load_model(str(path)).model
    assert model.layers[0].self_attn.qkv_proj.quant.types == [Q.F32, Q.F16, Q.Q4_0]
    assert model.layers[0].self_attn.o_proj.quant.types == [Q.Q4_1]      # Q4_1 alone


# --- the K-quant int8 decode kernels (qdot8.c dotkv_vnni / dotkw_avx2) ----------------------

KQ_TYPES = ["Q4_K", "Q5_K", "Q6_K"]
KQ_ISAS = ["avx2", "avx512vnni"]


@pytest.fixture(params=KQ_ISAS)
def kq_isa(request):
    if request.param == "avx512vnni" and not {"avx512f", "avx512bw", "avx512vl",
                                              "avx512vnni"} <= kernels.features():
        pytest.skip("the CPU has no AVX-512 VNNI")
    assert kernels.int8_isa(request.param) == request.param
    yield request.param
    kernels.int8_isa()


def _q8k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantised as the kernels do (blocks of 256, scale max|x| / 127, half to even),
    dequantised; and each element's scale."""
    m, k = x.shape
    xb = x.reshape(m, k // 256, 256)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    d = amax / 127
    return (torch.round(xb * inv) * d).reshape(m, k), d.expand(m, k // 256, 256).reshape(m, k)


def _check_kq(out: torch.Tensor, x: torch.Tensor, ref: torch.Tensor) -> None:
    """Against gguf-py's dequantisation: with the same 8-bit activations, float32 summation
    error only (the integer parts are exact); with the float activations, within the
    rounding bound sum_j |w_j| d_j / 2."""
    xq, d = _q8k(x)
    w64 = ref.double()
    mag = xq.double().abs() @ w64.abs().T
    exact = xq.double() @ w64.T
    err = (out.double() - exact).abs()
    assert (err <= 2e-6 * mag + 1e-9).all(), (err - 2e-6 * mag).max().item()
    bound = (d.double() / 2) @ w64.abs().T + 2e-6 * mag + 1e-9
    assert ((out.double() - x.double() @ w64.T).abs() <= bound).all()


@pytest.mark.parametrize("name", KQ_TYPES)
def test_kquant_decode_kernels_every_row_count_against_gguf_py(name, kq_isa):
    """The K-quant decode kernels (one decode of a super-block for all rows of a tile of up to
    12), at every row count 1..12 and 13, 25 (two and three tiles), K of 1024 (one K chunk)
    and 8192 (several), 37 columns, against gguf-py's dequantisation times a float matmul."""
    for k in (1024, 8192):
        t, w, ref = gguf_blocks(name, 37, k, seed=k)
        for rows in list(range(1, 14)) + [25]:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 0.5
            x[0, :300] = 0.0                                         # a zero block (scale 0)
            out = torch.full((rows, 37), float("nan"))
            kernels.qgemm_int8(t, w, k, x, out)
            _check_kq(out, x, ref)


@pytest.mark.parametrize("name", KQ_TYPES)
def test_kquant_decode_tiles_threads_and_column_offsets(name, kq_isa, monkeypatch):
    """Two threads splitting 193 columns and a column offset into a wider output: every result
    within the bound, nothing written outside its columns."""
    k, n = 2048, 193
    t, w, ref = gguf_blocks(name, n, k, seed=11)
    monkeypatch.setattr(kernels.ops, "_threads", lambda: 2)
    for rows in (1, 5, 9, 12, 13, 25):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        wide = torch.full((rows, n + 9), 7.0)
        kernels.qgemm_int8(t, w, k, x, wide, col0=4)
        assert (wide[:, :4] == 7).all() and (wide[:, n + 4:] == 7).all()
        _check_kq(wide[:, 4:n + 4], x, ref)


@pytest.fixture(scope="module")
def kq_model(tmp_path_factory):
    """A tiny Q4_K_M-like GGUF whose every matrix is a K-quant (hidden 256: whole super-
    blocks): q/k/v/o, gate/up Q4_K, down and the LM head Q6_K."""
    import fixtures.tiny_gguf as tg
    from iterserve.model.loader import load_model
    path = tmp_path_factory.mktemp("kq") / "kq.gguf"
    saved = tg.TINY_LLAMA
    tg.TINY_LLAMA = KQ_MODEL
    try:
        tg.write_tiny_llama_gguf(path, seed=7, tensor_types={
            **{n: "Q4_K" for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight",
                                   "attn_output.weight", "ffn_gate.weight", "ffn_up.weight")},
            "ffn_down.weight": "Q6_K", "output.weight": "Q6_K"})
    finally:
        tg.TINY_LLAMA = saved
    return load_model(str(path))


def _decode(loaded, nreq: int, fused: bool, mode: str):
    """nreq prompts prefilled, then 4 decode steps of nreq rows in `mode`: every step's
    logits and the tokens."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(3 + i % 4)] for i in range(nreq)]
    tokens, seen = greedy_steps(loaded, prompts, mode, fused, 5, num_blocks=64, block_size=4)
    return seen, tokens


def test_kquant_model_fused_decode_equals_per_module_path_at_1_to_12_rows(kq_model):
    """Decode steps of 1, 2, 5, 8 and 12 rows of an all-K-quant model in auto mode (the int8
    K-quant decode kernels): the fused decode layers give bit-identical logits to the
    per-module path; and the logits stay within 8-bit-activation error of the float path."""
    from gguf import GGMLQuantizationType as Q
    types = {int(t) for m in kq_model.model.modules() if getattr(m, "encoded", None) is not None
             for t in m.encoded.types}
    assert {int(Q.Q4_K), int(Q.Q6_K)} <= types
    for nreq in (1, 2, 5, 8, 12):
        on, tok_on = _decode(kq_model, nreq, True, "auto")
        off, tok_off = _decode(kq_model, nreq, False, "auto")
        assert tok_on == tok_off and len(on) == len(off) == 5
        for a, b in zip(on, off):
            assert torch.equal(a, b), nreq
        flt, _ = _decode(kq_model, nreq, True, "float")
        for a, b in zip(on[1:], flt[1:]):                  # the decode steps
            rel = ((a - b).pow(2).mean().sqrt() / b.std()).item()
            assert 0 < rel < 0.1, (nreq, rel)                # 0: int8 did not run

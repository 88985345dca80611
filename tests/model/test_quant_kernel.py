"""The native decode GEMM over GGUF blocks (model/quant.py, model/kernels/qgemm.c).

Blocks must dequantise bit-for-bit like the `gguf` package, the kernel must equal a float32
GEMM over those dequantised weights (up to summation order) for every row-tile remainder and
thread split, and a model loaded from an all-quantised GGUF must give the same logits with the
kernel on as with it off (which also proves the blocks were un-permuted and fused right).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fixtures.tiny_gguf import load_all_quant_model, write_tiny_llama_gguf
from fixtures.tiny_models import Blocks, advance, chunk, greedy, request, step
from iterserve.model import kernels
from iterserve.model.quant import BlockQuantWeight

pytestmark = pytest.mark.skipif(not (kernels._cpu_has_avx2_fma() and kernels._compiler()),
                                reason="needs an x86-64 AVX2/FMA CPU and a C compiler")

KINDS = ["Q4_0", "Q4_1", "Q8_0"]


def _blocks(kind: str, n: int, k: int, seed: int = 0):
    from gguf import GGMLQuantizationType, quants
    w = (np.random.default_rng(seed).standard_normal((n, k)) * 0.05).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType[kind])
    ref = quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k)
    return BlockQuantWeight.from_gguf(kind, raw, (n, k)), torch.from_numpy(ref)


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_dequantise_bit_for_bit_like_the_gguf_package(kind):
    bq, ref = _blocks(kind, 70, 96)
    assert bq.shape == (70, 96)
    assert torch.equal(bq.dequantize(), ref)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_equals_float_gemm_over_the_dequantised_weights(kind, rows, threads):
    fn = kernels.qgemm()
    assert fn is not None, kernels.unavailable
    bq, w = _blocks(kind, 300, 160, seed=rows)      # 300 columns: uneven thread and chunk splits
    x = torch.randn(rows, 160)
    y = bq.matmul(x, fn, threads)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 8, 12])
def test_long_rows_split_into_k_chunks_sum_like_one_gemm(rows):
    """K = 1,600: an 8-row activation tile exceeds the kernel's L1 budget, so the dot products
    are summed over K chunks (the first sets y, the others add to it)."""
    fn = kernels.qgemm()
    bq, w = _blocks("Q4_1", 70, 1600, seed=rows)
    x = torch.randn(rows, 1600)
    torch.testing.assert_close(bq.matmul(x, fn, 2), F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_rows_and_cat_reorder_and_fuse_like_the_floats():
    a, wa = _blocks("Q4_1", 8, 64, seed=1)
    b, wb = _blocks("Q4_1", 4, 64, seed=2)
    perm = np.array([3, 1, 0, 2, 7, 6, 5, 4])
    assert torch.equal(a.rows(perm).dequantize(), wa[perm])
    assert torch.equal(BlockQuantWeight.cat([a, b]).dequantize(), torch.cat([wa, wb]))
    c, _ = _blocks("Q8_0", 4, 64)
    assert BlockQuantWeight.cat([a, c]) is None          # mixed kinds: no fused blocks
    assert BlockQuantWeight.cat([a, None]) is None


def test_building_into_an_empty_cache_dir_compiles_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("ITERSERVE_CACHE_DIR", str(tmp_path))
    kernels.clear_cache()
    try:
        assert kernels.qgemm() is not None, kernels.unavailable
        built = list((tmp_path / "kernels").glob("iterserve-*.so"))
        assert len(built) == 1
        assert kernels._build(kernels._compiler()) == built[0]      # cached: no rebuild
    finally:
        kernels.clear_cache()


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
    (weights engineer: row segments since issue 12)."""
    from gguf import GGMLQuantizationType as Q
    from iterserve.model.loader import load_model
    path = tmp_path / "mixed.gguf"
    write_tiny_llama_gguf(path)
    model = load_model(str(path)).model
    assert model.layers[0].self_attn.qkv_proj.quant.types == [Q.F32, Q.F16, Q.Q4_0]
    assert model.layers[0].self_attn.o_proj.quant.types == [Q.Q4_1]      # Q4_1 alone

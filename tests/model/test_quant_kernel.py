"""The native kernels at the model level (model/kernels/, model/weights.py).

The library builds into an empty cache dir and is reused from it, and a model loaded from an
all-quantised GGUF gives the same logits with the kernels on as with them off (which also
proves the blocks were un-permuted and fused right). Per-type kernel accuracy against gguf-py
is tests/model/test_gguf_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.tiny_gguf import load_all_quant_model, write_tiny_llama_gguf
from fixtures.tiny_models import Blocks, advance, chunk, greedy, request, step
from iterserve.model import kernels

pytestmark = pytest.mark.skipif(not (kernels._cpu_has_avx2_fma() and kernels._compiler()),
                                reason="needs an x86-64 AVX2/FMA CPU and a C compiler")

def test_building_into_an_empty_cache_dir_compiles_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("ITERSERVE_CACHE_DIR", str(tmp_path))
    kernels.clear_cache()
    try:
        assert kernels.available(), kernels.unavailable
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

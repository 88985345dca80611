"""Every family's GGUF, made by llama.cpp's own converter from a tiny HF checkpoint, loads and
computes what HF transformers computes on the checkpoint: the loader's tensor names, Q/K
un-permutation, Gemma's shifted norms, Phi-3's fused tensors and LongRoPE factors, stacked
experts and the metadata keys are all llama.cpp's. F32 files compare at float32 tolerance;
a Q8_0 file (the converter quantises it) must agree on greedy tokens."""

from __future__ import annotations

import pytest
import torch

from fixtures.llama_cpp import convert, skip_reason
from fixtures.tiny_models import (FAMILY_ARCHS, Blocks, advance, chunk, greedy,
                                  load_hf_reference, make_tiny_model_dir, request, step)
from iterserve.model.loader import load_model
from iterserve.model.runner import ModelRunner

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

# Where llama.cpp fixes what HF configures, the HF checkpoint follows llama.cpp's rule: the
# query scale is 1/sqrt(head_dim), Gemma 3's every 6th layer is global, SmolLM3's every 4th
# is NoPE, Qwen3-MoE has no dense layers, and YaRN's correction range is rounded.
GGUF_OVERRIDES = {
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3_text": dict(query_pre_attn_scalar=16, num_hidden_layers=6, layer_types=None),
    "smollm3": dict(no_rope_layer_interval=4),
    "qwen3_moe": dict(mlp_only_layers=[]),
    "gpt_oss": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "original_max_position_embeddings": 64,
                                     "rope_theta": 150000.0}),
}
PROMPT = list(range(3, 44))          # past the sliding windows (6) and LongRoPE's 32


@pytest.fixture(scope="module", params=FAMILY_ARCHS)
def converted(request, tmp_path_factory):
    arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    d = make_tiny_model_dir(tmp, arch, **GGUF_OVERRIDES.get(arch, {}))
    return arch, d, convert(d, tmp / f"{arch}.f32.gguf"), load_hf_reference(d)


def test_config_from_gguf_matches_the_checkpoint(converted):
    arch, d, gguf, ref = converted
    a, b = load_model(str(d)).config, load_model(str(gguf)).config
    for field in ("model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "layer_types", "layer_window", "sliding_window", "rope_theta",
                  "local_rope_theta", "partial_rotary_factor", "attention_scale",
                  "attn_logit_softcapping", "final_logit_softcapping", "embedding_multiplier",
                  "residual_multiplier", "logits_scaling", "num_experts", "num_experts_per_tok",
                  "moe_layers", "router", "norm_topk_prob", "expert_act", "tie_word_embeddings"):
        va, vb = getattr(a, field), getattr(b, field)
        if isinstance(va, float) and vb is not None:
            assert vb == pytest.approx(va, rel=1e-6), field
        elif field == "rope_layers" or field == "layer_types":
            assert (va or None) == (vb or None) or set(va or []) == {"full_attention"}, field
        else:
            assert va == vb, field


def test_gguf_logits_match_hf(converted):
    arch, d, gguf, ref = converted
    runner = ModelRunner(load_model(str(gguf)), num_blocks=64, block_size=4, sampler=greedy)
    blocks = Blocks(64, 4)
    r = request("r", PROMPT)
    for _ in range(4):                                 # the prompt, then decodes
        out = step(chunk(blocks, r))
        logits = runner.compute_logits(out)
        with torch.no_grad():
            expect = ref(torch.tensor([r.all_token_ids])).logits[0, -1].float()
        torch.testing.assert_close(logits[0], expect, atol=2e-5, rtol=1e-4)
        advance(out, {"r": greedy(logits, [r])[0]})


def test_q8_0_gguf_follows_hf(converted, tmp_path):
    """A quantised file (the converter's Q8_0): along HF's own greedy continuation, the
    logits stay within Q8_0's rounding of HF's, and the top token agrees wherever HF's top
    two are not a near tie (random tiny weights have some)."""
    arch, d, gguf, ref = converted
    q8 = convert(d, tmp_path / f"{arch}.q8_0.gguf", outtype="q8_0")
    runner = ModelRunner(load_model(str(q8)), num_blocks=64, block_size=4, sampler=greedy)
    blocks = Blocks(64, 4)
    r = request("r", PROMPT)
    for _ in range(6):
        out = step(chunk(blocks, r))
        got = runner.compute_logits(out)[0]
        with torch.no_grad():
            want = ref(torch.tensor([r.all_token_ids])).logits[0, -1].float()
        assert float((got - want).abs().max()) < 0.25 * float(want.std()), arch
        top2 = want.topk(2).values
        if float(top2[0] - top2[1]) > 0.02:
            assert int(got.argmax()) == int(want.argmax()), arch
        advance(out, {"r": greedy(want[None], [r])[0]})      # HF's token: teacher forcing

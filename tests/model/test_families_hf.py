"""Every family on the one decoder matches HF transformers (float32) through the paged runner:
Gemma 2/3 (sliding + global layers, soft-caps, q/k norms, per-layer-type RoPE), Phi-3 (fused
tensors, partial rotary, LongRoPE short and long factors), SmolLM3 (NoPE layers), Granite
(multipliers) and the Mixture-of-Experts Qwen3-MoE, Mixtral and gpt-oss (routing, sinks,
biases, clamped SwiGLU). Prefill logits, chunked prefill with a cached prefix, mixed
prefill + decode steps, and greedy continuations past the sliding windows."""

from __future__ import annotations

import pytest
import torch

from fixtures.tiny_models import (FAMILY_ARCHS, Blocks, advance, chunk, greedy,
                                  load_hf_reference, make_tiny_model_dir, request, step)
from iterserve.model.loader import load_model
from iterserve.model.runner import ModelRunner

ATOL = 2e-5


def ref_last_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0, -1].float()


def runner_for(loaded, block_size: int = 4) -> ModelRunner:
    return ModelRunner(loaded, num_blocks=128, block_size=block_size, sampler=greedy)


# Longer than the sliding windows (6) and, for Phi-3, than LongRoPE's pretraining length (32)
PROMPTS = [list(range(3, 44)),
           [3, 4, 9],
           [100, 200, 300, 400, 500, 1, 250, 77, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module", params=FAMILY_ARCHS)
def family(request, tmp_path_factory):
    d = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, d, load_model(str(d)), load_hf_reference(d)


def test_prefill_logits_match_hf(family):
    arch, d, loaded, ref = family
    runner, blocks = runner_for(loaded), Blocks(128, 4)
    reqs = [request(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    logits = runner.compute_logits(step(*[chunk(blocks, r) for r in reqs]))
    for row, p in zip(logits, PROMPTS):
        torch.testing.assert_close(row, ref_last_logits(ref, p), atol=ATOL, rtol=1e-4)


def _step_matches_hf(runner, out, ref) -> None:
    """Run the step; each sampling row's logits are HF's for that request's tokens so far;
    advance the requests by their greedy token."""
    logits = runner.compute_logits(out)
    sampling = [c.request for c in out.chunks if c.sample]
    for row, q in zip(logits, sampling):
        torch.testing.assert_close(row, ref_last_logits(ref, q.all_token_ids),
                                   atol=ATOL, rtol=1e-4)
    advance(out, {q.request_id: greedy(row[None], [q])[0] for row, q in zip(logits, sampling)})


def test_chunked_prefill_and_mixed_steps_match_hf(family):
    arch, d, loaded, ref = family
    runner, blocks = runner_for(loaded), Blocks(128, 4)
    r = request("r", PROMPTS[2])
    out = step(chunk(blocks, r, 7))                       # a chunk, then the rest on a prefix
    advance(out, runner.execute(out))
    short = request("s", [5, 6, 7, 8])
    for s in range(8):                                    # decodes of r past the window, with
        chunks = [chunk(blocks, r)]                       # a prompt's chunks in the same steps
        if short.num_tokens_to_compute:
            chunks.append(chunk(blocks, short, min(3, short.num_tokens_to_compute)))
        out = step(*chunks, step_no=s)
        _step_matches_hf(runner, out, ref)


def test_greedy_continuation_is_identical_to_hf_generate(family):
    arch, d, loaded, ref = family
    runner, blocks = runner_for(loaded), Blocks(128, 4)
    reqs = [request(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    for _ in range(10):
        out = step(*[chunk(blocks, r) for r in reqs])
        advance(out, runner.execute(out))
    for r in reqs:
        with torch.no_grad():
            expect = ref.generate(torch.tensor([r.prompt_token_ids]), max_new_tokens=10,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
        assert r.output_token_ids == expect[0, len(r.prompt_token_ids):].tolist(), arch


def test_gpt_oss_sinks_run_on_the_native_attention_kernels(family, monkeypatch):
    """gpt-oss's sinks fold into the native kernels' softmax (kernels/attention_core.h), so
    its prefill chunks and decodes never take the eager path (the HF parity above holds on
    the kernels); soft-capped families (Gemma 2) still do."""
    arch, d, loaded, ref = family
    if arch != "gpt_oss":
        pytest.skip("the sinks family")
    from iterserve.model import llama

    def eager(*a, **k):
        raise AssertionError("gpt-oss attention took the eager path")

    monkeypatch.setattr(llama, "eager_paged_attention", eager)
    runner, blocks = runner_for(loaded), Blocks(128, 4)
    r, s = request("r", PROMPTS[0]), request("s", PROMPTS[2])
    out = step(chunk(blocks, r))
    advance(out, runner.execute(out))
    for i in range(4):                                    # decodes of r beside s's chunks
        out = step(chunk(blocks, r), chunk(blocks, s, min(4, s.num_tokens_to_compute)),
                   step_no=i)
        _step_matches_hf(runner, out, ref)

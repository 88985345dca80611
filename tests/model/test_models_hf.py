"""Each supported architecture matches HF transformers (float32) through the paged runner:
prefill, chunked prefill, mixed prefill+decode steps, greedy continuations, RoPE scaling,
tied embeddings and sharded weights."""

from __future__ import annotations

import pytest
import torch

from fixtures.tiny_models import TINY_ARCHS, load_hf_reference, make_tiny_model_dir
from iterserve.model.loader import load_model
from iterserve.model.runner import ModelRunner
from fixtures.tiny_models import Blocks, advance, chunk, greedy, request, step

ATOL = 2e-5


def ref_last_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0, -1].float()


def runner_for(model_dir, block_size: int = 4) -> ModelRunner:
    return ModelRunner(load_model(str(model_dir)), num_blocks=128, block_size=block_size,
                       sampler=greedy)


PROMPTS = [[5, 17, 99, 300, 42, 7, 8, 9, 10, 11, 12],
           [3, 4],
           [100, 200, 300, 400, 500, 1, 250, 77]]


@pytest.fixture(scope="module", params=TINY_ARCHS)
def arch_dir(request, tmp_path_factory):
    d = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)
    return d, load_hf_reference(d)


def test_prefill_logits_match_hf(arch_dir):
    d, ref = arch_dir
    runner, blocks = runner_for(d), Blocks(128, 4)
    reqs = [request(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    logits = runner.compute_logits(step(*[chunk(blocks, r) for r in reqs]))
    for row, p in zip(logits, PROMPTS):
        torch.testing.assert_close(row, ref_last_logits(ref, p), atol=ATOL, rtol=1e-4)


def test_chunked_prefill_matches_one_shot_prefill(arch_dir):
    d, ref = arch_dir
    runner, blocks = runner_for(d), Blocks(128, 4)
    r = request("r", PROMPTS[0])
    for n in (4, 5):                                   # 11 tokens in chunks of 4, 5, 2
        out = step(chunk(blocks, r, n))
        assert runner.compute_logits(out).shape[0] == 0   # not at the end: nothing samples
        advance(out)
    logits = runner.compute_logits(step(chunk(blocks, r)))
    torch.testing.assert_close(logits[0], ref_last_logits(ref, PROMPTS[0]), atol=ATOL, rtol=1e-4)


def test_mixed_step_of_decodes_and_a_prefill_chunk_matches_hf(arch_dir):
    d, ref = arch_dir
    runner, blocks = runner_for(d), Blocks(128, 4)
    reqs = [request(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    out = step(*[chunk(blocks, r) for r in reqs])
    advance(out, runner.execute(out))
    late = request("late", [9, 8, 7, 6, 5, 4, 3, 2, 11, 13])
    for s in range(3):
        # decodes of different lengths plus a chunk of a new prompt, in ONE step
        chunks = [chunk(blocks, r) for r in reqs]
        if late.num_tokens_to_compute:
            chunks.insert(1, chunk(blocks, late, min(4, late.num_tokens_to_compute)))
        out = step(*chunks, step_no=s)
        logits = runner.compute_logits(out)
        sampling = [c.request for c in out.chunks if c.sample]
        assert len(sampling) == logits.shape[0]
        for row, r in zip(logits, sampling):
            torch.testing.assert_close(row, ref_last_logits(ref, r.all_token_ids), atol=ATOL, rtol=1e-4)
        advance(out, {r.request_id: greedy(row[None], [r])[0] for row, r in zip(logits, sampling)})


def test_greedy_continuation_is_identical_to_hf_generate(arch_dir):
    d, ref = arch_dir
    runner, blocks = runner_for(d), Blocks(128, 4)
    reqs = [request(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    for _ in range(12):
        out = step(*[chunk(blocks, r) for r in reqs])
        advance(out, runner.execute(out))
    for r in reqs:
        with torch.no_grad():
            expect = ref.generate(torch.tensor([r.prompt_token_ids]), max_new_tokens=12,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
        assert r.output_token_ids == expect[0, len(r.prompt_token_ids):].tolist()


@pytest.mark.parametrize("overrides", [
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    {"tie_word_embeddings": True},
    {"rope_theta": 500000.0, "num_key_value_heads": 1},
], ids=["llama3-rope", "linear-rope", "yarn-rope", "tied-embeddings", "theta-mqa"])
def test_config_variants_match_hf(tmp_path, overrides):
    d = make_tiny_model_dir(tmp_path, "llama", **overrides)
    ref = load_hf_reference(d)
    runner, blocks = runner_for(d), Blocks(128, 4)
    prompt = list(range(3, 40))
    logits = runner.compute_logits(step(chunk(blocks, request("r", prompt))))
    torch.testing.assert_close(logits[0], ref_last_logits(ref, prompt), atol=ATOL, rtol=1e-4)


def test_sharded_safetensors_load_like_a_single_file(tmp_path):
    one = load_model(str(make_tiny_model_dir(tmp_path, "qwen2", name="one")))
    sharded_dir = make_tiny_model_dir(tmp_path, "qwen2", name="sharded", shards=3)
    assert len(list(sharded_dir.glob("*.safetensors"))) == 3
    sharded = load_model(str(sharded_dir))
    for (n, a), (_, b) in zip(one.model.state_dict().items(), sharded.model.state_dict().items()):
        assert torch.equal(a, b), n


def test_mistral_sliding_window_matches_hf_past_the_window(tmp_path):
    d = make_tiny_model_dir(tmp_path, "mistral", sliding_window=6)
    ref = load_hf_reference(d)
    runner, blocks = runner_for(d), Blocks(128, 4)
    r = request("r", list(range(3, 20)))                  # 17 tokens > window of 6
    out = step(chunk(blocks, r, 9))
    advance(out, runner.execute(out))
    logits = runner.compute_logits(step(chunk(blocks, r)))  # a chunk with a cached prefix
    torch.testing.assert_close(logits[0], ref_last_logits(ref, r.all_token_ids), atol=ATOL, rtol=1e-4)
    for _ in range(3):                                     # decodes past the window
        out = step(chunk(blocks, r))
        advance(out, runner.execute(out))
        logits = runner.compute_logits(step(chunk(blocks, r)))
        torch.testing.assert_close(logits[0], ref_last_logits(ref, r.all_token_ids),
                                   atol=ATOL, rtol=1e-4)

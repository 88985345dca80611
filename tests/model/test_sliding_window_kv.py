"""Sliding-window layers hold only their window's KV blocks (core/sliding_window.py): Gemma's
and gpt-oss's sliding layers read a pool of their own through window tables, and the logits
stay HF's over a prompt many windows long, in chunks and decodes."""

from __future__ import annotations

import pytest
import torch

from fixtures.tiny_models import (Blocks, advance, chunk, greedy, load_hf_reference,
                                  make_tiny_model_dir, request, step)
from iterserve.core.sliding_window import SlidingWindowBlocks, cdiv
from iterserve.model.loader import load_model
from iterserve.model.runner import ModelRunner

BS, CHUNK = 4, 8


def test_window_tables_free_what_the_window_left_behind():
    w = SlidingWindowBlocks(window=6, block_size=4, max_tokens_per_step=8, num_blocks=12)
    assert w.max_blocks_per_request == cdiv(6 - 1 + 8, 4) + 1 == 5
    t = w.table("a", 0, 8)                      # positions 0..7: blocks 0, 1
    assert len(t) == 2 and w.num_blocks_of("a") == 2
    t = w.table("a", 8, 8)                      # reads from 3: blocks 0..3
    assert w.num_blocks_of("a") == 4
    t = w.table("a", 16, 8)                     # reads from 11: blocks 2..5, 0 and 1 freed
    assert w.num_blocks_of("a") == 4 and t[0] == 0 and t[1] == 0 and len(t) == 6
    live = set(t[2:])
    assert len(live) == 4
    for pos in range(24, 60):                   # decodes: at most the window's blocks
        w.table("a", pos, 1)
        assert w.num_blocks_of("a") <= cdiv(6, 4) + 1
    w.table("b", 0, 8)
    assert not w.consistency_violations()
    w.release("a")
    w.release("b")
    assert w.blocks_in_use == 0 and not w.consistency_violations()
    assert w.peak_blocks_per_request <= w.max_blocks_per_request


def test_a_chunk_longer_than_the_sizing_is_refused():
    w = SlidingWindowBlocks(window=6, block_size=4, max_tokens_per_step=4, num_blocks=20)
    with pytest.raises(RuntimeError, match="longer than the sizing"):
        w.table("a", 0, 16)


@pytest.mark.parametrize("arch", ["gemma3_text", "gemma2", "gpt_oss"])
def test_window_pools_keep_hf_logits_over_a_long_prompt(tmp_path, arch):
    d = make_tiny_model_dir(tmp_path, arch)
    ref = load_hf_reference(d)
    loaded = load_model(str(d))
    runner = ModelRunner(loaded, num_blocks=64, block_size=BS, sampler=greedy,
                         max_tokens_per_step=CHUNK, max_num_seqs=2)
    wb = runner.window_blocks
    assert wb is not None and wb.num_blocks < 64
    sliding = [i for i, w in enumerate(loaded.config.layer_windows()) if w]
    full = [i for i in range(loaded.config.num_layers) if i not in sliding]
    assert all(runner.kv_cache.k[i].shape[0] == wb.num_blocks for i in sliding)
    assert all(runner.kv_cache.k[i].shape[0] == 64 for i in full)
    blocks = Blocks(64, BS)
    prompt = [(7 * i) % 500 + 3 for i in range(61)]
    r, other = request("r", prompt), request("o", [5, 9, 13, 21, 34])
    while r.num_computed_tokens < len(prompt):            # the prompt in chunks of 8 ...
        chunks = [chunk(blocks, r, min(CHUNK, r.num_tokens_to_compute))]
        if len(other.output_token_ids) < 4:
            chunks.append(chunk(blocks, other))           # ... beside another request
        out = step(*chunks)
        logits = runner.compute_logits(out)
        for row, q in zip(logits, [c.request for c in out.chunks if c.sample]):
            with torch.no_grad():
                want = ref(torch.tensor([q.all_token_ids])).logits[0, -1].float()
            torch.testing.assert_close(row, want, atol=2e-5, rtol=1e-4)
        advance(out, {c.request.request_id: greedy(row[None], [c.request])[0]
                      for row, c in zip(logits, [c for c in out.chunks if c.sample])})
        assert wb.num_blocks_of("r") <= wb.max_blocks_per_request
    for _ in range(5):                                    # decodes past many windows
        out = step(chunk(blocks, r))
        logits = runner.compute_logits(out)
        with torch.no_grad():
            want = ref(torch.tensor([r.all_token_ids])).logits[0, -1].float()
        torch.testing.assert_close(logits[0], want, atol=2e-5, rtol=1e-4)
        advance(out, {"r": greedy(logits, [r])[0]})
        assert wb.num_blocks_of("r") <= cdiv(loaded.config.layer_window, BS) + 1
    full_blocks = cdiv(r.num_tokens, BS)
    assert wb.peak_blocks_per_request < full_blocks / 2
    stats = runner.memory_plan["kv_cache"]["layer_groups"]
    assert stats[0]["layers"] == full and stats[1]["layers"] == sliding
    assert stats[1]["peak_blocks_per_request"] == wb.peak_blocks_per_request


def test_no_window_pools_with_swap_space_or_prefix_caching(tmp_path):
    loaded = load_model(str(make_tiny_model_dir(tmp_path, "gemma3_text")))
    for kw in (dict(num_swap_blocks=8), dict(prefix_caching=True), dict()):
        runner = ModelRunner(loaded, num_blocks=64, block_size=BS, sampler=greedy,
                             max_num_seqs=2, **({"max_tokens_per_step": CHUNK} if kw else {}),
                             **kw)
        assert runner.window_blocks is None
        assert all(k.shape[0] == 64 for k in runner.kv_cache.k)


def test_prefix_cache_and_kv_tiers_keep_every_layer_and_the_window_pool_tokens(tmp_path):
    """With prefix caching, a RAM tier and a disk tier, a sliding-window model's layers
    all keep a request's whole KV (a cached block must serve the sliding layers too, and a
    tier copies a block's every layer): the window pools are off, and a prompt served warm
    from the disk tier by a restarted engine gives the tokens of the window-pool engine
    (no cache), which follows HF's logits (the test above)."""
    from iterserve import LLM, SamplingParams

    d = make_tiny_model_dir(tmp_path / "m", "gemma3_text")
    kw = dict(max_model_len=256, block_size=BS, kernel_activations="float",
              num_kv_blocks=96, max_num_batched_tokens=16, max_num_seqs=2)
    greedy_params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 400 for i in range(70)]}
               for j in range(2)]

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy_params,
                                                              use_tqdm=False)]

    windowed = LLM(str(d), enable_prefix_caching=False, **kw)
    assert windowed.engine.stats()["memory"]["kv_cache"].get("layer_groups")
    want = tokens(windowed)
    windowed.engine.shutdown()
    tiers = tmp_path / "kv"
    first = LLM(str(d), kv_offload_dir=str(tiers), **kw)
    assert "layer_groups" not in first.engine.stats()["memory"]["kv_cache"]
    assert tokens(first) == want
    first.engine.shutdown()
    second = LLM(str(d), kv_offload_dir=str(tiers), **kw)
    outs = second.generate(prompts, greedy_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.num_cached_tokens >= 64 for o in outs)
    second.engine.shutdown()

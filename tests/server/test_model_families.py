"""The families beyond Llama served as a user meets them: a Gemma 3 checkpoint through the
official openai client over real HTTP, with /v1/engine/stats showing that its sliding
layers hold only their window of KV blocks while the global layers hold the whole prompt
(without prefix caching), and with prefix caching on (the default) every layer keeps the
whole prompt so a cached prefix serves the sliding layers too, with the same greedy text."""

from __future__ import annotations

import httpx
import openai
import pytest

from fixtures.tiny_models import make_tiny_model_dir

BS, BUDGET = 4, 16


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("gemma3"), "gemma3_text")


@pytest.fixture(scope="module")
def gemma(start_server):
    return start_server(block_size=BS, num_kv_blocks=256, max_model_len=512,
                        max_num_batched_tokens=BUDGET, max_num_seqs=4,
                        enable_prefix_caching=False)


@pytest.fixture(scope="module")
def gemma_cached(start_server):
    from iterserve.server.serving_config import ServingConfig
    return start_server(block_size=BS, num_kv_blocks=256, max_model_len=512,
                        max_num_batched_tokens=BUDGET, max_num_seqs=4,
                        serving_config=ServingConfig(prompt_tokens_details=True))


def test_gemma3_chat_and_completions(gemma):
    client = openai.OpenAI(base_url=gemma.v1, api_key="x")
    r = client.chat.completions.create(model=gemma.model, max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": "Hello there"}])
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    c = client.completions.create(model=gemma.model, prompt="The quick brown fox", max_tokens=5,
                                  temperature=0)
    assert c.usage.completion_tokens == 5


def test_sliding_layers_hold_only_their_window_on_a_long_prompt(gemma):
    client = openai.OpenAI(base_url=gemma.v1, api_key="x")
    prompt = [(11 * i) % 500 + 3 for i in range(300)]
    seen = []
    stream = client.completions.create(model=gemma.model, prompt=prompt, max_tokens=24,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for _ in stream:
        s = httpx.get(gemma.base_url + "/v1/engine/stats").json()
        groups = s["memory"]["kv_cache"]["layer_groups"]
        seen.append((s["num_blocks"] - s["num_free_blocks"], groups[1]))
    full_used, window = max(seen, key=lambda x: x[0])
    assert full_used >= -(-len(prompt) // BS)          # the global layers: every block
    cap = window["max_blocks_per_request"]
    assert cap == -(-(6 - 1 + BUDGET) // BS) + 1
    assert all(g["blocks_in_use"] <= cap for _, g in seen)
    assert window["peak_blocks_per_request"] <= cap < full_used / 4
    assert window["window"] == 6 and window["layers"] == [0, 1, 3]


def test_prefix_caching_keeps_every_layer_and_the_same_greedy_text(gemma, gemma_cached):
    """A cached prefix must hold the sliding layers' KV as well: the window pools are off
    with prefix caching, and a repeated long prompt is served from the cache with the text
    the window-pool server (no cache) gives."""
    prompt = [(7 * i) % 400 + 5 for i in range(200)]

    def run(srv):
        client = openai.OpenAI(base_url=srv.v1, api_key="x")
        r = client.completions.create(model=srv.model, prompt=prompt, max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})
        return r.choices[0].text, r.usage

    want, _ = run(gemma)
    stats = httpx.get(gemma_cached.base_url + "/v1/engine/stats").json()
    assert "layer_groups" not in stats["memory"]["kv_cache"]
    first, u1 = run(gemma_cached)
    again, u2 = run(gemma_cached)
    assert first == want and again == want
    assert u2.prompt_tokens_details.cached_tokens >= len(prompt) - 2 * BS

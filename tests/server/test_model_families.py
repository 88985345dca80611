"""The families beyond Llama served as a user meets them: a Gemma 3 checkpoint through the
official openai client over real HTTP, with /v1/engine/stats showing that its sliding
layers hold only their window of KV blocks while the global layers hold the whole prompt."""

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
                        max_num_batched_tokens=BUDGET, max_num_seqs=4)


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

"""prompt_logprobs and echo + logprobs through the official openai client (extra_body), on a
server whose chunked prefill is forced small; values checked against HF transformers."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

PROMPT = "The quick brown fox jumps over the lazy dog again and again"


@pytest.fixture(scope="module")
def small_chunks(start_server):
    return start_server(max_num_batched_tokens=6, block_size=4, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def client(small_chunks) -> openai.OpenAI:
    return openai.OpenAI(base_url=small_chunks.v1, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from fixtures.tiny_models import load_hf_reference
    hf = load_hf_reference(tiny_model_dir)

    def lps(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return lps


def _ids(server, text: str) -> list[int]:
    return server.engine.tokenizer.encode(text)


def check(plps, ids, ref, k, tok):
    assert len(plps) == len(ids) and plps[0] is None
    for p in range(1, len(ids)):
        row = ref[p - 1]
        entry = plps[p]
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {str(t) for t in set(top) | {ids[p]}}
        e = entry[str(ids[p])]
        assert e["logprob"] == pytest.approx(row[ids[p]].item(), abs=1e-4)
        assert e["rank"] == int((row > row[ids[p]]).sum()) + 1
        assert e["decoded_token"] == tok.decode([ids[p]], skip_special_tokens=False)


@pytest.mark.parametrize("k", [0, 2])
def test_completions_prompt_logprobs_match_hf(client, small_chunks, reference, k):
    r = client.completions.create(model=small_chunks.model, prompt=PROMPT, max_tokens=2,
                                  temperature=0, extra_body={"prompt_logprobs": k})
    ids = _ids(small_chunks, PROMPT)
    raw = r.model_dump()
    check(raw["choices"][0]["prompt_logprobs"], ids, reference(ids), k,
          small_chunks.engine.tokenizer)
    assert r.usage.prompt_tokens == len(ids)


def test_prompt_logprobs_per_prompt_and_streamed(client, small_chunks, reference):
    prompts = [PROMPT, "A second, shorter prompt"]
    r = client.completions.create(model=small_chunks.model, prompt=prompts, max_tokens=2, n=2,
                                  temperature=0, extra_body={"prompt_logprobs": 1})
    tok = small_chunks.engine.tokenizer
    for c in r.model_dump()["choices"]:
        ids = _ids(small_chunks, prompts[c["index"] // 2])
        check(c["prompt_logprobs"], ids, reference(ids), 1, tok)
    stream = client.completions.create(model=small_chunks.model, prompt=PROMPT, max_tokens=3,
                                       temperature=0, stream=True,
                                       extra_body={"prompt_logprobs": 1})
    chunks = [c.model_dump() for c in stream]
    with_plp = [c for c in chunks if c["choices"] and c["choices"][0].get("prompt_logprobs")]
    assert len(with_plp) == 1 and with_plp[0] is chunks[0]
    ids = _ids(small_chunks, PROMPT)
    check(with_plp[0]["choices"][0]["prompt_logprobs"], ids, reference(ids), 1, tok)


def test_echo_with_logprobs_gives_openai_prompt_tokens_first(client, small_chunks, reference):
    r = client.completions.create(model=small_chunks.model, prompt=PROMPT, max_tokens=3,
                                  temperature=0, echo=True, logprobs=2)
    ids = _ids(small_chunks, PROMPT)
    tok = small_chunks.engine.tokenizer
    ch = r.choices[0]
    lp = ch.logprobs
    n_out = r.usage.completion_tokens
    assert len(lp.tokens) == len(ids) + n_out
    assert lp.tokens[:len(ids)] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(ids)
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(ref[p - 1][ids[p]].item(), abs=1e-4)
        top = lp.top_logprobs[p]
        want = {tok.decode([t], skip_special_tokens=False)
                for t in ref[p - 1].topk(2).indices.tolist()}
        assert want <= set(top) and len(top) <= 3
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert ch.text.startswith(PROMPT)
    # the generated part's offsets continue after the echoed prompt
    assert lp.text_offset[len(ids)] == len(PROMPT)
    # streamed: the same tokens and logprobs, accumulated
    stream = client.completions.create(model=small_chunks.model, prompt=PROMPT, max_tokens=3,
                                       temperature=0, echo=True, logprobs=2, stream=True)
    toks, vals = [], []
    for c in stream:
        if c.choices and c.choices[0].logprobs:
            toks += c.choices[0].logprobs.tokens
            vals += c.choices[0].logprobs.token_logprobs
    assert toks == lp.tokens
    assert vals[0] is None and vals[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_chat_prompt_logprobs_cover_the_rendered_prompt(client, small_chunks, reference):
    msgs = [{"role": "user", "content": "Hello there, how are you?"}]
    r = client.chat.completions.create(model=small_chunks.model, messages=msgs, max_tokens=2,
                                       temperature=0, extra_body={"prompt_logprobs": 1})
    plps = r.model_dump()["prompt_logprobs"]
    assert len(plps) == r.usage.prompt_tokens and plps[0] is None
    tok = small_chunks.engine.tokenizer
    ids = tok.encode(tok.apply_chat_template(msgs, True), add_special_tokens=False)
    check(plps, ids, reference(ids), 1, tok)
    # streamed: the field comes once, in the first chunk after the prompt is done
    stream = httpx.post(small_chunks.v1 + "/chat/completions", timeout=60, json={
        "messages": msgs, "max_tokens": 2, "temperature": 0, "stream": True,
        "prompt_logprobs": 1})
    events = [json.loads(line[6:]) for line in stream.text.splitlines()
              if line.startswith("data: {")]
    sent = [e["prompt_logprobs"] for e in events if "prompt_logprobs" in e]
    assert sent == [plps]


@pytest.mark.parametrize("value", [-1, 21, "3", 1.5])
def test_bad_prompt_logprobs_is_a_400_naming_it(small_chunks, value):
    r = httpx.post(small_chunks.v1 + "/completions", timeout=30,
                   json={"prompt": "x", "max_tokens": 1, "prompt_logprobs": value})
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["param"]

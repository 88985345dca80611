"""Each family beyond Llama served through the real server, as a user meets it: the official
openai client over HTTP, on a tiny random checkpoint, greedy text equal to HF transformers'
greedy continuation of the same token ids (completions and chat, streamed and not). gpt-oss's
harmony reasoning output: test_gpt_oss_reasoning_api.py.

HF's side is a plain greedy loop over the whole sequence (eager attention, float32): no cache,
nothing shared with the engine but the files."""

from __future__ import annotations

import openai
import pytest
import torch

from fixtures.tiny_models import load_hf_reference, make_tiny_model_dir

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "gemma3_text", "phi3")
N = 10
PROMPT = [(13 * i) % 400 + 7 for i in range(23)]      # longer than Gemma's tiny window (6)
CHAT = [{"role": "user", "content": "Hello there, how are you today?"}]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(ids):]


def _tokenizer(d):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(d / "tokenizer.json"))


def _chat_ids(tok) -> list[int]:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CHAT)
    return tok.encode(text + "<|im_start|>assistant\n", add_special_tokens=False).ids


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_model_dir(request, tmp_path_factory):
    """One family's checkpoint per module pass (the server fixtures serve this dir)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def family(tiny_model_dir, start_server):
    d = tiny_model_dir
    ref, tok = load_hf_reference(d), _tokenizer(d)
    want = {"completion": tok.decode(hf_greedy(ref, PROMPT, N), skip_special_tokens=True),
            "chat": tok.decode(hf_greedy(ref, _chat_ids(tok), N), skip_special_tokens=True)}
    assert want["completion"].strip() and want["chat"].strip()     # something to compare
    # float activations: the float path, where greedy tokens match HF's exactly
    srv = start_server(max_model_len=128, kernel_activations="float")
    return d.name, srv, want


def test_completions_are_hf_greedy_streamed_and_not(family):
    arch, srv, want = family
    client = openai.OpenAI(base_url=srv.v1, api_key="x")
    kw = dict(model=srv.model, prompt=PROMPT, max_tokens=N, temperature=0,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.choices[0].text == want["completion"], arch
    assert r.usage.completion_tokens == N
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == want["completion"], arch


def test_chat_is_hf_greedy_streamed_and_not(family):
    arch, srv, want = family
    client = openai.OpenAI(base_url=srv.v1, api_key="x")
    kw = dict(model=srv.model, messages=CHAT, max_tokens=N, temperature=0,
              extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == want["chat"], arch
    parts = [c.choices[0].delta.content or "" for c in
             client.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(parts) == want["chat"], arch


"""Through the server as a user meets it (issue 28): `iterserve serve` in its own process, the
official openai client, temperature 0 with logprobs. A completion asked alone and the same
completion asked while other requests stream beside it (chunked prefill at a small token
budget, a KV pool small enough to preempt) carry the same text and the same logprobs, to the
last digit, in the completions and the chat API."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fixtures.invariance import cli_flags, form_param, make_form
from iterserve.model import kernels

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=[form_param("hf-llama-float32"),
                                        form_param("gguf-Q4_0")])
def server(request, tmp_path_factory):
    path = make_form(request.param, tmp_path_factory.mktemp(request.param))
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "iterserve.cli", "serve", "--model", str(path), "--port",
         str(port), "--host", "127.0.0.1", "--num-kv-blocks", "20", "--block-size", "16",
         "--max-model-len", "256", "--max-num-batched-tokens", "24", "--max-num-seqs", "8",
         "--log-level", "warning", *cli_flags(request.param)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited early:\n{proc.stdout.read()}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("server did not come up")
            time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                               timeout=300)
        yield client, client.models.list().data[0].id
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


PROMPT = "the quick brown fox jumps over the lazy dog and then it runs far away " * 2


def _completion(client, model, prompt=PROMPT, max_tokens=16):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0, logprobs=5, extra_body={"ignore_eos": True})
    c = r.choices[0]
    return c.text, c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs


def _chat(client, model, text=PROMPT, max_tokens=12):
    r = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0,
                                       logprobs=True, top_logprobs=5,
                                       messages=[{"role": "user", "content": text}],
                                       extra_body={"ignore_eos": True})
    c = r.choices[0]
    return c.message.content, [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                               for t in c.logprobs.content]


def test_completion_logprobs_are_the_same_alone_and_among_other_requests(server):
    client, model = server
    alone = _completion(client, model)
    others = [f"number {i} " * (3 + 4 * i) for i in range(7)]
    with ThreadPoolExecutor(8) as pool:
        busy = [pool.submit(_completion, client, model, p, 40) for p in others]
        time.sleep(0.3)                       # the target joins a running batch
        beside = pool.submit(_completion, client, model).result()
        for f in busy:
            f.result()
    assert beside == alone


def test_chat_logprobs_are_the_same_alone_and_among_other_requests(server):
    client, model = server
    alone = _chat(client, model)
    with ThreadPoolExecutor(6) as pool:
        busy = [pool.submit(_chat, client, model, f"tell me about {i} " * (2 + 3 * i), 30)
                for i in range(5)]
        beside = pool.submit(_chat, client, model).result()
        for f in busy:
            f.result()
    assert beside == alone

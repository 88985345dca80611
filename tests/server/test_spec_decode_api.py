"""`iterserve serve --speculative-config` as a user runs it: the official openai client gets
speculation off's greedy tokens, streamed or not; /metrics counts the drafts with vLLM's
names, the request's trace and /v1/engine/stats its acceptance; a bad config stops the
server at start with a message naming the key."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "adaptive": False}
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"


def start(model_dir, *extra: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "iterserve.cli", "serve", "--model", str(model_dir),
         "--port", str(port), "--num-kv-blocks", "128", "--max-model-len", "1024",
         "--log-level", "warning", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("server did not come up")


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    procs = []
    try:
        off = start(tiny_model_dir)
        procs.append(off[0])
        on = start(tiny_model_dir, "--speculative-config", json.dumps(SPEC))
        procs.append(on[0])
        yield off[1], on[1]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_openai_client_gets_speculation_offs_tokens_and_metrics_count_the_drafts(servers):
    import openai

    off, on = (openai.OpenAI(base_url=b + "/v1", api_key="x") for b in servers)
    model = off.models.list().data[0].id
    kw = dict(model=model, prompt=PROMPT, max_tokens=40, temperature=0, logprobs=1,
              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    a = off.completions.create(**kw)
    b = on.completions.create(**kw)
    assert b.choices[0].text == a.choices[0].text
    assert b.choices[0].logprobs.tokens == a.choices[0].logprobs.tokens
    assert b.usage.completion_tokens == 40
    streamed = "".join(c.choices[0].text for c in on.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == a.choices[0].text

    metrics = httpx.get(servers[1] + "/metrics").text
    drafts = _metric(metrics, "iterserve:spec_decode_num_draft_tokens_total")
    accepted = _metric(metrics, "iterserve:spec_decode_num_accepted_tokens_total")
    assert _metric(metrics, "iterserve:spec_decode_num_drafts_total") > 0
    assert drafts > 0 and 0 < accepted <= drafts
    assert 'iterserve:spec_decode_num_accepted_tokens_per_pos_total{' in metrics
    assert _metric(metrics, "iterserve:spec_decode_num_accepted_tokens_per_pos_total") == \
        accepted
    assert _metric(httpx.get(servers[0] + "/metrics").text,
                   "iterserve:spec_decode_num_drafts_total") == 0

    stats = httpx.get(servers[1] + "/v1/engine/stats").json()
    assert stats["spec_decode"]["num_draft_tokens"] == drafts
    trace = httpx.get(servers[1] + f"/v1/requests/{b.id}/trace").json()
    spec = [s.get("spec_decode") for s in trace.get("sequences", [trace])][0]
    assert spec["num_draft_tokens"] > 0 and 0 <= spec["acceptance_rate"] <= 1


def test_a_bad_speculative_config_stops_the_server_naming_the_key(tiny_model_dir):
    r = subprocess.run(
        [sys.executable, "-m", "iterserve.cli", "serve", "--model", str(tiny_model_dir),
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
        capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    err = r.stdout + r.stderr
    assert "speculative_config.num_speculative_tokens" in err and "Traceback" not in err


def test_a_draft_model_serves_speculation_offs_tokens_through_the_openai_client(
        tiny_model_dir, servers):
    """vLLM's draft-model config (the method inferred from `model`): here the target itself
    as its own draft, so every draft is accepted, and the text is speculation off's."""
    import openai

    proc, base = start(tiny_model_dir, "--speculative-config",
                       json.dumps({"model": str(tiny_model_dir), "num_speculative_tokens": 3}))
    try:
        off, on = (openai.OpenAI(base_url=b + "/v1", api_key="x") for b in (servers[0], base))
        model = on.models.list().data[0].id
        kw = dict(model=model, prompt="hello world, this is", max_tokens=30, temperature=0,
                  extra_body={"ignore_eos": True})
        assert on.completions.create(**kw).choices[0].text == \
            off.completions.create(**kw).choices[0].text
        metrics = httpx.get(base + "/metrics").text
        drafts = _metric(metrics, "iterserve:spec_decode_num_draft_tokens_total")
        accepted = _metric(metrics, "iterserve:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and accepted >= 0.9 * drafts
    finally:
        proc.kill()
        proc.wait()

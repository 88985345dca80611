"""`iterserve serve -tp 2` as a user runs it, through the official openai client: the same
completions as the TP = 1 engine, a rank killed mid-service fails requests cleanly (an error,
never a hang), and SIGTERM leaves no rank process behind. One server, ~10 s on 2 cores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from fixtures.tiny_gguf import ALL_QUANT, write_tiny_llama_gguf

openai = pytest.importorskip("openai")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-serve") / "q.gguf"
    write_tiny_llama_gguf(path, seed=3, tensor_types=ALL_QUANT)
    return path


def test_serve_tp2_with_the_openai_client(model_path):
    from iterserve import LLM
    from iterserve.core.request import SamplingParams

    prompts = ["Hello there", "def add(a, b):"]
    ref = LLM(str(model_path), num_kv_blocks=64)
    expected = [o.outputs[0].text for o in ref.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)]
    del ref

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "iterserve.cli", "serve", "--model", str(model_path),
         "--port", str(port), "-tp", "2", "--num-kv-blocks", "64", "--log-level", "warning",
         "--shutdown-timeout", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    base = f"http://127.0.0.1:{port}"
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"server exited early:\n{proc.stdout.read()}"
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        tp = httpx.get(base + "/v1/engine/stats", timeout=10).json()["memory"]["tensor_parallel"]
        assert tp["size"] == 2 and tp["decode_path"] == "per-op"
        pids = tp["rank_pids"]
        assert pids[0] == proc.pid

        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                               timeout=30)
        for prompt, want in zip(prompts, expected):
            r = client.completions.create(model="q", prompt=prompt, max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
            assert r.choices[0].text == want
        stream = client.completions.create(model="q", prompt=prompts[0], max_tokens=12,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected[0]
        chat = client.chat.completions.create(
            model="q", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            temperature=0)
        assert chat.choices[0].finish_reason in ("length", "stop")

        # a rank dies: the next request fails with an error, quickly, and names the rank
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(openai.APIError, match="rank 1"):
            client.completions.create(model="q", prompt="again", max_tokens=5,
                                      temperature=0)
        assert time.monotonic() - t0 < 10
        stats = httpx.get(base + "/v1/engine/stats", timeout=10).json()
        assert "rank 1" in stats["memory"]["tensor_parallel"]["dead"]
        assert stats["kv_cache_usage"] == 0              # the failed request freed its blocks
        health = httpx.get(base + "/health", timeout=10)      # load balancers stop sending
        assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert all(_gone(p, 10) for p in pids), "a rank process outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in pids[1:]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass

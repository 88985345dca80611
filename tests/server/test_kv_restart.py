"""`iterserve serve --kv-offload-dir`: an agent's next turn after a restart (clean or a
crash) starts warm from the disk tier, with the tokens a cold server gives, as the official
client sees it (`usage.prompt_tokens_details.cached_tokens`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

FLAGS = ("--kernel-activations", "float", "--block-size", "16")
SYSTEM = [3 + (i * 7) % 400 for i in range(300)]        # the shared "system prompt + tools"
TURN1 = SYSTEM + [5 + (i * 13) % 400 for i in range(100)]
TURN2 = TURN1 + [7 + (i * 17) % 400 for i in range(60)]   # + an answer and a tool's output


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir, *extra: str) -> None:
        port = free_port()
        self.log = open(os.devnull, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "iterserve.cli", "serve", "--model", str(model_dir),
             "--port", str(port), "--num-kv-blocks", "128", "--max-model-len", "1024",
             "--log-level", "warning", "--enable-prompt-tokens-details", *FLAGS, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited early:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        self.client = OpenAI(base_url=self.base + "/v1", api_key="x")
        self.model = self.client.models.list().data[0].id

    def turn(self, prompt: list[int]):
        r = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
        return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens

    def tiers(self) -> dict:
        return httpx.get(self.base + "/v1/engine/stats", timeout=10).json()["kv_tiers"]

    def stop(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        out = self.proc.stdout.read()
        assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def cold_answers(tiny_model_dir):
    s = Server(tiny_model_dir, "--no-enable-prefix-caching")
    try:
        return s.turn(TURN1)[0], s.turn(TURN2)[0]
    finally:
        s.stop()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_the_next_turn_after_a_restart_starts_warm_with_the_cold_answer(
        tiny_model_dir, tmp_path, cold_answers, how):
    d = tmp_path / "kv"
    s = Server(tiny_model_dir, "--kv-offload-dir", str(d))
    try:
        text, cached = s.turn(TURN1)
        assert (text, cached) == (cold_answers[0], 0)
        if how == "sigkill":          # a crash: only what reached the disk survives
            deadline = time.monotonic() + 30
            while (t := s.tiers())["store"]["pending_writes"] or t["store"]["writes"] < 25:
                assert time.monotonic() < deadline, t
                time.sleep(0.1)
    finally:
        s.stop(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    s = Server(tiny_model_dir, "--kv-offload-dir", str(d))
    try:
        stats = httpx.get(s.base + "/v1/engine/stats", timeout=10).json()
        assert stats["memory"]["kv_tiers"]["disk"]["found_blocks"] >= 25   # 407 tokens, /16
        text, cached = s.turn(TURN2)
        assert text == cold_answers[1]
        assert cached >= len(TURN1) // 16 * 16          # every full block of turn 1
        assert s.tiers()["counters"]["disk_hits"] >= 25
    finally:
        s.stop()


def test_without_the_disk_tier_a_restart_starts_cold(tiny_model_dir, cold_answers):
    s = Server(tiny_model_dir)
    try:
        s.turn(TURN1)
        assert s.turn(TURN2)[1] >= len(TURN1) // 16 * 16     # warm while it runs
    finally:
        s.stop()
    s = Server(tiny_model_dir)
    try:
        assert s.turn(TURN2) == (cold_answers[1], 0)
    finally:
        s.stop()

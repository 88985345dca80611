"""`iterserve serve` as a process: serves the model, and shuts down cleanly on SIGTERM/SIGINT
(in-flight streams are ended, the process exits 0)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest



def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model_dir, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "iterserve.cli", "serve", "--model", str(model_dir),
         "--port", str(port), "--num-kv-blocks", "128", "--max-model-len", "1024",
         "--log-level", "warning", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_answers_then_shuts_down_cleanly_on_signal(tiny_model_dir, sig):
    proc, base = start(tiny_model_dir, "--shutdown-timeout", "0.2")
    try:
        r = httpx.post(base + "/v1/completions", timeout=30,
                       json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        with httpx.stream("POST", base + "/v1/completions", timeout=30, json={
                "prompt": "Hello", "max_tokens": 1000, "stream": True,
                "ignore_eos": True}) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(sig)
            rest = list(lines)          # the stream ends (finished or aborted), never hangs
        assert proc.wait(timeout=30) == 0
        # finished or aborted, the stream ends properly: a final event, then [DONE]
        assert [ln for ln in rest if ln.startswith("data: ")][-1] == "data: [DONE]"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = proc.stdout.read()
    assert "Traceback" not in out, out


def test_generate_cli_prints_completions(tiny_model_dir, capsys):
    from iterserve.cli import main

    rc = main(["generate", "Hello world", "--model", str(tiny_model_dir), "--max-tokens", "3",
               "--num-kv-blocks", "32", "--max-model-len", "128", "--json", "--no-progress"])
    assert rc == 0
    import json
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    rec = json.loads(line)
    assert rec["prompt"] == "Hello world" and len(rec["token_ids"]) <= 3
    assert rec["finish_reason"] in ("length", "stop")


def test_generate_cli_rejects_bad_settings(tiny_model_dir, capsys):
    from iterserve.cli import main

    assert main(["generate", "x", "--model", str(tiny_model_dir), "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_sigterm_ends_cut_streams_with_abort_usage_and_done_within_the_timeout(tiny_model_dir):
    """Exit within --shutdown-timeout + 1 s; a stream still running when
    the drain ends gets finish_reason "abort", its usage chunk, then [DONE]."""
    import json

    timeout = 0.25          # 4 x 1000 tokens take the tiny model well over that
    proc, base = start(tiny_model_dir, "--shutdown-timeout", str(timeout))
    try:
        with httpx.stream("POST", base + "/v1/completions", timeout=30, json={
                "prompt": "Hello", "max_tokens": 1000, "n": 4, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            rest = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
        code = proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
        assert code == 0
        assert elapsed < timeout + 1.0, elapsed
        assert rest[-1] == "[DONE]"
        usage_chunk = json.loads(rest[-2])
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
        finishes = {c["index"]: c["finish_reason"] for e in rest[:-2]
                    for c in json.loads(e)["choices"] if c["finish_reason"]}
        assert finishes == {0: "abort", 1: "abort", 2: "abort", 3: "abort"}
        assert not any('"error"' in e for e in rest)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

"""CI smoke test: `iterserve bench serve` against a real `iterserve serve` on 127.0.0.1.

A tiny random llama, a handful of `mix` requests, and the result file's shape. It checks
the parts the stub cannot: that the real server honours ignore_eos (every request gets
exactly max_tokens), streams one token per chunk, and reports usage.
"""

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from iterserve.bench.workloads import build_workload
from iterserve.cli import main as iterserve_main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory, tiny_model_dir):
    model = tiny_model_dir
    port = _free_port()
    log = open(tmp_path_factory.mktemp("smoke-log") / "server.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "iterserve.cli", "serve", "--model", str(model), "--port",
         str(port), "--max-num-seqs", "4", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"iterserve serve exited ({proc.returncode}):\n{log.read()[-3000:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("iterserve serve did not come up within 120 s")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_bench_serve_against_iterserve_writes_the_documented_json(server_url, tmp_path):
    out = tmp_path / "smoke.json"
    rc = iterserve_main(["bench", "serve", "--base-url", server_url, "--workload", "mix",
                         "--num-requests", "4", "--slo", "ttft:60000,itl:60000",
                         "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert {"kind", "base_url", "model", "machine", "workload", "summary", "requests"} <= set(doc)
    w = build_workload("mix", num_requests=4)
    s = doc["summary"]
    assert s["completed"] == 4 and s["failed"] == 0
    assert s["total_output_tokens"] == w.total_output_tokens   # ignore_eos honoured
    for rec, req in zip(doc["requests"], w.requests):
        assert rec["output_tokens"] == req.max_tokens
        assert rec["chunks"] <= req.max_tokens                  # at most one token per chunk
        assert rec["ttft"] > 0 and rec["e2e"] >= rec["ttft"]
    assert s["output_throughput"] > 0 and s["itl"]["count"] > 0
    assert s["slo_met"] is True and s["good_requests"] == 4

"""`iterserve serve --data-parallel-size 2` as a user runs it: the CLI in a subprocess,
joining the test session's Ray cluster through `--ray-address`, with
`--threads-per-replica 1`; SIGTERM stops it cleanly and removes its Serve application. A bad
model path is refused before any replica starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from .conftest import free_port

SRC = str(Path(__file__).resolve().parents[2] / "src")


def cli(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "iterserve.cli", "serve", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_serve_dp2_joins_a_cluster_and_stops_cleanly(ray_cluster, tiny_model_dir):
    import ray
    from ray import serve

    address = ray.get_runtime_context().gcs_address
    before = set(serve.status().applications) if serve.context._global_client else set()
    port = free_port()
    proc = cli("--model", str(tiny_model_dir), "--port", str(port), "--num-kv-blocks", "64",
               "--max-model-len", "256", "-dp", "2", "--threads-per-replica", "1",
               "--router", "prefix_aware", "--ray-address", address, "--log-level", "warning")
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        # ignore_eos: the random tiny model may sample its EOS early (unseeded sampling); this
        # test is about the cluster, not about when the model stops.
        r = c.completions.create(model="tiny-llama", prompt="hi", max_tokens=4,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
        stats = httpx.get(base + "/v1/engine/stats").json()
        assert stats["num_replicas"] == 2 and stats["router"] == "prefix_aware"
        assert [x["threads"] for x in stats["replicas"]] == [1, 1]
        apps = set(serve.status().applications) - before
        assert len(apps) == 1 and apps.pop().startswith("iterserve-")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    # Its application is gone; the cluster (not its own) is left running.
    deadline = time.monotonic() + 30
    while set(serve.status().applications) - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not set(serve.status().applications) - before
    assert ray.is_initialized()


def test_serve_dp2_with_a_missing_model_is_refused_quickly():
    t0 = time.monotonic()
    proc = cli("--model", "/nonexistent/model", "-dp", "2")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-2000:]
    assert "no model at '/nonexistent/model'" in err
    assert time.monotonic() - t0 < 60


def test_serve_dp2_listens_on_loopback_only(tiny_model_dir):
    """`serve -dp 2` without --ray-address starts its own Ray cluster: every socket that the
    server process and the processes it started (GCS, raylet, agents, the replicas' workers)
    listen on is a loopback one, and there is no dashboard. Before, Ray's servers listened on
    0.0.0.0, ::, and the machine's own address."""
    from iterserve.replicas.launch import is_loopback, listening_sockets

    port = free_port()
    proc = cli("--model", str(tiny_model_dir), "--port", str(port), "--num-kv-blocks", "64",
               "--max-model-len", "128", "-dp", "2", "--threads-per-replica", "1",
               "--log-level", "warning")
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "prompt": "hi", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
        sockets = listening_sockets(proc.pid)
        names = {name for *_, name in sockets}
        # Ray's own servers are there (the check is not vacuous) ...
        assert "gcs_server" in names and "raylet" in names, sockets
        assert len({pid for _, _, pid, _ in sockets}) >= 4, sockets
        # ... and every one of them, the HTTP port included, is on loopback.
        exposed = [s for s in sockets if not is_loopback(s[0])]
        assert not exposed, exposed
        assert port in {p for _, p, _, _ in sockets}
        assert 8265 not in {p for _, p, _, _ in sockets}          # Ray's dashboard: off
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-3000:]


def test_loopback_check_reads_addresses():
    from iterserve.replicas.launch import is_loopback

    for a in ("127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1"):
        assert is_loopback(a), a
    for a in ("0.0.0.0", "::", "192.0.2.2", "10.0.0.1", "::ffff:10.0.0.1", "fe80::1%eth0", ""):
        assert not is_loopback(a), a

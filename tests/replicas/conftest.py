"""Replica tests: one local Ray cluster for the package (starting Ray costs ~5-10 s on
2 cores), one Serve application per module (~10-20 s: two replica processes import torch and
load the tiny model), and iterserve's own FastAPI app in a uvicorn thread in front of it.

Each replica gets 1 thread: the test machines have 2 cores.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="tests/replicas need ray[serve] (the 'ray' extra)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    base_url: str
    engine: Any
    server: Any
    thread: threading.Thread

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve_engine(engine: Any, **app_kw: Any) -> Served:
    """iterserve's app for `engine` (an AsyncEngine or a ReplicaPool) on a free port."""
    import uvicorn

    from iterserve.server.app import create_app

    app = create_app(engine, **app_kw)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True, name=f"uvicorn-{port}")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    return Served(f"http://127.0.0.1:{port}", engine, server, thread)


@pytest.fixture(scope="package")
def ray_cluster():
    """A local Ray for this package's tests (stopped after its last test, so the rest of
    the suite runs without Ray's processes)."""
    from iterserve.replicas.launch import init_ray

    t0 = time.monotonic()
    started = init_ray(None, num_cpus=4)
    print(f"\n[replicas] ray.init: {time.monotonic() - t0:.1f} s")
    yield
    if started:
        from ray import serve
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def start_pool(ray_cluster, tiny_model_dir):
    """start_pool(**engine_kw) -> a served ReplicaPool of 2 replicas x 1 thread (of the shared
    tiny model, or `model=` a directory); all stop at module end."""
    from iterserve.engine.args import EngineArgs
    from iterserve.replicas import close_pool, start_pool as _start_pool

    started: list[Served] = []

    def start(app_kw: dict | None = None, model: Any = None, **kw: Any) -> Served:
        kw.setdefault("num_kv_blocks", 128)
        kw.setdefault("max_model_len", 256)
        kw.setdefault("data_parallel_size", 2)
        t0 = time.monotonic()
        pool = _start_pool(EngineArgs(model=str(model or tiny_model_dir), **kw), threads_per_replica=1)
        print(f"\n[replicas] start_pool({kw.get('router', 'least_loaded')}): "
              f"{time.monotonic() - t0:.1f} s")
        s = serve_engine(pool, **(app_kw or {}))
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
        close_pool(s.engine, shutdown_ray=False)

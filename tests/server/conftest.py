"""Server test fixtures: a tiny random llama served by uvicorn in a thread on a free port.

Starting a server is cheap (the tiny model loads in ~0.1 s), so tests that need special
settings (a full queue, timeouts, an API key) start their own with `start_server`; the
common one is module-scoped.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest
import uvicorn

from iterserve.engine.args import EngineArgs
from iterserve.engine.async_engine import AsyncEngine
from iterserve.server.app import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    base_url: str
    engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread
    model: str

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        assert not self.thread.is_alive(), "server did not shut down"


_APP_KW = ("api_key", "metrics_require_auth", "max_request_body_bytes", "serving_config")


def _start(model_dir, *, debug_check_consistency: bool = False, **kw) -> RunningServer:
    app_kw = {k: kw.pop(k) for k in _APP_KW if k in kw}
    engine_kw = kw
    engine_kw.setdefault("num_kv_blocks", 128)
    engine_kw.setdefault("max_model_len", 256)
    engine = AsyncEngine.from_engine_args(EngineArgs(model=str(model_dir), **engine_kw),
                                          debug_check_consistency=debug_check_consistency)
    app = create_app(engine, model_root=str(model_dir), **app_kw)
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
    return RunningServer(f"http://127.0.0.1:{port}", engine, server, thread, engine.model_name)


@pytest.fixture(scope="module")
def start_server(tiny_model_dir):
    """Start extra servers with their own engine settings; all stop at module end."""
    started: list[RunningServer] = []

    def start(**kw) -> RunningServer:
        s = _start(tiny_model_dir, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def server(start_server) -> RunningServer:
    return start_server()

"""A tiny FastAPI server that streams like an OpenAI-compatible server, for client tests.

It emits one chunk per token (``tok0 tok1 ...``) every `token_delay_s`, then (if asked for)
a usage chunk and ``data: [DONE]``. Knobs: `send_usage` (llama-server style servers may not),
`fail_prompts_containing` (answer HTTP 500 for such prompts), `error_in_stream_after`,
`refuse_first` (answer each prompt's first N attempts with 429 and `retry_after_ms`, as an
SLO-admitting server refuses).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class StubConfig:
    token_delay_s: float = 0.002
    first_token_delay_s: float = 0.01
    send_usage: bool = True
    fail_prompts_containing: str | None = None
    cached_tokens: int | None = None       # sent as usage.prompt_tokens_details when set
    refuse_first: int = 0
    retry_after_ms: int = 200
    received: list[dict] = field(default_factory=list)


def make_app(cfg: StubConfig) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    async def _stream(body: dict, chat: bool):
        n = int(body["max_tokens"])
        await asyncio.sleep(cfg.first_token_delay_s)
        for i in range(n):
            if i:
                await asyncio.sleep(cfg.token_delay_s)
            choice = ({"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}
                      if chat else {"index": 0, "text": f" tok{i}", "finish_reason": None})
            yield f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"
        final = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat
                 else {"index": 0, "text": "", "finish_reason": "length"})
        yield f"data: {json.dumps({'id': 'x', 'choices': [final]})}\n\n"
        if cfg.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7}
            if cfg.cached_tokens is not None:
                usage["prompt_tokens_details"] = {"cached_tokens": cfg.cached_tokens}
            yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    async def handle(request: Request, chat: bool):
        body = await request.json()
        cfg.received.append(body)
        text = json.dumps(body.get("messages")) if chat else body.get("prompt", "")
        if sum(1 for b in cfg.received if b == body) <= cfg.refuse_first:
            return JSONResponse(
                {"error": {"message": "cannot meet the TTFT target now", "type": "rate_limit",
                           "code": "slo_unattainable"}}, status_code=429,
                headers={"Retry-After": str(max(1, -(-cfg.retry_after_ms // 1000))),
                         "retry-after-ms": str(cfg.retry_after_ms)})
        if cfg.fail_prompts_containing and cfg.fail_prompts_containing in text:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}},
                                status_code=500)
        return StreamingResponse(_stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


@contextmanager
def running_stub(cfg: StubConfig | None = None):
    """Start the stub on 127.0.0.1 (a free port) in a thread; yield its base URL."""
    cfg = cfg or StubConfig()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(cfg), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("stub server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()

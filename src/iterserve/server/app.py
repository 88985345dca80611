"""The FastAPI app: OpenAI-compatible endpoints, health, metrics, traces, the live view.

`create_app(engine)` wires routes to one AsyncEngine (or to none: `iterserve lab` serves the
lab page without a model, and then the model endpoints answer 503 with an error body). The
engine loop starts and stops with the app's lifespan; shutdown aborts what is still in
flight, so SIGINT/SIGTERM under uvicorn never leaves a request hanging.

Routes:
  POST /v1/completions, POST /v1/chat/completions    (SSE when "stream": true)
  GET  /v1/models, /health, /metrics (Prometheus text)
  GET  /v1/requests/{id}/trace                       lifecycle events of one request
  GET  /v1/engine/stats                              the lab page's live view
  + the lab page's routes (server/lab_routes.py) when that module exists

With `api_key` set, every /v1/ route needs `Authorization: Bearer <key>` (401 otherwise),
except the lab's own /v1/lab/ routes and /v1/engine/stats, which the lab page calls from the
browser without a key.
"""

from __future__ import annotations

import contextlib
import hmac
import importlib
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from iterserve.engine.async_engine import AsyncEngine
from iterserve.server.errors import APIError, error_response, install_exception_handlers
from iterserve.server.metrics import CONTENT_TYPE_LATEST, PrometheusStatLogger
from iterserve.server.protocol import ChatCompletionRequest, CompletionRequest
from iterserve.server.serving_chat import create_chat_completion
from iterserve.server.serving_completions import create_completion

logger = logging.getLogger(__name__)

_KEYLESS_PREFIXES = ("/v1/lab/", "/v1/engine/stats")


def _lab_router():
    try:
        module = importlib.import_module("iterserve.server.lab_routes")
    except ModuleNotFoundError as e:
        if e.name == "iterserve.server.lab_routes":
            return None
        raise
    return module.router


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which gets in the way of streaming and of
    disconnect detection): 401 unless /v1/ requests carry the Bearer key."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path = scope.get("path", "")
            if path.startswith("/v1/") and not path.startswith(_KEYLESS_PREFIXES):
                got = dict(scope.get("headers") or []).get(b"authorization", b"")
                if not hmac.compare_digest(got, self.expected):
                    resp = error_response(401, "invalid or missing API key (send "
                                          "'Authorization: Bearer <key>')",
                                          type="authentication_error", code="invalid_api_key")
                    await resp(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def create_app(engine: AsyncEngine | None, *, served_model_name: str | None = None,
               api_key: str | None = None, shutdown_drain_timeout: float = 0.0) -> FastAPI:
    model_name = served_model_name or (engine.model_name if engine is not None else None)
    prom: PrometheusStatLogger | None = None
    if engine is not None:
        prom = PrometheusStatLogger(model_name)
        engine.engine.stat_loggers.append(prom)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine is not None:
            engine.start()
        try:
            yield
        finally:
            if engine is not None:
                await engine.shutdown(drain_timeout=shutdown_drain_timeout)

    app = FastAPI(title="iterserve", summary="OpenAI-compatible LLM serving", lifespan=lifespan)
    app.state.engine = engine
    app.state.served_model_name = model_name
    app.state.prometheus = prom
    install_exception_handlers(app)

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    def require_engine() -> AsyncEngine:
        if engine is None:
            raise APIError(503, "no model is loaded on this server (it serves the lab only); "
                           "start it with `iterserve serve` to use the model endpoints",
                           type="service_unavailable")
        return engine

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(body, raw, require_engine(), model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(body, raw, require_engine(), model_name)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = []
        if engine is not None:
            data.append({"id": model_name, "object": "model", "created": 0,
                         "owned_by": "iterserve",
                         "max_model_len": engine.engine.max_model_len})
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine is not None and engine._closed:
            return error_response(503, "the engine is shut down", type="service_unavailable")
        return JSONResponse({"status": "ok", "model": model_name})

    @app.get("/metrics")
    async def metrics() -> Response:
        if engine is None or prom is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        try:
            s = await engine.run_in_engine(engine.engine.scheduler.stats)
            prom.set_gauges(num_running=s.num_running, num_waiting=s.num_waiting,
                            num_swapped=s.num_swapped, kv_cache_usage=s.kv_usage,
                            num_free_blocks=s.num_free_blocks)
        except Exception:                   # a dead engine still gets its counters read
            logger.debug("could not refresh gauges", exc_info=True)
        return Response(prom.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/requests/{request_id}/trace")
    async def trace(request_id: str) -> dict[str, Any]:
        if engine is None:
            raise APIError(404, f"no request {request_id!r}: no model is loaded",
                           type="not_found_error")
        t = await engine.get_trace(request_id)
        if t is None:
            raise APIError(404, f"no request {request_id!r} (unknown, or finished too long "
                           "ago to be kept)", type="not_found_error", param="request_id")
        return t

    @app.get("/v1/engine/stats")
    async def engine_stats() -> dict[str, Any]:
        return await require_engine().stats()

    lab = _lab_router()
    if lab is not None:
        app.include_router(lab)
    return app

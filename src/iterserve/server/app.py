"""The FastAPI app: OpenAI-compatible endpoints, health, metrics, traces, the live view.

`create_app(engine)` wires routes to one AsyncEngine (or to none: `iterserve lab` serves the
lab page without a model, and then the model endpoints answer 503 with an error body). The
engine loop starts and stops with the app's lifespan; shutdown aborts what is still in
flight, so SIGINT/SIGTERM under uvicorn never leaves a request hanging.

Routes:
  POST /v1/completions, POST /v1/chat/completions    (SSE when "stream": true)
  POST /v1/responses                                 OpenAI's Responses API, stateless
  POST /v1/messages, /v1/messages/count_tokens       Anthropic's Messages API (serving_messages)
  POST /v1/embeddings, /v1/score, /rerank            an embedding model's (serving_pooling)
  POST /tokenize, POST /detokenize                   vLLM's bodies (prompt or chat messages)
  GET  /v1/models (with `root`), /version, /health, /ping (GET or POST), /metrics
  GET  /v1/requests/{id}/trace                       lifecycle events of one request
  GET  /v1/engine/stats                              the lab page's live view
  + the lab page's routes (server/lab_routes.py) when that module exists

Middleware, outermost first (plain ASGI, not BaseHTTPMiddleware, which gets in the way of
streaming and of disconnect detection):
  BodySizeLimitMiddleware  a body over `max_request_body_bytes` is read to its end (so the
                           client sees the answer and the connection stays usable) and
                           answered 413 with an OpenAI body, before any parsing
  APIKeyMiddleware         with `api_key`, every route but /health, /ping and the static lab
                           page (/lab, /lab/static/...) needs `Authorization: Bearer <key>`
                           (or `x-api-key: <key>`, Anthropic's header);
                           /metrics too with `metrics_require_auth`; 401s carry
                           `WWW-Authenticate: Bearer`
  CatchAllMiddleware       (server/errors.py) a server fault is a 500 with an OpenAI body
"""

from __future__ import annotations

import contextlib
import hmac
import importlib
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from iterserve.core.config import ServerConfig, default_of
from iterserve.engine.async_engine import AsyncEngine
from iterserve.errors import TokenIdOutOfRangeError, WrongRunnerError
from iterserve.server.errors import (APIError, error_response, install_exception_handlers,
                                     to_api_error)
from iterserve.server.metrics import CONTENT_TYPE_LATEST, PrometheusStatLogger
from iterserve.server.openapi import install_openapi
from iterserve.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                       DetokenizeRequest, TokenizeChatRequest, TokenizeRequest)
from iterserve.server.serving_chat import create_chat_completion, render_request
from iterserve.server.serving_config import ServingConfig
from iterserve.server.serving_messages import install_messages_api
from iterserve.server.serving_pooling import install_pooling_api
from iterserve.server.serving_responses import ResponsesRequest, create_response
from iterserve.server.serving_common import ServedModel, check_model
from iterserve.server.serving_completions import create_completion

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = default_of(ServerConfig, "max_request_body_bytes")   # the knob's
"""4 MiB: a max_model_len-sized prompt as token-id JSON (131,072 ids ~ 1 MB) or as text
(~0.5 MB) fits with room for a batch of prompts; the outside test's 10 MB prompt does not."""

_OPEN_PATHS = ("/health", "/ping", "/lab")
_OPEN_PREFIXES = ("/lab/static/",)


def _lab_router():
    try:
        module = importlib.import_module("iterserve.server.lab_routes")
    except ModuleNotFoundError as e:
        if e.name == "iterserve.server.lab_routes":
            return None
        raise
    return module.router


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("iterserve")
    except Exception:
        return "unknown"


class APIKeyMiddleware:
    """401 (with `WWW-Authenticate: Bearer`) unless the request carries the Bearer key; open:
    /health, /ping, the static lab page, and /metrics unless `metrics_require_auth`."""

    def __init__(self, app: Any, api_key: str, metrics_require_auth: bool = False) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.key = api_key.encode()             # `x-api-key: <key>`, as Anthropic's clients send
        self.open_paths = _OPEN_PATHS + (() if metrics_require_auth else ("/metrics",))

    def needs_key(self, path: str) -> bool:
        return not (path in self.open_paths or path.startswith(_OPEN_PREFIXES))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.needs_key(scope.get("path", "")):
            headers = dict(scope.get("headers") or [])
            if not (hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
                    or hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)):
                resp = error_response(401, "invalid or missing API key (send "
                                      "'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                                      type="authentication_error", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes` (declared or streamed), with the body read to its
    end first so the client gets the answer on a connection it can keep using. A body within
    the limit is buffered (the routes read it whole anyway) and replayed to the app."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return                                   # the client is gone
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                too_big = True
            if not too_big:
                chunks.append(body)
            if not message.get("more_body", False):
                break
        if too_big:
            resp = error_response(
                413, f"the request body is {total} bytes; this server accepts at most "
                     f"{self.max_bytes} (--max-request-body-bytes)", code="request_too_large")
            await resp(scope, receive, send)
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def create_app(engine: AsyncEngine | None, *,
               served_model_name: str | list[str] | None = None,
               api_key: str | None = None, shutdown_drain_timeout: float = 0.0,
               max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
               metrics_require_auth: bool = False, model_root: str | None = None,
               serving_config: ServingConfig | None = None) -> FastAPI:
    serving_config = serving_config or ServingConfig()         # --chat-template, tool flags
    model_name = served_model_name or (engine.model_name if engine is not None else None)
    if model_name is not None:            # --served-model-name a b: "a", answering to both
        model_name = ServedModel(model_name)
    prom: PrometheusStatLogger | None = None
    if engine is not None:
        prom = PrometheusStatLogger(model_name)
        engine.add_stat_logger(prom, per_replica=prom.for_replica)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine is not None:
            engine.start()
        try:
            yield
        finally:
            if engine is not None:
                await engine.shutdown(drain_timeout=shutdown_drain_timeout)

    app = FastAPI(title="iterserve", summary="OpenAI-compatible LLM serving", lifespan=lifespan,
                  version=_version())
    app.state.engine = engine
    app.state.served_model_name = model_name
    app.state.prometheus = prom
    install_exception_handlers(app)                      # CatchAllMiddleware: innermost
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key,
                           metrics_require_auth=metrics_require_auth)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)

    def require_engine() -> AsyncEngine:
        if engine is None:
            raise APIError(503, "no model is loaded on this server (it serves the lab only); "
                           "start it with `iterserve serve` to use the model endpoints",
                           type="service_unavailable")
        return engine

    def require_generator() -> AsyncEngine:
        """The engine, for the routes that generate text: an embedding model's server
        (--runner pooling) answers them 400 before any template is rendered."""
        e = require_engine()
        if getattr(e, "pooler_config", None) is not None:
            raise to_api_error(WrongRunnerError(
                "this model is served as an embedding model (--runner pooling): it answers "
                "/v1/embeddings, /v1/score and /rerank, and generates no text", "model"))
        return e

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(body, raw, require_generator(), model_name,
                                       serving_config)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(body, raw, require_generator(), model_name,
                                            serving_config)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request):
        return await create_response(body, raw, require_generator(), model_name,
                                     serving_config)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        e = require_engine()
        try:
            check_model(body.model, model_name)
            if isinstance(body, TokenizeChatRequest):
                _, ids = await render_request(e, body, serving_config,
                                              add_special_tokens=body.add_special_tokens)
            else:
                ids = await e.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
        except Exception as exc:
            raise (to_api_error(exc) or exc) from exc
        strs = e.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": e.max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        e = require_engine()
        try:
            check_model(body.model, model_name)
            bad = next((t for t in body.tokens if t >= e.vocab_size), None)
            if bad is not None:
                raise TokenIdOutOfRangeError(
                    f"token id {bad} is outside the vocabulary [0, {e.vocab_size})", "tokens")
            text = await e.detokenize(body.tokens)
        except Exception as exc:
            raise (to_api_error(exc) or exc) from exc
        return {"prompt": text}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = []
        if engine is not None:
            data += [{"id": name, "object": "model", "created": 0,
                      "owned_by": "iterserve", "root": model_root or model_name,
                      "parent": None, "max_model_len": engine.max_model_len}
                     for name in model_name.names]
        return {"object": "list", "data": data}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine is not None and engine.is_closed:
            return error_response(503, "the engine is shut down", type="service_unavailable")
        if engine is not None and engine.fatal_error:
            return error_response(503, f"the engine cannot serve: {engine.fatal_error}",
                                  type="service_unavailable")
        return JSONResponse({"status": "ok", "model": model_name})

    @app.get("/ping")
    @app.post("/ping", operation_id="ping_post")
    async def ping() -> Response:
        if engine is not None and engine.is_closed:
            return error_response(503, "the engine is shut down", type="service_unavailable")
        return Response(status_code=200, media_type="text/plain")   # empty, as vLLM's

    @app.get("/metrics")
    async def metrics() -> Response:
        if engine is None or prom is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        try:
            s = await engine.scheduler_stats()
            prom.set_gauges(num_running=s.num_running, num_waiting=s.num_waiting,
                            num_swapped=s.num_swapped, kv_cache_usage=s.kv_usage,
                            num_free_blocks=s.num_free_blocks)
            if engine.engine.scheduler.slo is not None:      # read on the engine thread
                prom.set_slo(await engine.run_in_engine(engine.engine.scheduler.slo.stats))
            adapter = getattr(engine.engine.executor, "thread_adapter", None)
            if adapter is not None:
                prom.set_threads(adapter)
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

    install_pooling_api(app, require_engine, model_name)      # embeddings, score, rerank
    install_messages_api(app, require_generator, model_name, serving_config)   # outermost
    lab = _lab_router()
    if lab is not None:
        app.include_router(lab)
    install_openapi(app, max_model_len=engine.max_model_len if engine is not None else None,
                    api_key=bool(api_key), max_request_body_bytes=max_request_body_bytes,
                    max_logprobs=getattr(engine, "max_logprobs", None),
                    vocab_size=engine.vocab_size if engine is not None else None,
                    scheduling_policy=engine.scheduling_policy if engine is not None else None,
                    trust_request_chat_template=serving_config.trust_request_chat_template,
                    auto_tool_choice=bool(serving_config.tools.enable_auto_tool_choice
                                          and serving_config.tools.tool_call_parser))
    return app

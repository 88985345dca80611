"""vLLM's HTTP-server flags, wired onto the app and into uvicorn: one place for what
`--uds`, `--ssl-*`, `--allowed-origins/-methods/-headers`, `--allow-credentials`,
`--root-path`, `--disable-fastapi-docs`, `--enable-request-id-headers` and
`--disable-uvicorn-access-log` do (core/config.py ServerConfig declares them).

- `install(app, server)` adds what lives in the app, outermost first: the root path
  (`RootPathMiddleware`), CORS (Starlette's CORSMiddleware, only when `--allowed-origins`
  is given: vLLM answers every origin by default, a server here answers none unless told),
  the X-Request-Id header (`RequestIdHeaderMiddleware`), and, with --disable-fastapi-docs, no
  /docs, /redoc or /openapi.json.
- `uvicorn_options(server)` is what uvicorn.Config takes: the socket (a Unix socket with
  `--uds`, else host and port), TLS, the access log.

CORS and the root path sit outside the API-key check, so a browser's preflight (OPTIONS,
which carries no key) is answered and a 401 carries the CORS headers the page needs to
read it; the API-key check sees the path without the prefix, as every route does.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

_DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


class RootPathMiddleware:
    """`--root-path /prefix`: a request for /prefix/... is served as ... (a proxy that keeps
    the prefix, or none at all), one without it as it is (a proxy that strips it); either
    way the app's `root_path` (in the OpenAPI schema's `servers`) is the prefix."""

    def __init__(self, app: Any, root_path: str) -> None:
        self.app = app
        self.root_path = root_path
        self._raw = root_path.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = dict(scope)
            path = scope.get("path", "")
            root = self.root_path
            if path == root or path.startswith(root + "/"):
                scope["path"] = path[len(root):] or "/"
                raw = scope.get("raw_path")
                if raw is not None and raw.startswith(self._raw):
                    scope["raw_path"] = raw[len(self._raw):] or b"/"
            scope["root_path"] = root
        await self.app(scope, receive, send)


class RequestIdHeaderMiddleware:
    """`--enable-request-id-headers`: every response carries X-Request-Id, the request's
    own when it sent one, else a new one (a streamed completion's id header, set by the
    route, is left as it is)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id")
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", request_id))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def install(app: FastAPI, server: Any) -> None:
    """Add the middleware and route changes `server` (a validated ServerConfig) asks for.
    Called once the app's routes and own middleware exist, so these are the outermost."""
    if server.disable_fastapi_docs:
        app.router.routes[:] = [r for r in app.router.routes
                                if getattr(r, "path", None) not in _DOCS_PATHS]
        app.openapi_url = app.docs_url = app.redoc_url = None
    if server.enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    if server.allowed_origins is not None:
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=server.allowed_origins,
                           allow_methods=server.allowed_methods or ["*"],
                           allow_headers=server.allowed_headers or ["*"],
                           allow_credentials=server.allow_credentials)
    if server.root_path:
        app.root_path = server.root_path
        app.add_middleware(RootPathMiddleware, root_path=server.root_path)


def uvicorn_options(server: Any) -> dict[str, Any]:
    """uvicorn.Config's keywords for the socket, TLS and the access log."""
    opts: dict[str, Any] = {"access_log": not server.disable_uvicorn_access_log}
    if server.uds:
        opts["uds"] = server.uds
    else:
        opts.update(host=server.host, port=server.port)
    if server.ssl_certfile:
        opts.update(ssl_keyfile=server.ssl_keyfile, ssl_certfile=server.ssl_certfile,
                    ssl_cert_reqs=server.ssl_cert_reqs)
        if server.ssl_ca_certs:
            opts["ssl_ca_certs"] = server.ssl_ca_certs
    return opts


def address(server: Any) -> str:
    """Where the server listens, for the start-up line."""
    scheme = "https" if server.ssl_certfile else "http"
    if server.uds:
        return f"{scheme} on unix socket {server.uds}"
    return f"{scheme}://{server.host}:{server.port}{server.root_path or ''}"

"""OpenAI-style error bodies, and the handlers that make every failure one.

OpenAI clients parse `{"error": {"message", "type", "param", "code"}}`; the official
`openai` package turns the status code into an exception class (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 503 InternalServerError, ...) and shows the message.
FastAPI's defaults (422 with a `detail` list, 500 as plain text) fit neither, so every route
of the app, the lab's included, answers errors through `error_response`.

Bad input is the client's fault and must never become a 500 or a hung connection: invalid
JSON, a body that is not an object and wrong field types all arrive here as pydantic /
FastAPI validation errors and leave as 400 (an unknown field: "Unrecognized request argument
supplied: <name>", as OpenAI says; a field iterserve does not implement yet: code
"unsupported_parameter").

A fault in the server is a 500 with an OpenAI body *and the connection stays usable*: the
catch-all is a plain ASGI middleware (`CatchAllMiddleware`) that answers and returns,
instead of Starlette's ServerErrorMiddleware, which re-raises after answering, so that
uvicorn closes the keep-alive connection. Error bodies are encoded ASCII-only, so no message
(a lone surrogate echoed from the request, say) can make the error itself fail to encode.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from iterserve.errors import IterserveError


logger = logging.getLogger(__name__)

# The error "type" OpenAI uses for each status family.
_TYPE_FOR_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """The JSON body of an error (also sent as the payload of an SSE error event)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class SafeJSONResponse(JSONResponse):
    """JSON encoded ASCII-only (\\u escapes): it can always be encoded."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(status_code: int, message: str, *, type: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style `{"error": {...}}` JSON response with the given status code."""
    return SafeJSONResponse(error_body(message, type=type, param=param, code=code),
                            status_code=status_code, headers=dict(headers) if headers else None)


class APIError(Exception):
    """Raise inside a route to answer with an error body (the app's handler renders it)."""

    def __init__(self, status_code: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | int | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or _TYPE_FOR_STATUS.get(status_code, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The OpenAI error body (also the payload of a stream's error event)."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return error_response(self.status_code, self.message, type=self.type, param=self.param,
                              code=self.code, headers=self.headers)


_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$|^[0-9]+$")
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """("body", "messages", 0, "role") -> "messages.0.role"; None for the body itself.
    Union-member tags pydantic puts in the location ("list[constrained-int]",
    "function-after[...]", a model's class name) are not fields and are dropped."""
    parts = [str(p) for p in loc if p != "body"]
    parts = [p for p in parts if _FIELD.match(p) and p not in _TYPE_NAMES]
    return ".".join(parts) or None


_MESSAGES = {"string_unicode": "the string is not valid Unicode (it holds a lone UTF-16 "
                               "surrogate)"}


def _best_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One error per parameter; for a union, the member error that says most (a range or a
    custom check rather than "Input should be a valid list")."""
    by_param: dict[str | None, list[dict[str, Any]]] = {}
    for e in errors:
        by_param.setdefault(_loc_to_param(e.get("loc", ())), []).append(e)
    best = []
    for errs in by_param.values():
        specific = [e for e in errs if not str(e.get("type", "")).endswith("_type")]
        best.append((specific or errs)[0])
    return best


def validation_message(exc: RequestValidationError
                       ) -> tuple[str, str | None, str | None]:
    """A one-line message, the offending parameter and a code from a FastAPI/pydantic error
    list."""
    msg, param = _validation_message(exc)
    codes = {e.get("type") for e in exc.errors()[:1]}
    code = "unsupported_parameter" if "unsupported_parameter" in codes else None
    return msg, param, code


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    extra = [e for e in errors if e.get("type") == "extra_forbidden"]
    if extra:                       # OpenAI's wording for an unknown field
        names = [_loc_to_param(e.get("loc", ())) for e in extra]
        return ("Unrecognized request argument supplied: " + ", ".join(str(n) for n in names),
                names[0])
    unsupported = [e for e in errors if e.get("type") == "unsupported_parameter"]
    if unsupported:
        e = unsupported[0]
        return str(e.get("msg")), _loc_to_param(e.get("loc", ()))
    errors = _best_errors(errors)
    first = errors[0]
    etype = first.get("type", "")
    param = _loc_to_param(first.get("loc", ()))
    if etype == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = ctx.get("error")
        return (f"the request body is not valid JSON{': ' + str(detail) if detail else ''}",
                None)
    if param is None and etype in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object", None
    if param is None and etype == "missing":
        return "the request body is missing (expected a JSON object)", None
    msgs = []
    for err in errors[:3]:
        p = _loc_to_param(err.get("loc", ()))
        text = _MESSAGES.get(str(err.get("type")), err.get("msg"))
        msgs.append(f"{p}: {text}" if p else str(text))
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(msgs) + more, param


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param, code = validation_message(exc)
    return error_response(400, message, param=param, code=code)


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    return error_response(exc.status_code, detail,
                          type=_TYPE_FOR_STATUS.get(exc.status_code, "invalid_request_error"),
                          headers=getattr(exc, "headers", None))


def to_api_error(exc: BaseException) -> APIError | None:
    """The HTTP answer for an exception (None: not one of ours, a bug, so a 500).

    An IterserveError carries its whole answer (iterserve/errors.py): status, type, code,
    param, message and Retry-After. A bare ValueError is *not* assumed to be the client's
    fault."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, IterserveError):
        return APIError(exc.status_code, exc.http_message(), type=exc.error_type,
                        param=exc.param, code=exc.code, headers=exc.http_headers() or None)
    return None


async def _on_iterserve_error(request: Request, exc: Exception) -> JSONResponse:
    err = to_api_error(exc)
    if err is None:
        raise exc
    if err.status_code >= 500:
        logger.error("server fault on %s %s: %s", request.method, request.url.path, exc,
                     exc_info=exc)
    return err.response()


class CatchAllMiddleware:
    """Any exception a route lets escape becomes a 500 with an OpenAI body, and the
    connection stays open (nothing is re-raised to uvicorn, which would close it)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_wrapper(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:             # mid-response: nothing sensible can be sent any more
                raise
            resp = error_response(500, f"internal server error: {type(exc).__name__}: {exc}",
                                  type="internal_error")
            await resp(scope, receive, send)


def install_exception_handlers(app: FastAPI) -> None:
    """Make every error the app can produce an OpenAI-style body (400 for bad input)."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(IterserveError, _on_iterserve_error)
    app.add_middleware(CatchAllMiddleware)

"""The published /openapi.json says what the server does.

FastAPI documents a 422 with its own `detail` body for every route with a body; this server
answers validation errors 400 with an OpenAI error body (server/errors.py). So the schema is
post-processed once: 422 becomes 400 (`ErrorResponse`), POST routes document 413 (the body
limit), 404 (an unknown model) and 503 (busy / shutting down), every route but the open ones
documents 401 when an API key is set, and max_tokens / max_completion_tokens get this app's
maximum (max_model_len - 1: the smallest prompt has one token; prompt + max_tokens <=
max_model_len is stated in the field's description and checked after tokenising), and the
logprobs fields the server's --max-logprobs. Every
other limit comes from the pydantic constraints in server/protocol.py.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "title": "ErrorResponse",
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "code": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
        }}},
}
_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_OPEN = ("/health", "/ping")


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _REF}}}


def _set_int_maximum(prop: dict[str, Any], maximum: int) -> None:
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") == "integer":
            branch["maximum"] = maximum


def install_openapi(app: FastAPI, *, max_model_len: int | None, api_key: bool,
                    max_request_body_bytes: int, max_logprobs: int | None = None) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                             routes=app.routes)
        for path, ops in schema.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                if responses.pop("422", None) is not None or method == "post":
                    responses["400"] = _error("invalid request (OpenAI error body; `param` "
                                              "names the field)")
                if method == "post":
                    responses["413"] = _error(f"the body exceeds {max_request_body_bytes} "
                                              "bytes (--max-request-body-bytes)")
                    if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
                        responses["404"] = _error("the model named is not served here")
                        responses["503"] = _error("busy (Retry-After) or shutting down")
                if api_key and path not in _OPEN and not path.startswith("/lab"):
                    responses["401"] = _error("missing or wrong API key "
                                              "(WWW-Authenticate: Bearer)")
                responses.setdefault("500", _error("a fault in the server"))
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        schemas["ErrorResponse"] = ERROR_SCHEMA
        if max_model_len is not None:
            for name in ("CompletionRequest", "ChatCompletionRequest", "MessagesRequest"):
                props = schemas.get(name, {}).get("properties", {})
                for field in ("max_tokens", "max_completion_tokens"):
                    if field in props:
                        _set_int_maximum(props[field], max(1, max_model_len - 1))
        if max_logprobs is not None:            # --max-logprobs (the engine checks it)
            for name, fields in (("CompletionRequest", ("logprobs", "prompt_logprobs")),
                                 ("ChatCompletionRequest", ("top_logprobs", "prompt_logprobs"))):
                props = schemas.get(name, {}).get("properties", {})
                for field in fields:
                    if field in props:
                        _set_int_maximum(props[field], max_logprobs)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

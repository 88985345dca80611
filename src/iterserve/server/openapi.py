"""The published /openapi.json says what the server does.

The aim: a request valid by the schema is served (2xx), and one the server refuses is
invalid by the schema, wherever JSON Schema can say it (tests/server/test_schema_fuzz.py
fuzzes every operation for 5xx and error bodies; a few schema-valid bodies, such as an empty
`structured_outputs` or a `response_format` without a type, are still refused). FastAPI's
schema is generated from server/protocol.py's pydantic models (their limits, the neutral-only unsupported fields, the chat messages'
role rules) and post-processed once here with what only the running app knows:

- errors: FastAPI documents a 422 with its own `detail` body; this server answers validation
  errors 400 with an OpenAI error body (server/errors.py), so 422 becomes 400
  (`ErrorResponse`); POST routes document 413 (the body limit), the model routes 404 (an
  unknown model) and 503 (busy, with Retry-After, or shutting down); GET routes that read
  the engine document 503; the trace route documents 404 (an unknown or forgotten request);
  every route but the open ones documents 401 when an API key is set;
- media types: /metrics answers Prometheus' text format, /ping an empty text/plain body;
- this app's numbers: max_tokens / max_completion_tokens <= max_model_len - 1 (the smallest
  prompt has one token; prompt + max_tokens <= max_model_len is stated in the field's
  description and checked after tokenising), the logprobs fields <= --max-logprobs, token
  ids (prompts, allowed_token_ids, logit_bias keys, /detokenize) < the vocabulary size, and the fields another scheduling
  policy needs (`priority` off the priority policy, `ttft_slo_ms` / `tpot_slo_ms` off the
  slo policy: the only value served is the neutral one).

What JSON Schema cannot say stays in the descriptions and the README: a prompt's length in
tokens, the content of a regex / grammar / JSON-schema constraint and its limits
(structured/limits.py), a tool_choice that needs tools, echo with logprobs.
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
_ENGINE_GETS = ("/health", "/ping", "/v1/engine/stats", "/v1/requests/{request_id}/trace")
_TEXT = {"text/plain": {"schema": {"type": "string"}}}
_TRACE_OP = "trace_v1_requests__request_id__trace_get"


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _REF}}}


def _set_int_maximum(prop: dict[str, Any], maximum: int) -> None:
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") == "integer":
            branch["maximum"] = maximum


def _token_ids(prop: Any, maximum: int) -> None:
    """Every integer schema inside `prop` (arrays of token ids, nested) gets `maximum`."""
    if isinstance(prop, dict):
        if prop.get("type") == "integer":
            prop["maximum"] = min(prop.get("maximum", maximum), maximum)
        for v in prop.values():
            _token_ids(v, maximum)
    elif isinstance(prop, list):
        for v in prop:
            _token_ids(v, maximum)


def int_range_pattern(n: int) -> str:
    """A regex matching exactly the decimal integers 0..n (no leading zeros)."""
    if n < 10:
        return f"^[0-{n}]$"
    s = str(n)
    alts = ["[0-9]"]                                          # one digit
    for width in range(2, len(s)):                            # shorter than n: any
        alts.append("[1-9]" + "[0-9]" * (width - 1))
    for i, d in enumerate(s):                                 # n's width: digit by digit
        lo = 1 if i == 0 else 0
        if int(d) > lo:
            head = s[:i]
            alts.append(head + f"[{lo}-{int(d) - 1}]" + "[0-9]" * (len(s) - i - 1))
    alts.append(s)
    return "^(" + "|".join(alts) + ")$"


def _only_neutral(props: dict[str, Any], field: str, neutral: list[Any], why: str) -> None:
    if field in props:
        props[field] = {"enum": neutral, "title": props[field].get("title", field),
                        "description": why}


# POST routes outside /v1/ that name a model: the tokeniser's and vLLM's pooling spellings.
_MODEL_POSTS = ("/tokenize", "/detokenize", "/score", "/rerank")


def install_openapi(app: FastAPI, *, max_model_len: int | None, api_key: bool,
                    max_request_body_bytes: int, max_logprobs: int | None = None,
                    vocab_size: int | None = None, scheduling_policy: str | None = None,
                    trust_request_chat_template: bool = True,
                    auto_tool_choice: bool = True) -> None:
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
                    if path.startswith(("/v1/", "/v2/")) or path in _MODEL_POSTS:
                        responses["404"] = _error("the model named is not served here")
                        responses["503"] = _error("busy (Retry-After) or shutting down")
                if path in _ENGINE_GETS:
                    responses["503"] = _error("no model loaded, or the engine is shut down")
                if path == "/v1/requests/{request_id}/trace":
                    responses["404"] = _error("no such request (unknown, or finished too long "
                                              "ago to be kept)")
                if path == "/metrics":
                    responses["200"]["content"] = _TEXT
                if path == "/ping":
                    responses["200"] = {"description": "the server is up (an empty body)",
                                        "content": _TEXT}
                if api_key and path not in _OPEN and not path.startswith("/lab"):
                    responses["401"] = _error("missing or wrong API key "
                                              "(WWW-Authenticate: Bearer)")
                responses.setdefault("500", _error("a fault in the server"))
                if path == "/v1/completions" and method == "post":
                    # A single prompt's response id names its trace: the stateful link.
                    responses["200"]["links"] = {"trace": {
                        "operationId": _TRACE_OP,
                        "parameters": {"request_id": "$response.body#/id"},
                        "description": "the request's lifecycle events"}}
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
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            props = schemas.get(name, {}).get("properties", {})
            if vocab_size is not None:
                for field in ("allowed_token_ids", "prompt"):
                    if field in props:
                        _token_ids(props[field], vocab_size - 1)
                if "logit_bias" in props:
                    for branch in props["logit_bias"].get("anyOf", []):
                        if branch.get("type") == "object":
                            branch["propertyNames"] = {
                                "pattern": int_range_pattern(vocab_size - 1)}
            if scheduling_policy is not None and scheduling_policy != "priority":
                _only_neutral(props, "priority", [0, None],
                              f"only 0: this server schedules {scheduling_policy} "
                              "(--scheduling-policy priority takes a priority)")
            if scheduling_policy is not None and scheduling_policy != "slo":
                for field in ("ttft_slo_ms", "tpot_slo_ms"):
                    _only_neutral(props, field, [None],
                                  f"only null: this server schedules {scheduling_policy} "
                                  "(--scheduling-policy slo takes latency targets)")
        for name in ("ChatCompletionRequest", "TokenizeChatRequest"):
            props = schemas.get(name, {}).get("properties", {})
            if not trust_request_chat_template:
                _only_neutral(props, "chat_template", [None],
                              "only null: a request's own template needs a server started "
                              "with --trust-request-chat-template")
        for chat in (schemas.get("ChatCompletionRequest"), schemas.get("ResponsesRequest")):
            if chat is None or auto_tool_choice:
                continue
            # Without --enable-auto-tool-choice, "auto" (the default when tools are given) is
            # refused: tools need an explicit "none", "required" or named choice.
            chat.setdefault("allOf", []).extend([
                {"properties": {"tool_choice": {"not": {"const": "auto"}}}},
                {"if": {"required": ["tools"], "properties": {"tools": {"type": "array",
                                                                         "minItems": 1}}},
                 "then": {"required": ["tool_choice"],
                          "properties": {"tool_choice": {"not": {"type": "null"}}}}}])
        if vocab_size is not None:
            for name in ("DetokenizeRequest", "TokenizeCompletionRequest"):
                props = schemas.get(name, {}).get("properties", {})
                if "tokens" in props:
                    _token_ids(props["tokens"], vocab_size - 1)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

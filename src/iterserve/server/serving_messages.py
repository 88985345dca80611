"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

The body (server/protocol_anthropic.py) becomes the ChatCompletionRequest it is, so it is
validated, rendered through the chat template, tool-planned (server/serving_tools.py: the
same parsers, forcing grammar and the `--enable-auto-tool-choice` rule for "auto") and
sampled exactly as a chat request; replies are read back through serving_chat's
`final_chat` / `chat_deltas`, which Responses uses too. Mapped: `system` -> a system
message, `tool_use` blocks -> assistant tool_calls, `tool_result` blocks -> tool messages,
`tools[].input_schema` -> function parameters, `tool_choice` auto / any / tool / none ->
"auto" / "required" / the named function / "none", `disable_parallel_tool_use` ->
parallel_tool_calls false, `stop_sequences` -> stop, `output_config.format` ->
response_format json_schema.

The reply is a `message`: a `text` block for the content and a `tool_use` block per call
(`input` the arguments object; ids `toolu_...`); `stop_reason` "tool_use" when the model
called tools, "max_tokens" on the length cut, "stop_sequence" (with `stop_sequence`) when one
matched, else "end_turn". `usage.input_tokens` counts the prompt tokens not read from the
prefix cache, `cache_read_input_tokens` those that were (Anthropic's split).

Streams send Anthropic's events, `event:` + `data:` per frame: message_start, ping, then per
block content_block_start, content_block_delta (text_delta / input_json_delta) ...
content_block_stop, and message_delta (stop_reason, usage) and message_stop; a failure mid
stream is an `error` event. No `[DONE]`.

Errors on these routes have Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}`: `AnthropicErrorShape` rewrites every error answer under /v1/messages (the
app's own 400s for bad bodies, the key check's 401, the 413 of the body limit, a 500), so
the one error path of the app stays the one that decides the status.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from iterserve.engine.async_engine import AsyncEngine
from iterserve.server.errors import APIError, to_api_error
from iterserve.server.protocol_anthropic import CountTokensRequest, MessagesRequest
from iterserve.server.serving_chat import (
    FinalChat, StartedChat, as_chat_request, chat_deltas, final_chat, render_request,
    start_chat)
from iterserve.server.serving_common import check_model, close_streams
from iterserve.server.serving_config import ServingConfig

PATH = "/v1/messages"


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _tool_use_id(call_id: str) -> str:
    """Anthropic's `toolu_` ids, from the parser's `call_` ones (the same id in a stream and
    in the final message)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish_reason: str | None, stop: str | int | None, called: bool
                ) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for the engine's finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "tool_use", "id": _tool_use_id(call["id"]), "name": fn["name"],
            "input": json.loads(fn["arguments"])}       # ToolPlan.apply: a JSON object


def message_body(done: FinalChat, *, msg_id: str, model: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    calls = done.message.get("tool_calls") or []
    text = done.message.get("content")
    # a reply without calls has its text block, empty or not (as a stream's); one that the
    # length cut before anything was certain has none
    if text or (text is not None and done.co.finish_reason != "length"):
        content.append({"type": "text", "text": text})
    content += [_tool_use_block(c) for c in calls]
    reason, seq = stop_reason(done.co.finish_reason, done.co.stop_reason, done.called)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": seq,
            "usage": _usage(done.out.num_prompt_tokens, done.out.num_cached_tokens or 0,
                            len(done.co.token_ids))}


async def create_message(body: MessagesRequest, raw: Request, engine: AsyncEngine,
                         served_model: str, config: ServingConfig | None = None):
    chat = as_chat_request(body.to_chat(), "messages")
    msg_id = _id("msg")
    started = await start_chat(chat, engine, served_model, config or ServingConfig(), msg_id)
    if not body.stream:
        done = await final_chat(started, raw)
        if done is None:
            return JSONResponse({}, status_code=499)          # the client is gone
        return JSONResponse(message_body(done, msg_id=msg_id, model=served_model))
    return StreamingResponse(_events(started, msg_id, served_model),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Request-Id": msg_id})


def _event(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The open content block of a stream, and the events that open and close blocks."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None           # "text" | "tool_use"
        self.call_index: int | None = None     # the chat tool-call index of an open tool_use

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = self.call_index = None
        self.count += 1
        return [_event("content_block_stop", index=self.count - 1)]

    def start(self, block: dict[str, Any]) -> list[str]:
        evs = self.close()
        self.open = block["type"]
        evs.append(_event("content_block_start", index=self.count, content_block=block))
        return evs

    def on_delta(self, delta: dict[str, Any]) -> list[str]:
        evs: list[str] = []
        if delta.get("content"):
            if self.open != "text":
                evs += self.start({"type": "text", "text": ""})
            evs.append(_event("content_block_delta", index=self.count,
                              delta={"type": "text_delta", "text": delta["content"]}))
        for tc in delta.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if "id" in tc:
                evs += self.start({"type": "tool_use", "id": _tool_use_id(tc["id"]),
                                   "name": fn.get("name", ""), "input": {}})
                self.call_index = tc["index"]
            if fn.get("arguments") and tc["index"] == self.call_index:
                evs.append(_event("content_block_delta", index=self.count, delta={
                    "type": "input_json_delta", "partial_json": fn["arguments"]}))
        return evs


async def _events(started: StartedChat, msg_id: str, model: str) -> AsyncIterator[str]:
    blocks = _Blocks()
    yield _event("message_start", message={
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": _usage(started.num_prompt_tokens, 0, 0)})
    yield _event("ping")
    last = None
    try:
        async for step in chat_deltas(started):
            last = step
            for ev in blocks.on_delta(step.delta):
                yield ev
        if last is None or last.finish_reason is None or last.finish_reason == "abort":
            raise APIError(503, "the request was aborted: the server is shutting down",
                           type="service_unavailable")
    except Exception as e:                       # noqa: BLE001 - reported in the stream
        err = e if isinstance(e, APIError) else to_api_error(e)
        status = err.status_code if err is not None else 500
        message = err.message if err is not None else f"{type(e).__name__}: {e}"
        yield _event("error", error={"type": anthropic_error_type(status), "message": message})
        return
    finally:
        await close_streams(started.streams)
    for ev in blocks.close():
        yield ev
    if blocks.count == 0 and not last.called and last.finish_reason != "length":
        # as the non-streamed message: a reply with no calls has its (empty) text block
        for ev in blocks.start({"type": "text", "text": ""}) + blocks.close():
            yield ev
    reason, seq = stop_reason(last.finish_reason, last.stop_reason, last.called)
    yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                 usage=_usage(last.num_prompt_tokens, last.num_cached_tokens,
                              last.completion_tokens))
    yield _event("message_stop")


async def count_message_tokens(body: CountTokensRequest, engine: AsyncEngine,
                               served_model: str, config: ServingConfig | None = None
                               ) -> dict[str, int]:
    """The prompt a message with this body would have (template, tools and all), counted."""
    chat = as_chat_request(body.chat_fields(), "messages")
    try:
        check_model(body.model, served_model)
        _, ids = await render_request(engine, chat, config or ServingConfig())
    except Exception as e:
        raise (to_api_error(e) or e) from e
    return {"input_tokens": len(ids)}


# --- Anthropic's error shape ------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                529: "overloaded_error"}


def anthropic_error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(status: int, body: bytes) -> bytes:
    """An OpenAI error body (server/errors.py) in Anthropic's shape; other bodies as they
    are."""
    try:
        data = json.loads(body)
        message = data["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body
    return json.dumps({"type": "error", "error": {"type": anthropic_error_type(status),
                                                  "message": message}},
                      ensure_ascii=True).encode("ascii")


class AnthropicErrorShape:
    """Outermost middleware: an error answer (status >= 400, JSON) on a /v1/messages route
    is rewritten into Anthropic's shape, whoever made it (a route, the validation handler,
    the key check, the body limit, the catch-all); everything else passes untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == PATH or path.startswith(PATH + "/")):
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] | None = None
        chunks: list[bytes] = []

        async def rewrite(message: Any) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                if message["status"] >= 400 and \
                        headers.get(b"content-type", b"").startswith(b"application/json"):
                    start = message                  # hold it until the body is known
                    return
                await send(message)
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = anthropic_error_body(start["status"], b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers") or []
                       if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receive, rewrite)


def install_messages_api(app: FastAPI, require_engine: Callable[[], AsyncEngine],
                         served_model: str | None, config: ServingConfig) -> None:
    """The two routes and the error shape, on `app` (server/app.py calls this once)."""

    @app.post(PATH)
    async def messages(body: MessagesRequest, raw: Request):
        return await create_message(body, raw, require_engine(), served_model, config)

    @app.post(PATH + "/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        return await count_message_tokens(body, require_engine(), served_model, config)

    app.add_middleware(AnthropicErrorShape)

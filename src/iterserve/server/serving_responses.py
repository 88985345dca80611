"""POST /v1/responses: OpenAI's Responses API as a thin layer over the chat path.

Stateless (nothing is stored: `store` is accepted and ignored, `previous_response_id` is a
400). The request becomes a ChatCompletionRequest (so it is validated, rendered, tool-planned
and sampled exactly as a chat request): `instructions` -> a leading system message; `input`
text -> a user message; input items -> chat messages (`message` items by role,
consecutive `function_call` items -> one assistant message with tool_calls,
`function_call_output` -> a `tool` message); Responses' flat function tools and tool_choice
-> chat's nested ones; `text.format` -> response_format; `max_output_tokens` -> max_tokens.

The reply's `output` is a `message` item (output_text) for the content and a
`function_call` item per call; `status` "incomplete" with reason max_output_tokens when the
length cut it. Streaming sends the Responses events (`event:` + `data:` per SSE frame, each
with its sequence_number): response.created, response.in_progress, output_item.added,
content_part.added, output_text.delta ... done, function_call_arguments.delta ... done,
output_item.done, and response.completed (or response.incomplete); no `[DONE]`, as OpenAI.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Literal, Union

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from iterserve.engine.async_engine import AsyncEngine
from iterserve.server.protocol import (
    MAX_TOOLS, ChatCompletionRequest, FunctionName, INT64_MAX, NonEmptyText, Text, _Model,
    _EMPTY_LIST, _NEEDS_TOOLS, _not_implemented, _nothing, _falsy)
from iterserve.server.serving_chat import (
    as_chat_request, chat_deltas, final_chat, start_chat)
from iterserve.server.serving_common import close_streams, stream_error
from iterserve.server.serving_config import ServingConfig


def _hex_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --- the request ---------------------------------------------------------------------------

class InputText(_Model):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None      # echoed back by SDKs (output_text)
    logprobs: list[Any] | None = None


class MessageItem(_Model):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[InputText], Field(max_length=4096)]
    id: Text | None = None
    status: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: NonEmptyText
    name: FunctionName
    arguments: Text
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: NonEmptyText
    output: Text
    id: Text | None = None
    status: Text | None = None


class ReasoningPart(_Model):
    type: Literal["summary_text", "reasoning_text"]
    text: Text


class ReasoningItem(_Model):
    """A reasoning item, as the SDKs send back a previous response's output items. Accepted
    and left out of the prompt: the chat templates served here render no reasoning of earlier
    turns (templates that have such a field drop it for past turns too)."""

    type: Literal["reasoning"]
    id: Text | None = None
    summary: Annotated[list[ReasoningPart], Field(max_length=4096)] = []
    content: Annotated[list[ReasoningPart], Field(max_length=4096)] | None = None
    encrypted_content: Text | None = None
    status: Text | None = None


def _item_kind(v: Any) -> str:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    # No type: a message (EasyInputMessage); an unknown one is refused by its own name.
    return "message" if t is None else t if isinstance(t, str) else "message"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_item_kind)]


class FunctionTool(_Model):
    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Model):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: Annotated[Any, _not_implemented("text.verbosity", _nothing, "only null")] = None


class ResponsesRequest(_Model):
    model_config = ConfigDict(json_schema_extra={"allOf": [_NEEDS_TOOLS]})

    model: Text | None = None
    input: NonEmptyText | Annotated[list[InputItem], Field(
        min_length=1, max_length=4096, json_schema_extra={"contains": {"not": {
            "required": ["type"], "properties": {"type": {"const": "reasoning"}}}}},
        description="at least one item that is not a reasoning item")]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    # accepted no-ops (stateless: nothing is stored)
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: Text | None = None
    service_tier: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    # not implemented: a 400 naming the field unless neutral
    previous_response_id: Annotated[Any, _not_implemented(
        "previous_response_id", _nothing, "only null: this server stores no responses",
        {"type": "null"})] = None
    conversation: Annotated[Any, _not_implemented("conversation", _nothing, "only null")] = None
    reasoning: Annotated[Any, _not_implemented("reasoning", _nothing, "only null")] = None
    include: Annotated[list[Any] | None, _not_implemented("include", _falsy,
                                                          "only empty", _EMPTY_LIST)] = None
    background: Annotated[bool | None, _not_implemented("background", _falsy,
                                                        "only false")] = None
    prompt: Annotated[Any, _not_implemented("prompt", _nothing, "only null")] = None
    top_logprobs: Annotated[int | None, _not_implemented("top_logprobs", _falsy,
                                                         "only 0")] = None
    max_tool_calls: Annotated[Any, _not_implemented("max_tool_calls", _nothing,
                                                    "only null")] = None

    @model_validator(mode="after")
    def _something_to_answer(self) -> "ResponsesRequest":
        if isinstance(self.input, list) and all(isinstance(i, ReasoningItem)
                                                for i in self.input):
            raise PydanticCustomError("input", "input holds only reasoning items: there is "
                                      "no message to answer", {})
        return self

    def to_chat_request(self) -> ChatCompletionRequest:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) \
            else self.input
        for item in items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, ReasoningItem):
                continue                # not rendered (ReasoningItem)
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                prev = messages[-1] if messages else None
                if prev is not None and prev["role"] == "assistant":
                    prev.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": item.output})
        body: dict[str, Any] = {"messages": messages, "stream": bool(self.stream)}
        if self.model is not None:
            body["model"] = self.model
        for name in ("temperature", "top_p", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                exclude_none=True, exclude={"type"})} for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else \
                {"type": "function", "function": {"name": self.tool_choice.name}}
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type != "text":
            if fmt.type == "json_object":
                body["response_format"] = {"type": "json_object"}
            else:
                spec = {"name": fmt.name or "output"}
                if fmt.schema_ is not None:
                    spec["schema"] = fmt.schema_
                if fmt.strict is not None:
                    spec["strict"] = fmt.strict
                body["response_format"] = {"type": "json_schema", "json_schema": spec}
        return as_chat_request(body, "input")


# --- the response --------------------------------------------------------------------------

def _usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": 0}}


class _Shell:
    """The response object's fields that do not depend on the output."""

    def __init__(self, body: ResponsesRequest, served_model: str, request_id: str) -> None:
        self.body = body
        self.id = request_id
        self.created_at = int(time.time())
        self.model = served_model

    def build(self, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, incomplete: str | None = None) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.instructions, "metadata": b.metadata or {},
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "temperature": b.temperature, "top_p": b.top_p,
            "max_output_tokens": b.max_output_tokens,
            "tool_choice": (b.tool_choice if isinstance(b.tool_choice, str) else
                            b.tool_choice.model_dump() if b.tool_choice else
                            ("auto" if b.tools else "none")),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "text": {"format": {"type": "text"}} if not (b.text and b.text.format) else
            {"format": b.text.format.model_dump(exclude_none=True, by_alias=True)},
            "truncation": "disabled", "store": False, "background": False,
            "previous_response_id": None, "reasoning": None, "user": b.user,
            "usage": usage,
        }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


async def create_response(body: ResponsesRequest, raw: Request, engine: AsyncEngine,
                          served_model: str, config: ServingConfig | None = None):
    chat = body.to_chat_request()
    started = await start_chat(chat, engine, served_model, config or ServingConfig(),
                               _hex_id("resp"))
    shell = _Shell(body, served_model, started.request_id)
    if not body.stream:
        done = await final_chat(started, raw)
        if done is None:
            return JSONResponse({}, status_code=499)      # the client is gone
        out, co, message = done.out, done.co, done.message
        output = []
        if message.get("content"):
            output.append(_message_item(_hex_id("msg"), message["content"]))
        for call in message.get("tool_calls") or []:
            output.append(_call_item(_hex_id("fc"), call["id"], call["function"]["name"],
                                     call["function"]["arguments"]))
        cut = co.finish_reason == "length"
        return JSONResponse(shell.build(
            "incomplete" if cut else "completed", output,
            _usage(out.num_prompt_tokens, len(co.token_ids), out.num_cached_tokens or 0),
            "max_output_tokens" if cut else None))
    return _stream(shell, started)


def _stream(shell: _Shell, started) -> StreamingResponse:
    seq = 0

    def event(kind: str, **data: Any) -> str:
        nonlocal seq
        payload = {"type": kind, "sequence_number": seq, **data}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def events() -> AsyncIterator[str]:
        output: list[dict[str, Any]] = []           # finished items
        current: dict[str, Any] | None = None       # the open item
        calls: dict[int, dict[str, Any]] = {}       # tool call index -> its item

        def close() -> list[str]:
            nonlocal current
            if current is None:
                return []
            item, idx, current = current, len(output), None
            evs = []
            if item["type"] == "message":
                text = item["content"][0]["text"]
                evs.append(event("response.output_text.done", item_id=item["id"],
                                 output_index=idx, content_index=0, text=text, logprobs=[]))
                evs.append(event("response.content_part.done", item_id=item["id"],
                                 output_index=idx, content_index=0,
                                 part=item["content"][0]))
            else:
                evs.append(event("response.function_call_arguments.done", item_id=item["id"],
                                 output_index=idx, name=item["name"],
                                 arguments=item["arguments"]))
            item["status"] = "completed"
            evs.append(event("response.output_item.done", output_index=idx, item=item))
            output.append(item)
            return evs

        def on_delta(delta: dict[str, Any]) -> list[str]:
            nonlocal current
            evs: list[str] = []
            text = delta.get("content")
            if text:
                if current is None or current["type"] != "message":
                    evs += close()
                    current = _message_item(_hex_id("msg"), "", "in_progress")
                    current["content"] = []
                    evs.append(event("response.output_item.added", output_index=len(output),
                                     item=current))
                    part = {"type": "output_text", "text": "", "annotations": [],
                            "logprobs": []}
                    current["content"].append(part)
                    evs.append(event("response.content_part.added", item_id=current["id"],
                                     output_index=len(output), content_index=0,
                                     part=dict(part)))
                current["content"][0]["text"] += text
                evs.append(event("response.output_text.delta", item_id=current["id"],
                                 output_index=len(output), content_index=0, delta=text,
                                 logprobs=[]))
            for tc in delta.get("tool_calls") or []:
                fn = tc.get("function", {})
                if "id" in tc:
                    evs += close()
                    current = _call_item(_hex_id("fc"), tc["id"], fn.get("name", ""), "",
                                         "in_progress")
                    calls[tc["index"]] = current
                    evs.append(event("response.output_item.added", output_index=len(output),
                                     item=dict(current)))
                frag = fn.get("arguments") or ""
                if frag and current is calls.get(tc["index"]):
                    current["arguments"] += frag
                    evs.append(event("response.function_call_arguments.delta",
                                     item_id=current["id"], output_index=len(output),
                                     delta=frag))
            return evs

        yield event("response.created", response=shell.build("in_progress", [], None))
        yield event("response.in_progress", response=shell.build("in_progress", [], None))
        prompt_tokens = cached = completion_tokens = 0
        finish = None
        try:
            async for step in chat_deltas(started):
                prompt_tokens = step.num_prompt_tokens
                cached = step.num_cached_tokens
                completion_tokens = step.completion_tokens
                for ev in on_delta(step.delta):
                    yield ev
                finish = step.finish_reason or finish
        except Exception as e:     # noqa: BLE001 - reported, in the one error shape
            err = stream_error(e)
            for ev in close():
                yield ev
            # The Responses API's error event, then the response as failed (its `error`
            # holds the same code and message a non-streamed request gets as its body).
            code = err.code or err.type
            yield event("error", code=code, message=err.message, param=err.param)
            failed = shell.build("failed", output,
                                 _usage(prompt_tokens, completion_tokens, cached))
            failed["error"] = {"code": code, "message": err.message}
            yield event("response.failed", response=failed)
            return
        finally:
            await close_streams(started.streams)
        for ev in close():
            yield ev
        cut = finish == "length"
        final = shell.build("incomplete" if cut else "completed", output,
                            _usage(prompt_tokens, completion_tokens, cached),
                            "max_output_tokens" if cut else None)
        yield event("response.incomplete" if cut else "response.completed", response=final)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache",
                                      "X-Request-Id": shell.id})

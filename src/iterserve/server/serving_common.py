"""What completions and chat share: error mapping, SSE framing, stream merging, usage,
and cancellation when the client goes away.

Cancellation is the one subtle part. A streaming response's body generator is cancelled by
Starlette when the client disconnects; closing our per-request streams in its `finally`
aborts the requests (AsyncEngine queues the abort before the next step). A non-streaming
request has no body generator yet while it waits, so `collect_final` polls
`request.is_disconnected()` and cancels the wait itself.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from iterserve.core.request import SamplingParamsError
from iterserve.engine.async_engine import EngineDeadError
from iterserve.engine.errors import InvalidRequestError, UnknownModelError
from iterserve.engine.outputs import RequestOutput, TokenLogprob
from iterserve.server.errors import APIError, error_body

DISCONNECT_POLL_S = 0.25


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_s() -> int:
    return int(time.time())


def to_api_error(exc: BaseException) -> APIError | None:
    """The HTTP answer for an exception raised while accepting a request (None: a bug)."""
    from iterserve.core.scheduler import QueueFullError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, UnknownModelError):
        return APIError(404, str(exc), param=exc.param, code="model_not_found")
    if isinstance(exc, QueueFullError):
        return APIError(503, f"the server is busy: {exc}", type="service_unavailable",
                        headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="service_unavailable")
    if isinstance(exc, (SamplingParamsError, InvalidRequestError)):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, ValueError):           # scheduler "can never fit", chat template, ...
        return APIError(400, str(exc))
    return None


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise UnknownModelError(f"the model {requested!r} does not exist; this server "
                                f"serves {served!r}", "model")


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def sse_error(message: str, type: str = "internal_error") -> str:
    return sse(error_body(message, type=type))


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def merge_streams(streams: Sequence[AsyncIterator[RequestOutput]]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as outputs arrive: (stream index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in it:
                await q.put((i, out))
        except BaseException as e:        # noqa: BLE001 - re-raised in the consumer
            await q.put((i, e))
            return
        await q.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await close_streams(streams)


async def close_streams(streams: Sequence[AsyncIterator[RequestOutput]]) -> None:
    """Close every stream; an unfinished one aborts its request."""
    for it in streams:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except (RuntimeError, asyncio.CancelledError):
                pass               # already running/closed in a cancelled task


def sse_response(chunks: AsyncIterator[str], streams: Sequence[AsyncIterator[RequestOutput]],
                 request_id: str) -> StreamingResponse:
    """The SSE response both endpoints stream: `chunks` yields the endpoint's own events; an
    error mid-stream becomes an SSE error event, the stream always ends with `[DONE]`, and the
    request's streams are closed (aborting what is unfinished) however it ends, a client
    disconnect included."""
    async def events() -> AsyncIterator[str]:
        try:
            async for event in chunks:
                yield event
            yield sse("[DONE]")
        except APIError as e:
            yield sse_error(e.message, e.type)
            yield sse("[DONE]")
        except Exception as e:                  # the engine died mid-stream
            yield sse_error(f"{type(e).__name__}: {e}")
            yield sse("[DONE]")
        finally:
            await close_streams(streams)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Request-Id": request_id})


async def collect_final(streams: Sequence[AsyncIterator[RequestOutput]], request: Request
                        ) -> list[RequestOutput] | None:
    """The final output of each stream, or None if the client disconnected first."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def run() -> None:
        async for i, out in merge_streams(streams):
            if out.finished:
                finals[i] = out

    task = asyncio.ensure_future(run())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()
                return [f for f in finals if f is not None] if all(finals) else None
            if await request.is_disconnected():
                return None                 # the finally below aborts the requests
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await close_streams(streams)


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(tid: int, lp: float | None) -> dict[str, Any]:
        tok = token_text(tokenizer, tid)
        return {"token": tok, "logprob": lp if lp is not None else 0.0,
                "bytes": list(tok.encode("utf-8"))}

    content = []
    for lp in lps:
        e = entry(lp.token_id, lp.logprob)
        e["top_logprobs"] = [entry(t, v) for t, v in (lp.top_logprobs or [])]
        content.append(e)
    return {"content": content}


def completion_logprobs(tokenizer: Any, lps: list[TokenLogprob], text_offset: int
                        ) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset
    for lp in lps:
        tok = token_text(tokenizer, lp.token_id)
        tokens.append(tok)
        token_lps.append(lp.logprob)
        tops.append({token_text(tokenizer, t): v for t, v in (lp.top_logprobs or [])}
                    if lp.top_logprobs is not None else None)
        offsets.append(off)
        off += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def error_finish_message(out: RequestOutput) -> str | None:
    if out.error or any(o.finish_reason == "error" for o in out.outputs):
        return out.error or "the request failed in the engine"
    return None

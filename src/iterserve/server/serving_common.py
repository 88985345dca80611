"""What completions and chat share: error mapping, queueing the prompts, one choices /
streaming loop (`respond`, parameterised by a `ChoiceFormat`), SSE framing, stream merging,
usage, and cancellation when the client goes away.

A stream cut by shutdown ends like any other: each unfinished choice gets a chunk with
finish_reason "abort" (the engine's own abort output, or one made here if the engine stopped
first), the usage chunk when asked for, then `[DONE]`.

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
from fastapi.responses import JSONResponse, StreamingResponse

from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from iterserve.errors import (ConstraintTooComplexError, EngineDeadError, UnknownModelError,
                              UnsupportedParameterError)
from iterserve.server.errors import APIError, to_api_error

DISCONNECT_POLL_S = 0.25


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_s() -> int:
    return int(time.time())


def check_priority(priority: int | None, engine: AsyncEngine) -> int:
    """priority only means something under the priority policy; elsewhere 0 is the only
    honest value."""
    priority = priority or 0
    if priority and engine.scheduling_policy != "priority":
        raise UnsupportedParameterError(
            f"priority {priority} needs a server started with --scheduling-policy priority "
            f"(this one schedules {engine.scheduling_policy})", "priority")
    return priority


class ServedModel(str):
    """The served model's name as every endpoint passes it around: the first of
    --served-model-name's names (what responses carry), answering to all of them in a
    request's `model` (check_model) and listed by /v1/models."""

    names: tuple[str, ...]

    def __new__(cls, names: "str | list[str] | tuple[str, ...]") -> "ServedModel":
        names = (names,) if isinstance(names, str) else tuple(names)
        self = super().__new__(cls, names[0])
        self.names = names
        return self


def check_model(requested: str | None, served: str) -> None:
    names = getattr(served, "names", (served,))
    if requested is not None and requested not in names:
        also = f" (also {', '.join(map(repr, names[1:]))})" if len(names) > 1 else ""
        raise UnknownModelError(f"the model {requested!r} does not exist; this server "
                                f"serves {str(served)!r}{also}", "model")


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; with `cached_tokens` (--enable-prompt-tokens-details) also
    prompt_tokens_details.cached_tokens, the prompt tokens served from the prefix cache."""
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


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
        except Exception as e:                  # the engine died mid-stream
            yield sse(stream_error(e).body())
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


def token_name(tokenizer: Any, token_id: int, as_id: bool) -> str:
    """How logprobs name a token: its text, or vLLM's "token_id:<id>" with
    return_tokens_as_token_ids (a token that is not whole UTF-8 stays identifiable)."""
    return f"token_id:{token_id}" if as_id else token_text(tokenizer, token_id)


def chat_logprobs(tokenizer: Any, lps: list[TokenLogprob], *, token_ids_as_text: bool = False
                  ) -> dict[str, Any]:
    def entry(tid: int, lp: float | None) -> dict[str, Any]:
        tok = token_name(tokenizer, tid, token_ids_as_text)
        return {"token": tok, "logprob": lp if lp is not None else 0.0,
                "bytes": list(tok.encode("utf-8"))}

    content = []
    for lp in lps:
        e = entry(lp.token_id, lp.logprob)
        e["top_logprobs"] = [entry(t, v) for t, v in (lp.top_logprobs or [])]
        content.append(e)
    return {"content": content}


def completion_logprobs(tokenizer: Any, lps: list[TokenLogprob], text_offset: int, *,
                        token_ids_as_text: bool = False) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset
    for lp in lps:
        tok = token_text(tokenizer, lp.token_id)
        tokens.append(token_name(tokenizer, lp.token_id, token_ids_as_text))
        token_lps.append(lp.logprob)
        tops.append({token_name(tokenizer, t, token_ids_as_text): v
                     for t, v in (lp.top_logprobs or [])}
                    if lp.top_logprobs is not None else None)
        offsets.append(off)
        off += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def _finite(v: float) -> float:
    return max(v, -9999.0)          # as vLLM: JSON has no -Infinity


def prompt_logprobs_json(tokenizer: Any, plps: list | None, *, token_ids_as_text: bool = False
                         ) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id (as a JSON
    key): {"logprob", "rank", "decoded_token"}}."""
    if plps is None:
        return None
    return [None if d is None else {
        str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                 "decoded_token": f"token_id:{t}" if token_ids_as_text else lp.decoded_token}
        for t, lp in d.items()} for d in plps]


def echo_completion_logprobs(tokenizer: Any, prompt_ids: list[int], plps: list, k: int, *,
                             token_ids_as_text: bool = False) -> dict[str, Any]:
    """The prompt part of OpenAI's completions logprobs with `echo`: its tokens, their
    logprobs (None for the first), the top k plus the actual token, offsets from 0."""
    tokens, token_lps, tops, offsets = [], [], [], []
    off = 0
    for tid, d in zip(prompt_ids, plps):
        tokens.append(token_name(tokenizer, tid, token_ids_as_text))
        offsets.append(off)
        off += len(token_text(tokenizer, tid))
        if d is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_finite(d[tid].logprob))
        best = sorted(d.items(), key=lambda kv: kv[1].rank or 0)
        top = {token_name(tokenizer, t, token_ids_as_text): _finite(lp.logprob)
               for t, lp in best if (lp.rank or 0) <= k}
        top.setdefault(token_name(tokenizer, tid, token_ids_as_text), _finite(d[tid].logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def error_finish_message(out: RequestOutput) -> str | None:
    if out.error or any(o.finish_reason == "error" for o in out.outputs):
        return out.error or "the request failed in the engine"
    return None


def error_finish(out: RequestOutput) -> APIError | None:
    """The error of an output whose sequence ended with finish_reason "error", or None: a
    400 when the request's own constraint reached the grammar engine's limits while it
    generated (engine/outputs.py `error_code`), a 500 (a fault) otherwise."""
    msg = error_finish_message(out)
    if msg is None:
        return None
    code = getattr(out, "error_code", None)
    if code == ConstraintTooComplexError.code:
        return to_api_error(ConstraintTooComplexError(msg))
    return APIError(500, msg, type="internal_error", code=code)


def stream_error(exc: BaseException) -> APIError:
    """What a stream that broke mid-way reports in its error event: the same body a
    non-streamed request would get as its answer."""
    err = to_api_error(exc)
    if err is None:
        err = APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                       type="internal_error")
    return err


# --- queueing -------------------------------------------------------------------------------

async def start_streams(engine: AsyncEngine, request_id: str, prompts: list[Any], params: Any,
                        *, priority: int, prompt_texts: list[str | None] | None = None
                        ) -> list[AsyncIterator[RequestOutput]]:
    """Queue every prompt (all or none) and return their streams."""
    streams: list[AsyncIterator[RequestOutput]] = []
    try:
        for i, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            kw: dict[str, Any] = {"priority": priority}
            if prompt_texts is not None:
                kw["prompt_text"] = prompt_texts[i]
            streams.append(await engine.generate(prompt, params, request_id=rid, **kw))
    except Exception as e:
        await close_streams(streams)
        err = to_api_error(e)
        if err is None:
            raise
        if len(prompts) > 1 and err.status_code == 400:
            err.message = f"prompt {len(streams)}: {err.message}"
        raise err from e
    return streams


# --- the one choices loop ---------------------------------------------------------------------

class ChoiceFormat:
    """How one endpoint spells its choices; `respond` does everything else. One instance per
    response (it may keep per-choice state, e.g. completions' text offsets)."""

    object_final = ""
    object_chunk = ""

    def opening_choices(self, num_choices: int) -> list[dict[str, Any]]:
        """Choices sent before any token (chat: the assistant role)."""
        return []

    def see_output(self, prompt_index: int, out: RequestOutput) -> None:
        """Each RequestOutput of prompt `prompt_index`, before its choices are made (what
        is per request rather than per choice: prompt_logprobs)."""

    def response_fields(self) -> dict[str, Any]:
        """Top-level fields of the response, or of the next streamed chunk (each sent once:
        chat's prompt_logprobs)."""
        return {}

    def final_choice(self, index: int, co: CompletionOutput) -> dict[str, Any]:
        raise NotImplementedError

    def delta_choice(self, index: int, co: CompletionOutput | None
                     ) -> dict[str, Any] | None:
        """A streamed choice without finish_reason; `co` None: an empty one. None: nothing
        to send for this step (chat while a tool call's tag is being written); never None for
        a choice's finishing step, which carries its finish_reason."""
        raise NotImplementedError

    def finish_reason(self, index: int, co: CompletionOutput) -> str | None:
        """The choice's finish_reason, asked after its final / last delta choice was made
        (chat's tool calls turn "stop" into "tool_calls")."""
        return co.finish_reason


async def respond(*, request_id: str, served_model: str, streams: list[Any], n: int,
                  fmt: ChoiceFormat, stream: bool, include_usage: bool, raw: Request,
                  continuous_usage: bool = False, tokens_details: bool = False):
    """The response of a completions or chat request: JSON, or SSE when `stream`.
    Prompt i's sequence j is choice `i * n + j` (OpenAI's indexes). `continuous_usage`
    (vLLM's stream_options.continuous_usage_stats) puts the usage so far into every chunk:
    its prompt's tokens and the tokens its choice has generated, as vLLM counts them.
    `tokens_details` (--enable-prompt-tokens-details): the final usage carries
    prompt_tokens_details.cached_tokens."""
    created = now_s()
    cached: dict[int, int] = {}

    def cached_tokens() -> int | None:
        return sum(cached.values()) if tokens_details else None

    def base(obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": request_id, "object": obj, "created": created, "model": served_model,
                "choices": choices}

    if not stream:
        finals = await collect_final(streams, raw)
        if finals is None:
            return JSONResponse({}, status_code=499)      # client is gone; nobody reads this
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, out in enumerate(finals):
            err = error_finish(out)
            if err is not None:
                raise err
            prompt_tokens += out.num_prompt_tokens
            cached[i] = out.num_cached_tokens or 0
            fmt.see_output(i, out)
            for co in out.outputs:
                completion_tokens += len(co.token_ids)
                choice = fmt.final_choice(i * n + co.index, co)
                choice["finish_reason"] = fmt.finish_reason(i * n + co.index, co)
                choice["stop_reason"] = co.stop_reason
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        resp = base(fmt.object_final, choices)
        resp.update(fmt.response_fields())
        resp["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens())
        return JSONResponse(resp)

    num_choices = len(streams) * n

    prompt_tokens: dict[int, int] = {}
    choice_tokens: dict[int, int] = {}

    def chunk(choices: list[dict[str, Any]]) -> str:
        c = base(fmt.object_chunk, choices)
        c.update(fmt.response_fields())
        if continuous_usage and len(choices) == 1:
            idx = choices[0]["index"]
            c["usage"] = usage(prompt_tokens.get(idx // n, 0), choice_tokens.get(idx, 0))
        elif include_usage:
            c["usage"] = None
        return sse(c)

    async def events() -> AsyncIterator[str]:
        for choice in fmt.opening_choices(num_choices):
            yield chunk([choice])
        completion_tokens = 0
        unfinished = set(range(num_choices))
        try:
            async for i, out in merge_streams(streams):
                prompt_tokens[i] = out.num_prompt_tokens
                cached[i] = max(cached.get(i, 0), out.num_cached_tokens or 0)
                fmt.see_output(i, out)
                for co in out.outputs:
                    if not (co.delta_token_ids or co.delta_text or co.finished_in_this_step):
                        continue
                    idx = i * n + co.index
                    completion_tokens += len(co.delta_token_ids)
                    choice_tokens[idx] = choice_tokens.get(idx, 0) + len(co.delta_token_ids)
                    choice = fmt.delta_choice(idx, co)
                    if choice is None:          # nothing certain yet (never when finishing)
                        continue
                    choice["finish_reason"] = fmt.finish_reason(idx, co) \
                        if co.finished_in_this_step else None
                    if co.finished_in_this_step:
                        choice["stop_reason"] = co.stop_reason
                        unfinished.discard(idx)
                    yield chunk([choice])
                err = error_finish(out) if out.finished else None
                if err is not None:
                    yield sse(err.body())
        except EngineDeadError:         # the engine stopped before their abort output came
            for idx in sorted(unfinished):
                choice = fmt.delta_choice(idx, None)
                choice["finish_reason"] = "abort"
                choice["stop_reason"] = None
                yield chunk([choice])
        except Exception as e:          # a replica died, a fault: every choice ends, then why
            err = stream_error(e)
            for idx in sorted(unfinished):
                choice = fmt.delta_choice(idx, None)
                choice["finish_reason"] = "error"
                choice["stop_reason"] = None
                yield chunk([choice])
            yield sse(err.body())
        if include_usage:
            c = base(fmt.object_chunk, [])
            c["usage"] = usage(sum(prompt_tokens.values()), completion_tokens, cached_tokens())
            yield sse(c)

    return sse_response(events(), streams, request_id)

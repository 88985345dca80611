"""POST /v1/completions: one engine request per prompt, each with n sequences.

Choice indexes follow OpenAI: prompt i's sequence j is choice `i * n + j`. A streamed
response sends one chunk per generated token per choice (a token whose text is held back,
e.g. a possible stop-string prefix, still gets its chunk, with empty text), so the number
of chunks matches `usage.completion_tokens`.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.outputs import RequestOutput
from iterserve.server.errors import APIError
from iterserve.server.protocol import CompletionRequest
from iterserve.server.serving_common import (
    check_model, close_streams, collect_final, completion_logprobs, error_finish_message,
    merge_streams, new_id, now_s, sse, sse_error, sse_response, to_api_error, usage)


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


async def create_completion(body: CompletionRequest, raw: Request, engine: AsyncEngine,
                            served_model: str):
    try:
        check_model(body.model, served_model)
        params = body.to_sampling_params()
    except Exception as e:
        raise (to_api_error(e) or e) from e
    priority = body.priority or 0
    request_id = new_id("cmpl")
    prompts = body.prompts()
    streams = await start_streams(engine, request_id, prompts, params, priority=priority)
    n = params.n
    created = now_s()
    tok = engine.tokenizer
    want_logprobs = params.logprobs is not None

    def base(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": request_id, "object": "text_completion", "created": created,
                "model": served_model, "choices": choices}

    if not body.stream:
        finals = await collect_final(streams, raw)
        if finals is None:
            return JSONResponse({}, status_code=499)      # client is gone; nobody reads this
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, out in enumerate(finals):
            msg = error_finish_message(out)
            if msg:
                raise APIError(500, msg, type="internal_error")
            prompt_tokens += out.num_prompt_tokens
            for co in out.outputs:
                completion_tokens += len(co.token_ids)
                choices.append({
                    "index": i * n + co.index, "text": co.text,
                    "logprobs": completion_logprobs(tok, co.logprobs or [], 0)
                    if want_logprobs else None,
                    "finish_reason": co.finish_reason, "stop_reason": co.stop_reason})
        choices.sort(key=lambda c: c["index"])
        resp = base(choices)
        resp["usage"] = usage(prompt_tokens, completion_tokens)
        return JSONResponse(resp)

    include_usage = body.include_usage

    async def events() -> AsyncIterator[str]:
        offsets: dict[int, int] = {}
        prompt_tokens: dict[int, int] = {}
        completion_tokens = 0
        async for i, out in merge_streams(streams):
            prompt_tokens[i] = out.num_prompt_tokens
            for co in out.outputs:
                if not (co.delta_token_ids or co.delta_text or co.finished_in_this_step):
                    continue
                idx = i * n + co.index
                completion_tokens += len(co.delta_token_ids)
                lp = None
                if want_logprobs:
                    lp = completion_logprobs(tok, co.delta_logprobs or [], offsets.get(idx, 0))
                offsets[idx] = offsets.get(idx, 0) + len(co.delta_text)
                choice = {"index": idx, "text": co.delta_text, "logprobs": lp,
                          "finish_reason": co.finish_reason if co.finished_in_this_step
                          else None}
                if co.finished_in_this_step:
                    choice["stop_reason"] = co.stop_reason
                chunk = base([choice])
                if include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
            msg = error_finish_message(out) if out.finished else None
            if msg:
                yield sse_error(msg)
        if include_usage:
            chunk = base([])
            chunk["usage"] = usage(sum(prompt_tokens.values()), completion_tokens)
            yield sse(chunk)

    return sse_response(events(), streams, request_id)

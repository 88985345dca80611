"""POST /v1/chat/completions: messages -> the model's chat template -> one engine request.

The template is rendered and tokenised here (add_special_tokens=False: the template writes
BOS itself), so a malformed conversation or a template error is a 400 before anything is
queued. Without max_tokens / max_completion_tokens the reply may use the whole remaining
context, as OpenAI's API does.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from iterserve.engine.async_engine import AsyncEngine
from iterserve.server.errors import APIError
from iterserve.server.protocol import ChatCompletionRequest
from iterserve.server.serving_common import (
    chat_logprobs, check_model, collect_final, error_finish_message, merge_streams, new_id,
    now_s, sse, sse_error, sse_response, to_api_error, usage)
from iterserve.server.serving_completions import start_streams


def render_chat_prompt(engine: AsyncEngine, body: ChatCompletionRequest) -> tuple[str, list[int]]:
    messages = [m.to_template_dict() for m in body.messages]
    text = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=body.add_generation_prompt is not False)
    return text, engine.tokenizer.encode(text, add_special_tokens=False)


async def create_chat_completion(body: ChatCompletionRequest, raw: Request,
                                 engine: AsyncEngine, served_model: str):
    try:
        check_model(body.model, served_model)
        prompt_text, prompt_ids = render_chat_prompt(engine, body)
        room = engine.engine.max_model_len - len(prompt_ids)
        params = body.to_sampling_params(default_max_tokens=max(1, room))
    except Exception as e:
        raise (to_api_error(e) or e) from e
    request_id = new_id("chatcmpl")
    streams = await start_streams(engine, request_id, [prompt_ids], params,
                                  priority=body.priority or 0, prompt_texts=[prompt_text])
    created = now_s()
    tok = engine.tokenizer
    want_logprobs = params.logprobs is not None

    def base(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": served_model, "choices": choices}

    if not body.stream:
        finals = await collect_final(streams, raw)
        if finals is None:
            return JSONResponse({}, status_code=499)
        out = finals[0]
        msg = error_finish_message(out)
        if msg:
            raise APIError(500, msg, type="internal_error")
        choices = [{
            "index": co.index,
            "message": {"role": "assistant", "content": co.text},
            "logprobs": chat_logprobs(tok, co.logprobs or []) if want_logprobs else None,
            "finish_reason": co.finish_reason, "stop_reason": co.stop_reason,
        } for co in out.outputs]
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": created,
            "model": served_model, "choices": choices,
            "usage": usage(out.num_prompt_tokens, out.num_generated_tokens)})

    include_usage = body.include_usage

    async def events() -> AsyncIterator[str]:
        completion_tokens = 0
        for i in range(params.n):               # the role comes first, as OpenAI sends it
            chunk = base([{"index": i, "delta": {"role": "assistant", "content": ""},
                           "logprobs": None, "finish_reason": None}])
            if include_usage:
                chunk["usage"] = None
            yield sse(chunk)
        async for _, out in merge_streams(streams):
            for co in out.outputs:
                if not (co.delta_token_ids or co.delta_text or co.finished_in_this_step):
                    continue
                completion_tokens += len(co.delta_token_ids)
                choice: dict[str, Any] = {
                    "index": co.index,
                    "delta": {"content": co.delta_text} if (
                        co.delta_text or co.delta_token_ids) else {},
                    "logprobs": chat_logprobs(tok, co.delta_logprobs or [])
                    if want_logprobs else None,
                    "finish_reason": co.finish_reason if co.finished_in_this_step else None,
                }
                if co.finished_in_this_step:
                    choice["stop_reason"] = co.stop_reason
                chunk = base([choice])
                if include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
            msg = error_finish_message(out) if out.finished else None
            if msg:
                yield sse_error(msg)
            if out.finished and include_usage:
                chunk = base([])
                chunk["usage"] = usage(out.num_prompt_tokens, completion_tokens)
                yield sse(chunk)

    return sse_response(events(), streams, request_id)

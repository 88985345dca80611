"""POST /v1/completions: one engine request per prompt, each with n sequences.

Choice indexes follow OpenAI: prompt i's sequence j is choice `i * n + j`. A streamed
response sends one chunk per generated token per choice (a token whose text is held back,
e.g. a possible stop-string prefix, still gets its chunk, with empty text), so the number
of chunks matches `usage.completion_tokens`. The loop itself is serving_common.respond.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.outputs import CompletionOutput
from iterserve.server.protocol import CompletionRequest
from iterserve.server.serving_common import (
    ChoiceFormat, check_model, check_priority, completion_logprobs, new_id, respond,
    start_streams, to_api_error)


class CompletionFormat(ChoiceFormat):
    object_final = object_chunk = "text_completion"

    def __init__(self, tokenizer: Any, want_logprobs: bool) -> None:
        self.tok = tokenizer
        self.want_logprobs = want_logprobs
        self.offsets: dict[int, int] = {}       # streamed text so far per choice

    def final_choice(self, index: int, co: CompletionOutput) -> dict[str, Any]:
        return {"index": index, "text": co.text,
                "logprobs": completion_logprobs(self.tok, co.logprobs or [], 0)
                if self.want_logprobs else None}

    def delta_choice(self, index: int, co: CompletionOutput | None) -> dict[str, Any]:
        if co is None:
            return {"index": index, "text": "", "logprobs": None}
        off = self.offsets.get(index, 0)
        lp = completion_logprobs(self.tok, co.delta_logprobs or [], off) \
            if self.want_logprobs else None
        self.offsets[index] = off + len(co.delta_text)
        return {"index": index, "text": co.delta_text, "logprobs": lp}


async def create_completion(body: CompletionRequest, raw: Request, engine: AsyncEngine,
                            served_model: str):
    try:
        check_model(body.model, served_model)
        params = body.to_sampling_params()
        priority = check_priority(body.priority, engine)
    except Exception as e:
        raise (to_api_error(e) or e) from e
    request_id = new_id("cmpl")
    streams = await start_streams(engine, request_id, body.prompts(), params, priority=priority)
    return await respond(request_id=request_id, served_model=served_model, streams=streams,
                         n=params.n, fmt=CompletionFormat(engine.tokenizer,
                                                          params.logprobs is not None),
                         stream=bool(body.stream), include_usage=body.include_usage, raw=raw)

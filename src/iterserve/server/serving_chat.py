"""POST /v1/chat/completions: messages -> the model's chat template -> one engine request.

The template is rendered and tokenised off the event loop (add_special_tokens=False: the
template writes BOS itself), so a malformed conversation or a template error is a 400 before
anything is queued. Without max_tokens / max_completion_tokens the reply may use the whole
remaining context, as OpenAI's API does. The loop itself is serving_common.respond.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.outputs import CompletionOutput
from iterserve.server.protocol import ChatCompletionRequest
from iterserve.server.serving_common import (
    ChoiceFormat, chat_logprobs, check_model, check_priority, new_id, respond, start_streams,
    to_api_error)


class ChatFormat(ChoiceFormat):
    object_final = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, tokenizer: Any, want_logprobs: bool) -> None:
        self.tok = tokenizer
        self.want_logprobs = want_logprobs

    def opening_choices(self, num_choices: int) -> list[dict[str, Any]]:
        # the role comes first, as OpenAI sends it
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(num_choices)]

    def final_choice(self, index: int, co: CompletionOutput) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": co.text},
                "logprobs": chat_logprobs(self.tok, co.logprobs or [])
                if self.want_logprobs else None}

    def delta_choice(self, index: int, co: CompletionOutput | None) -> dict[str, Any]:
        if co is None:
            return {"index": index, "delta": {}, "logprobs": None}
        return {"index": index,
                "delta": {"content": co.delta_text} if (co.delta_text or co.delta_token_ids)
                else {},
                "logprobs": chat_logprobs(self.tok, co.delta_logprobs or [])
                if self.want_logprobs else None}


async def render_chat_prompt(engine: AsyncEngine, messages: list[dict[str, Any]], *,
                             add_generation_prompt: bool = True,
                             add_special_tokens: bool = False,
                             limit: int | None = None) -> tuple[str, list[int]]:
    """The template's text and its token ids, both computed off the event loop."""
    text = await engine.render_chat(messages, add_generation_prompt=add_generation_prompt)
    return text, await engine.tokenize(text, add_special_tokens=add_special_tokens, limit=limit)


async def create_chat_completion(body: ChatCompletionRequest, raw: Request,
                                 engine: AsyncEngine, served_model: str):
    try:
        check_model(body.model, served_model)
        priority = check_priority(body.priority, engine)
        prompt_text, prompt_ids = await render_chat_prompt(
            engine, [m.to_template_dict() for m in body.messages],
            add_generation_prompt=body.add_generation_prompt is not False,
            limit=engine.max_model_len)
        room = engine.max_model_len - len(prompt_ids)
        params = body.to_sampling_params(default_max_tokens=max(1, room))
    except Exception as e:
        raise (to_api_error(e) or e) from e
    request_id = new_id("chatcmpl")
    streams = await start_streams(engine, request_id, [prompt_ids], params, priority=priority,
                                  prompt_texts=[prompt_text])
    return await respond(request_id=request_id, served_model=served_model, streams=streams,
                         n=params.n, fmt=ChatFormat(engine.tokenizer,
                                                    params.logprobs is not None),
                         stream=bool(body.stream), include_usage=body.include_usage, raw=raw)

"""POST /v1/completions: one engine request per prompt, each with n sequences.

Choice indexes follow OpenAI: prompt i's sequence j is choice `i * n + j`. A streamed
response sends one chunk per generated token per choice (a token whose text is held back,
e.g. a possible stop-string prefix, still gets its chunk, with empty text), so the number
of chunks matches `usage.completion_tokens`. The loop itself is serving_common.respond.

`echo` prefixes each choice with its prompt's text (the first streamed chunk of a choice
carries it); with `logprobs` too, the prompt's tokens lead `logprobs` as OpenAI's legacy
completions give them (the first token's logprob None), computed as prompt_logprobs.
`prompt_logprobs` k (vLLM) adds `choices[i].prompt_logprobs`: per prompt token None (the
first) or {token id: {logprob, rank, decoded_token}} (streamed: in a choice's first chunk); `truncate_prompt_tokens` keeps the last k prompt tokens, so the prompts are
tokenised here, off the event loop, before they are queued.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.outputs import CompletionOutput
from iterserve.server.errors import to_api_error
from iterserve.server.protocol import CompletionRequest
from iterserve.server.serving_config import ServingConfig
from iterserve.server.serving_common import (
    ChoiceFormat, check_model, check_priority, completion_logprobs, echo_completion_logprobs,
    new_id, prompt_logprobs_json, respond, start_streams)


class CompletionFormat(ChoiceFormat):
    object_final = object_chunk = "text_completion"

    def __init__(self, tokenizer: Any, want_logprobs: bool, *, n: int = 1,
                 echo: list[str] | None = None, token_ids_as_text: bool = False,
                 echo_logprobs: int | None = None) -> None:
        self.tok = tokenizer
        self.want_logprobs = want_logprobs
        self.n = n
        self.echo = echo                        # per prompt, with echo
        self.token_ids_as_text = token_ids_as_text
        self.echo_logprobs = echo_logprobs      # echo + logprobs k: the prompt's logprobs too
        self.offsets: dict[int, int] = {}       # streamed text so far per choice
        self.prompts: dict[int, tuple[list[int], list]] = {}   # prompt -> (ids, prompt lps)
        self.prompt_sent: set[int] = set()      # choices whose prompt_logprobs went out

    def see_output(self, prompt_index: int, out) -> None:
        if out.prompt_logprobs is not None and prompt_index not in self.prompts:
            self.prompts[prompt_index] = (out.prompt_token_ids, out.prompt_logprobs)

    def _echo(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def _logprobs(self, lps, off: int) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return completion_logprobs(self.tok, lps or [], off,
                                   token_ids_as_text=self.token_ids_as_text)

    def _prompt_part(self, index: int, choice: dict[str, Any]) -> None:
        """Once per choice, as soon as its prompt's logprobs are known: `prompt_logprobs`
        (vLLM's shape) and, with echo + logprobs, the prompt's tokens ahead of the output's
        in `logprobs` (OpenAI's echo shape)."""
        known = self.prompts.get(index // self.n)
        if known is None or index in self.prompt_sent:
            return
        self.prompt_sent.add(index)
        ids, plps = known
        choice["prompt_logprobs"] = prompt_logprobs_json(
            self.tok, plps, token_ids_as_text=self.token_ids_as_text)
        if self.echo_logprobs is not None and choice.get("logprobs") is not None:
            head = echo_completion_logprobs(self.tok, ids, plps, self.echo_logprobs,
                                            token_ids_as_text=self.token_ids_as_text)
            choice["logprobs"] = {k: head[k] + choice["logprobs"][k] for k in head}

    def final_choice(self, index: int, co: CompletionOutput) -> dict[str, Any]:
        echo = self._echo(index)
        choice = {"index": index, "text": echo + co.text,
                  "logprobs": self._logprobs(co.logprobs, len(echo))}
        self._prompt_part(index, choice)
        return choice

    def delta_choice(self, index: int, co: CompletionOutput | None) -> dict[str, Any]:
        if co is None:
            return {"index": index, "text": "", "logprobs": None}
        prefix = ""
        if index not in self.offsets:
            prefix = self._echo(index)
            self.offsets[index] = len(prefix)
        off = self.offsets[index]
        lp = self._logprobs(co.delta_logprobs, off)
        self.offsets[index] = off + len(co.delta_text)
        choice = {"index": index, "text": prefix + co.delta_text, "logprobs": lp}
        self._prompt_part(index, choice)
        return choice


async def tokenized_prompts(body: CompletionRequest, engine: AsyncEngine
                            ) -> list[str | list[int]]:
    """The prompts as the engine gets them: as given, or tokenised and left-truncated when
    the request sets truncate_prompt_tokens."""
    prompts = body.prompts()
    if body.truncate_prompt_tokens is None:
        return prompts
    out: list[str | list[int]] = []
    for p in prompts:
        ids = await engine.tokenize(p) if isinstance(p, str) else p
        if not ids:
            out.append(p)                       # the engine says what is wrong with it
            continue
        out.append(body.truncate(list(ids), engine.max_model_len))
    return out


async def create_completion(body: CompletionRequest, raw: Request, engine: AsyncEngine,
                            served_model: str, config: ServingConfig | None = None):
    config = config or ServingConfig()
    try:
        check_model(body.model, served_model)
        params = body.to_sampling_params(config.sampling_defaults)
        priority = check_priority(body.priority, engine)
        prompts = await tokenized_prompts(body, engine)
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else await engine.detokenize(p) for p in prompts]
    except Exception as e:
        raise (to_api_error(e) or e) from e
    request_id = new_id("cmpl")
    for i, p in enumerate(prompts):
        config.log_request(request_id if len(prompts) == 1 else f"{request_id}-{i}",
                           p if isinstance(p, str) else None,
                           None if isinstance(p, str) else p, params)
    streams = await start_streams(engine, request_id, prompts, params, priority=priority)
    fmt = CompletionFormat(engine.tokenizer, params.logprobs is not None, n=params.n, echo=echo,
                           token_ids_as_text=bool(body.return_tokens_as_token_ids),
                           echo_logprobs=body.logprobs if body.echo else None)
    return await respond(request_id=request_id, served_model=served_model, streams=streams,
                         n=params.n, fmt=fmt, stream=bool(body.stream),
                         include_usage=body.include_usage or (
                             bool(body.stream) and config.force_include_usage),
                         raw=raw, continuous_usage=body.continuous_usage,
                         tokens_details=config.prompt_tokens_details)

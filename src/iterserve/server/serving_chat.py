"""POST /v1/chat/completions: messages -> the model's chat template -> one engine request.

The template is rendered and tokenised off the event loop (add_special_tokens=False: the
template writes BOS itself), so a malformed conversation or a template error is a 400 before
anything is queued. Without max_tokens / max_completion_tokens the reply may use the whole
remaining context, as OpenAI's API does. The loop itself is serving_common.respond.

What the template gets is what HF's `apply_chat_template` gets: the messages (assistant
`tool_calls` with their arguments as objects, `tool` results with `tool_call_id`), `tools`,
`chat_template_kwargs` as extra variables, `add_generation_prompt` /
`continue_final_message`, and the template itself: the request's `chat_template`, else the
server's `--chat-template`, else the model's. Tool calling is serving_tools.py; `echo`
prefixes the reply with the final message's content when that message is the assistant's
(vLLM's rule, meant for continue_final_message). `prompt_logprobs` k (vLLM) answers with a
top-level `prompt_logprobs` over the rendered prompt's tokens (streamed: in the first chunk
after they are known). With `--reasoning-parser` (iterserve.reasoning) the thinking goes to
`message.reasoning_content` / `delta.reasoning_content`, the tool parser reads the answer,
and a constraint applies after the thinking.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.outputs import CompletionOutput
from iterserve.server.protocol import ChatCompletionRequest
from iterserve.server.serving_common import (
    ChoiceFormat, chat_logprobs, check_model, check_priority, new_id, prompt_logprobs_json,
    respond, start_streams, to_api_error)
from iterserve.server.serving_config import ServingConfig
from iterserve.server.serving_tools import (
    NO_TOOLS, StreamedToolCalls, ToolPlan, message_with_tools, plan_tools)


class ChatFormat(ChoiceFormat):
    object_final = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, tokenizer: Any, want_logprobs: bool, *, tools: ToolPlan = NO_TOOLS,
                 echo: str = "", token_ids_as_text: bool = False, reasoning=None) -> None:
        self.tok = tokenizer
        self.want_logprobs = want_logprobs
        self.tools = tools
        self.reasoning = reasoning              # an iterserve.reasoning parser, or None
        self.thinking: dict[int, Any] = {}      # index -> its ReasoningStream
        self.echo = echo
        self.token_ids_as_text = token_ids_as_text
        self.called: dict[int, bool] = {}
        self.streams: dict[int, StreamedToolCalls] = {}
        self.prompt_logprobs: list | None = None     # vLLM's top-level field, sent once
        self._prompt_sent = False

    def see_output(self, prompt_index: int, out) -> None:
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs

    def response_fields(self) -> dict[str, Any]:
        if self.prompt_logprobs is None or self._prompt_sent:
            return {}
        self._prompt_sent = True
        return {"prompt_logprobs": prompt_logprobs_json(
            self.tok, self.prompt_logprobs, token_ids_as_text=self.token_ids_as_text)}

    def _logprobs(self, lps) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return chat_logprobs(self.tok, lps or [], token_ids_as_text=self.token_ids_as_text)

    def opening_choices(self, num_choices: int) -> list[dict[str, Any]]:
        # the role comes first, as OpenAI sends it; then the echoed prefix (vLLM)
        out = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None} for i in range(num_choices)]
        if self.echo:
            out += [{"index": i, "delta": {"content": self.echo}, "logprobs": None,
                     "finish_reason": None} for i in range(num_choices)]
        return out

    def final_choice(self, index: int, co: CompletionOutput) -> dict[str, Any]:
        text, reasoning = co.text, None
        if self.reasoning is not None:          # tools read the answer, not the thinking
            split = self.reasoning.split(co.text, final=True)
            reasoning = split.reasoning or None
            text = split.answer_text if self.tools.parses else split.content
        message, self.called[index] = message_with_tools(self.tools, text)
        if self.reasoning is not None:
            message["content"] = message["content"] or None
            message["reasoning_content"] = reasoning
        if self.echo and not self.called[index]:
            message["content"] = self.echo + (message["content"] or "")
        return {"index": index, "message": message, "logprobs": self._logprobs(co.logprobs)}

    def delta_choice(self, index: int, co: CompletionOutput | None) -> dict[str, Any]:
        if co is None:
            return {"index": index, "delta": {}, "logprobs": None}
        if self.reasoning is not None:
            return {"index": index, "delta": self._reasoning_delta(index, co),
                    "logprobs": self._logprobs(co.delta_logprobs)}
        if self.tools.parses:
            st = self.streams.get(index)
            if st is None:
                st = self.streams[index] = StreamedToolCalls(self.tools)
            delta = st.delta(co.delta_text, co.finished_in_this_step)
            self.called[index] = st.called
        else:
            delta = {"content": co.delta_text} if (co.delta_text or co.delta_token_ids) else {}
        return {"index": index, "delta": delta,
                "logprobs": self._logprobs(co.delta_logprobs)}

    def _reasoning_delta(self, index: int, co: CompletionOutput) -> dict[str, Any]:
        """delta.reasoning_content for the thinking, then the answer as content (through the
        tool parser when tools are parsed)."""
        rs = self.thinking.get(index)
        if rs is None:
            rs = self.thinking[index] = self.reasoning.stream()
        parts = [rs.feed(co.delta_text)] if co.delta_text else []
        if co.finished_in_this_step:
            parts.append(rs.finish())
        reasoning = "".join(p[0] for p in parts)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if self.tools.parses:
            st = self.streams.get(index)
            if st is None:
                st = self.streams[index] = StreamedToolCalls(self.tools)
            answer = "".join(p[2] for p in parts)
            if answer or co.finished_in_this_step:
                delta.update(st.delta(answer, co.finished_in_this_step))
            self.called[index] = st.called
        else:
            content = "".join(p[1] for p in parts)
            if content:
                delta["content"] = content
        return delta

    def finish_reason(self, index: int, co: CompletionOutput) -> str | None:
        return self.tools.finish_reason(co.finish_reason, self.called.get(index, False))


async def render_chat_prompt(engine: AsyncEngine, messages: list[dict[str, Any]], *,
                             add_generation_prompt: bool = True,
                             add_special_tokens: bool = False,
                             limit: int | None = None,
                             tools: list[dict[str, Any]] | None = None,
                             chat_template: str | None = None,
                             continue_final_message: bool = False,
                             template_kwargs: dict[str, Any] | None = None
                             ) -> tuple[str, list[int]]:
    """The template's text and its token ids, both computed off the event loop."""
    kw: dict[str, Any] = dict(template_kwargs or {})
    if tools is not None:
        kw["tools"] = tools
    if chat_template is not None:
        kw["chat_template"] = chat_template
    if continue_final_message:
        kw["continue_final_message"] = True
    if kw:
        render = functools.partial(engine.tokenizer.apply_chat_template, messages,
                                   add_generation_prompt=add_generation_prompt, **kw)
        text = await engine.run_text_work(render)
    else:
        text = await engine.render_chat(messages, add_generation_prompt=add_generation_prompt)
    return text, await engine.tokenize(text, add_special_tokens=add_special_tokens, limit=limit)


def request_template(body: Any, config: ServingConfig) -> str | None:
    """The template this request renders with (None: the model's own); a per-request one
    on a server that does not trust them, or one that does not compile, is a 400 naming
    `chat_template`."""
    if body.chat_template is None:
        return config.chat_template
    from iterserve.engine.errors import InvalidRequestError
    from iterserve.model.chat_template import ChatTemplateError, compile_template
    if not config.trust_request_chat_template:
        raise InvalidRequestError(
            "a request's own chat_template is refused unless the server is started with "
            "--trust-request-chat-template", "chat_template")
    try:
        compile_template(body.chat_template)
    except ChatTemplateError as e:
        e.param = "chat_template"
        raise
    return body.chat_template


async def render_request(engine: AsyncEngine, body: Any, config: ServingConfig, *,
                         add_special_tokens: bool = False, limit: int | None = None
                         ) -> tuple[str, list[int]]:
    """Render a chat completion's (or a chat /tokenize's) messages as the request asks."""
    return await render_chat_prompt(
        engine, [m.to_template_dict() for m in body.messages],
        add_generation_prompt=body.wants_generation_prompt,
        add_special_tokens=add_special_tokens, limit=limit, tools=body.tool_dicts(),
        chat_template=request_template(body, config),
        continue_final_message=bool(body.continue_final_message),
        template_kwargs=body.chat_template_kwargs)


@dataclass
class StartedChat:
    """A chat request queued in the engine: what the response writers need."""

    request_id: str
    streams: list[Any]
    params: Any
    plan: ToolPlan
    echo: str
    reasoning: Any = None          # the server's reasoning parser (iterserve.reasoning)


async def start_chat(body: ChatCompletionRequest, engine: AsyncEngine, served_model: str,
                     config: ServingConfig, request_id: str) -> StartedChat:
    """Validate, render, plan the tools and queue the request (any refusal is an APIError,
    raised before anything is queued)."""
    try:
        check_model(body.model, served_model)
        priority = check_priority(body.priority, engine)
        truncating = body.truncate_prompt_tokens is not None
        prompt_text, prompt_ids = await render_request(
            engine, body, config, limit=None if truncating else engine.max_model_len)
        if truncating:
            prompt_ids = body.truncate(prompt_ids, engine.max_model_len)
            prompt_text = None
        room = engine.max_model_len - len(prompt_ids)
        params = body.to_sampling_params(default_max_tokens=max(1, room),
                                         defaults=config.sampling_defaults)
        plan, params = plan_tools(body, config.tools, engine.tokenizer, params)
        reasoning = None
        if config.reasoning_parser is not None:
            reasoning, params = _reasoning_params(config.reasoning_parser, engine.tokenizer,
                                                  params, prompt_text)
    except Exception as e:
        raise (to_api_error(e) or e) from e
    last = body.messages[-1]
    echo = last.text() if body.echo and last.role == "assistant" else ""
    config.log_request(request_id, prompt_text, prompt_ids, params)
    streams = await start_streams(engine, request_id, [prompt_ids], params, priority=priority,
                                  prompt_texts=[prompt_text])
    return StartedChat(request_id, streams, params, plan, echo, reasoning)


def _reasoning_params(name: str, tokenizer: Any, params: Any,
                      prompt_text: str | None) -> tuple[Any, Any]:
    """The reasoning parser and the params it needs: a constraint moved after the thinking
    (iterserve.reasoning.answer_only), special tokens kept when its markers are special. A
    prompt that closed the thinking (enable_thinking false) leaves only an answer."""
    import dataclasses
    from iterserve.reasoning import answer_only, get_reasoning_parser
    from iterserve.reasoning.parsers import NoThinking
    parser = get_reasoning_parser(name)
    if parser.thinking_closed_by(prompt_text):
        return NoThinking(parser), params
    changes: dict[str, Any] = {}
    if params.structured_outputs is not None:
        changes["structured_outputs"] = answer_only(params.structured_outputs, name, tokenizer)
    if parser.needs_special_tokens and params.skip_special_tokens:
        changes["skip_special_tokens"] = False
    return parser, dataclasses.replace(params, **changes) if changes else params


async def create_chat_completion(body: ChatCompletionRequest, raw: Request,
                                 engine: AsyncEngine, served_model: str,
                                 config: ServingConfig | None = None):
    started = await start_chat(body, engine, served_model, config or ServingConfig(),
                               new_id("chatcmpl"))
    params = started.params
    fmt = ChatFormat(engine.tokenizer, params.logprobs is not None, tools=started.plan,
                     echo=started.echo,
                     token_ids_as_text=bool(body.return_tokens_as_token_ids),
                     reasoning=started.reasoning)
    return await respond(request_id=started.request_id, served_model=served_model,
                         streams=started.streams, n=params.n, fmt=fmt,
                         stream=bool(body.stream), include_usage=body.include_usage, raw=raw,
                         continuous_usage=body.continuous_usage)

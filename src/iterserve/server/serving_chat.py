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
from typing import Any, AsyncIterator

from fastapi import Request
from pydantic import ValidationError

from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.outputs import CompletionOutput
from iterserve.errors import ChatTemplateError, InvalidRequestError
from iterserve.model.chat_template import compile_template
from iterserve.server.errors import to_api_error
from iterserve.server.protocol import ChatCompletionRequest
from iterserve.server.errors import APIError
from iterserve.server.serving_common import (
    ChoiceFormat, chat_logprobs, check_model, check_priority, close_streams, collect_final,
    error_finish, merge_streams, new_id, prompt_logprobs_json, respond, start_streams)
from iterserve.server.serving_config import ServingConfig
from iterserve.server.serving_tools import (
    NO_TOOLS, StreamedToolCalls, ToolPlan, message_with_tools, plan_tools)


class ChatFormat(ChoiceFormat):
    object_final = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, tokenizer: Any, want_logprobs: bool, *, tools: ToolPlan = NO_TOOLS,
                 echo: str = "", token_ids_as_text: bool = False,
                 role: str = "assistant", reasoning=None) -> None:
        self.tok = tokenizer
        self.role = role
        self.want_logprobs = want_logprobs
        self.tools = tools
        self.reasoning = reasoning              # an iterserve.reasoning parser, or None
        self.thinking: dict[int, Any] = {}      # index -> its ReasoningStream
        self.echo = echo
        self.token_ids_as_text = token_ids_as_text
        self.called: dict[int, bool] = {}
        self.streams: dict[int, StreamedToolCalls] = {}
        self.pending_logprobs: dict[int, list] = {}  # of tokens whose chunk was not sent
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
        out = [{"index": i, "delta": {"role": self.role, "content": ""}, "logprobs": None,
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
        message, self.called[index] = message_with_tools(self.tools, text,
                                                         co.finish_reason == "length")
        message["role"] = self.role
        if self.reasoning is not None:
            message["content"] = message["content"] or None
            message["reasoning_content"] = reasoning
        if self.echo and not self.called[index]:
            message["content"] = self.echo + (message["content"] or "")
        return {"index": index, "message": message, "logprobs": self._logprobs(co.logprobs)}

    def delta_choice(self, index: int, co: CompletionOutput | None
                     ) -> dict[str, Any] | None:
        if co is None:
            return {"index": index, "delta": {}, "logprobs": None}
        if self.reasoning is not None:
            return {"index": index, "delta": self._reasoning_delta(index, co),
                    "logprobs": self._logprobs(co.delta_logprobs)}
        if not self.tools.parses:
            delta = {"content": co.delta_text} if (co.delta_text or co.delta_token_ids) else {}
            return {"index": index, "delta": delta,
                    "logprobs": self._logprobs(co.delta_logprobs)}
        st = self.streams.get(index)
        if st is None:
            st = self.streams[index] = StreamedToolCalls(self.tools)
        delta = st.delta(co.delta_text, co.finished_in_this_step,
                         co.finish_reason == "length")
        self.called[index] = st.called
        # While the parser holds text back (a `<tool_call>` tag being written, a call whose
        # name is incomplete) there is nothing to say: no chunk, and the tokens' logprobs
        # ride on the next chunk that is sent.
        pending = self.pending_logprobs.setdefault(index, [])
        pending += co.delta_logprobs or []
        if not delta and not co.finished_in_this_step:
            return None
        self.pending_logprobs[index] = []
        return {"index": index, "delta": delta, "logprobs": self._logprobs(pending)}

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
                delta.update(st.delta(answer, co.finished_in_this_step,
                                      co.finish_reason == "length"))
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
                             template_kwargs: dict[str, Any] | None = None,
                             content_format: str = "string"
                             ) -> tuple[str, list[int]]:
    """The template's text and its token ids, both computed off the event loop."""
    kw: dict[str, Any] = dict(template_kwargs or {})
    if content_format == "openai":
        kw["content_format"] = "openai"
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
    """Render a chat completion's (or a chat /tokenize's) messages as the request asks,
    under the server's --chat-template-content-format, --default-chat-template-kwargs and
    --exclude-tools-when-tool-choice-none."""
    template = request_template(body, config)
    fmt = config.content_format_for(
        template or getattr(engine.tokenizer, "chat_template", None))
    tools = body.tool_dicts()
    if config.exclude_tools_when_tool_choice_none \
            and getattr(body, "effective_tool_choice", None) == "none":
        tools = None
    kwargs = {**config.default_chat_template_kwargs, **(body.chat_template_kwargs or {})}
    return await render_chat_prompt(
        engine, [m.to_template_dict(fmt) for m in body.messages],
        add_generation_prompt=body.wants_generation_prompt,
        add_special_tokens=add_special_tokens, limit=limit, tools=tools,
        chat_template=template,
        continue_final_message=bool(body.continue_final_message),
        template_kwargs=kwargs or None, content_format=fmt)


@dataclass
class StartedChat:
    """A chat request queued in the engine: what the response writers need."""

    request_id: str
    streams: list[Any]
    params: Any
    plan: ToolPlan
    echo: str
    num_prompt_tokens: int = 0
    role: str = "assistant"          # --response-role, or the last message's role
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
    role = config.response_role if body.wants_generation_prompt else last.role
    return StartedChat(request_id, streams, params, plan, echo, len(prompt_ids), role,
                       reasoning)


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


# --- for the APIs layered over chat (Responses, Anthropic Messages): one choice, n = 1 ------

def as_chat_request(fields: dict[str, Any], param: str) -> ChatCompletionRequest:
    """The chat request another API's body maps to; one chat cannot take is a 400 naming
    `param` (the other API's field) and where chat refused it."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise APIError(400, f"{param}: {err.get('msg')} (as chat: {where})",
                       param=param) from None


@dataclass
class FinalChat:
    """A finished single-choice chat: the engine's output and the message it makes."""

    out: Any                       # RequestOutput
    co: CompletionOutput
    message: dict[str, Any]        # chat's `message` (content, tool_calls)
    called: bool


async def final_chat(started: StartedChat, raw: Request) -> FinalChat | None:
    """Wait for the reply (None: the client went away first, and the request is aborted);
    a failure in the engine is a 500 (a constraint the grammar engine could not follow to
    the end the request's 400: error_finish), a request aborted by shutdown a 503."""
    finals = await collect_final(started.streams, raw)
    if finals is None:
        return None
    (out,) = finals
    err = error_finish(out)
    if err is not None:
        raise err
    co = out.outputs[0]
    if co.finish_reason == "abort":
        raise APIError(503, "the request was aborted: the server is shutting down",
                       type="service_unavailable")
    message, called = message_with_tools(started.plan, co.text, co.finish_reason == "length")
    return FinalChat(out, co, message, called)


@dataclass
class ChatDelta:
    """One step of a single-choice chat stream: chat's `delta` (content and / or
    tool_calls; empty while the tool parser holds text back) and the counts so far."""

    delta: dict[str, Any]
    num_prompt_tokens: int
    num_cached_tokens: int
    completion_tokens: int
    finish_reason: str | None = None        # on the last step
    stop_reason: str | int | None = None
    called: bool = False                    # tool calls were streamed


async def chat_deltas(started: StartedChat) -> AsyncIterator[ChatDelta]:
    """The reply as chat deltas, through the same tool-call streaming as chat's own stream
    (StreamedToolCalls); a failure in the engine raises its APIError (error_finish). The
    request's streams are closed (aborting it) however the iteration ends."""
    tools = StreamedToolCalls(started.plan) if started.plan.parses else None
    completion = 0
    try:
        async for _, out in merge_streams(started.streams):
            for co in out.outputs:
                completion += len(co.delta_token_ids)
                final = co.finished_in_this_step
                if tools is not None:
                    delta = tools.delta(co.delta_text, final, co.finish_reason == "length")
                else:
                    delta = {"content": co.delta_text} if co.delta_text else {}
                yield ChatDelta(delta, out.num_prompt_tokens, out.num_cached_tokens or 0,
                                completion, co.finish_reason if final else None,
                                co.stop_reason if final else None,
                                tools.called if tools is not None else False)
            err = error_finish(out) if out.finished else None
            if err is not None:
                raise err
    finally:
        await close_streams(started.streams)


async def create_chat_completion(body: ChatCompletionRequest, raw: Request,
                                 engine: AsyncEngine, served_model: str,
                                 config: ServingConfig | None = None):
    config = config or ServingConfig()
    started = await start_chat(body, engine, served_model, config, new_id("chatcmpl"))
    params = started.params
    fmt = ChatFormat(engine.tokenizer, params.logprobs is not None, tools=started.plan,
                     echo=started.echo,
                     token_ids_as_text=bool(body.return_tokens_as_token_ids),
                     role=started.role, reasoning=started.reasoning)
    return await respond(request_id=started.request_id, served_model=served_model,
                         streams=started.streams, n=params.n, fmt=fmt,
                         stream=bool(body.stream),
                         include_usage=body.include_usage or (
                             bool(body.stream) and config.force_include_usage),
                         raw=raw, continuous_usage=body.continuous_usage,
                         tokens_details=config.prompt_tokens_details)

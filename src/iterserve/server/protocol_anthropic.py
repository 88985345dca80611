"""Request bodies of Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`),
with every limit a pydantic constraint, as server/protocol.py does for OpenAI's bodies.

The same three groups of fields as there:

* implemented: `model`, `messages` (user / assistant turns; content a string or blocks:
  `text`, `tool_use`, `tool_result`), `system`, `max_tokens`, `stop_sequences`,
  `temperature`, `top_p`, `top_k`, `stream`, `tools` (client tools: `name`, `description`,
  `input_schema`, `strict`), `tool_choice` (`auto`, `any`, `tool`, `none`,
  `disable_parallel_tool_use`), `output_config.format` (a JSON schema the text must follow);
* accepted no-ops, meaningless for a local server: `metadata`, `service_tier`,
  `inference_geo`, `user_profile_id`, `workspace_id`, every `cache_control` (prefix caching,
  `--enable-prefix-caching`, needs no marks), a tool's `eager_input_streaming` (tool input
  always streams as it is written);
* not implemented: accepted at their neutral value, any other is a 400 naming the field
  (`thinking` other than disabled, `output_config.effort`, `speed` "fast", `container`,
  `mcp_servers`, `context_management`, `diagnostics`, server tools, image / document /
  thinking blocks, citations).

Unknown fields are a 400 as on the OpenAI routes. `to_chat()` turns a body into the chat
completion it is (server/serving_messages.py serves it through the chat path).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from iterserve.server.protocol import (
    INT64_MAX, MAX_STOP, MAX_STOP_LEN, MAX_TOOLS, FunctionName, NonEmptyText, Text, _Model,
    _falsy, _nothing)

MAX_MESSAGES = 4096
MAX_BLOCKS = 4096           # content blocks per message
NOT_IMPLEMENTED_FIELDS: list[str] = []      # this API's own; filled by _not_implemented


def _not_implemented(name: str, neutral: Any, what: str) -> AfterValidator:
    """As protocol.py's: neutral values pass, others are a 400 naming the field."""
    NOT_IMPLEMENTED_FIELDS.append(name)

    def check(v: Any) -> Any:
        if v is not None and not neutral(v):
            raise PydanticCustomError(
                "unsupported_parameter", "{name} is not supported by iterserve yet ({what})",
                {"name": name, "what": what})
        return v

    return AfterValidator(check)

CacheControl = dict[str, Any] | None     # {"type": "ephemeral", "ttl": ...}: a no-op


class TextBlock(_Model):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl = None
    citations: Annotated[Any, _not_implemented("citations", _falsy, "only null or empty")] = None


class ToolUseBlock(_Model):
    """A call the assistant made earlier (what the client sends back)."""
    type: Literal["tool_use"]
    id: NonEmptyText
    name: FunctionName
    input: dict[str, Any]
    cache_control: CacheControl = None
    caller: Annotated[Any, _not_implemented("caller", _nothing, "only null")] = None
    toolset_name: Annotated[Any, _not_implemented("toolset_name", _nothing, "only null")] = None


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: NonEmptyText
    content: Text | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None
    toolset_name: Annotated[Any, _not_implemented("toolset_name", _nothing, "only null")] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            text = "".join(b.text for b in self.content)
        else:
            text = self.content or ""
        # chat's tool messages have no error flag: the template sees it in the text
        return f"Error: {text}" if self.is_error else text


class UnsupportedBlock(_Model):
    """Any other block type (image, document, thinking, server tool results, ...): refused
    by name, since the models served here read text only."""
    type: str

    model_config = {**_Model.model_config, "extra": "allow"}

    @field_validator("type")
    @classmethod
    def _refuse(cls, v: str) -> str:
        raise PydanticCustomError(
            "unsupported_parameter", "content blocks of type '{t}' are not supported by "
            "iterserve (text, tool_use and tool_result are)", {"t": v})


def _block_kind(v: Any) -> str:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return t if t in ("text", "tool_use", "tool_result") else "other"


Block = Annotated[Union[Annotated[TextBlock, Tag("text")],
                        Annotated[ToolUseBlock, Tag("tool_use")],
                        Annotated[ToolResultBlock, Tag("tool_result")],
                        Annotated[UnsupportedBlock, Tag("other")]],
                  Discriminator(_block_kind)]


class Message(_Model):
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[Block], Field(max_length=MAX_BLOCKS)]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> "Message":
        wrong = ToolResultBlock if self.role == "assistant" else ToolUseBlock
        if isinstance(self.content, list) and any(isinstance(b, wrong) for b in self.content):
            raise PydanticCustomError(
                "block_role", "{t} blocks belong to {r} turns", {
                    "t": "tool_result" if wrong is ToolResultBlock else "tool_use",
                    "r": "user" if wrong is ToolResultBlock else "assistant"})
        return self


class Tool(_Model):
    name: FunctionName
    input_schema: dict[str, Any]
    description: Text | None = None
    type: Text | None = None
    strict: bool | None = None
    cache_control: CacheControl = None
    eager_input_streaming: bool | None = None          # no-op: input always streams
    defer_loading: Annotated[bool | None, _not_implemented(
        "tools[].defer_loading", _falsy, "only false")] = None
    input_examples: Annotated[list[Any] | None, _not_implemented(
        "tools[].input_examples", _falsy, "only empty")] = None
    allowed_callers: Annotated[Any, _not_implemented(
        "tools[].allowed_callers", _nothing, "only null")] = None

    @field_validator("type")
    @classmethod
    def _client_tool(cls, v: str | None) -> str | None:
        if v not in (None, "custom"):
            raise PydanticCustomError(
                "unsupported_parameter", "server tools ('{t}') are not available here; "
                "define the tool with name, description and input_schema", {"t": v})
        return v

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v.get("type", "object") != "object":
            raise PydanticCustomError("tool_parameters", "input_schema must be a JSON schema "
                                      "of type 'object', got type '{t}'", {"t": v.get("type")})
        return v

    def to_chat(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            fn["description"] = self.description
        if self.strict is not None:
            fn["strict"] = self.strict
        return {"type": "function", "function": fn}


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: bool | None = None

    @field_validator("name")
    @classmethod
    def _name_for_tool(cls, v: str | None, info) -> str | None:
        if (v is None) == (info.data.get("type") == "tool"):
            raise PydanticCustomError("tool_choice", "tool_choice 'tool' needs 'name' (and "
                                      "only it takes one)", {})
        return v

    def to_chat(self) -> Any:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class ThinkingConfig(_Model):
    type: Annotated[Text, _not_implemented("thinking", lambda v: v == "disabled",
                                           'only {"type": "disabled"}: no reasoning parser '
                                           "is configured")]
    budget_tokens: int | None = None
    display: Text | None = None


class OutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    format: OutputFormat | None = None
    effort: Annotated[Any, _not_implemented("output_config.effort", _nothing,
                                            "only null")] = None


def _check_tool_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> None:
    if choice is None or choice.type in ("auto", "none"):
        return
    if not tools:
        raise PydanticCustomError("tool_choice", "tool_choice '{c}' needs a non-empty 'tools' "
                                  "list", {"c": choice.type})
    if choice.type == "tool" and choice.name not in {t.name for t in tools}:
        raise PydanticCustomError("tool_choice", "tool_choice names the tool '{name}', which "
                                  "is not in 'tools'", {"name": choice.name})


class _Conversation(_Model):
    """What count_tokens and a message share: the prompt."""
    model: NonEmptyText
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: Text | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl = None
    speed: Annotated[Text | None, _not_implemented("speed", lambda v: v == "standard",
                                                   '"standard" only')] = None
    context_management: Annotated[Any, _not_implemented("context_management", _nothing,
                                                        "only null")] = None
    mcp_servers: Annotated[list[Any] | None, _not_implemented("mcp_servers", _falsy,
                                                              "only empty")] = None
    # accepted no-ops (module docstring)
    user_profile_id: Text | None = None
    workspace_id: Text | None = None

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v: ToolChoice | None, info) -> ToolChoice | None:
        if "tools" in info.data:                # (a bad tools list is reported by itself)
            _check_tool_choice(info.data["tools"], v)
        return v

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: `system` first; a user turn's `tool_result`
        blocks each a `tool` message (in order, text between them a user message); an
        assistant turn's `tool_use` blocks its `tool_calls` (arguments as JSON text)."""
        out: list[dict[str, Any]] = []
        if self.system is not None:
            out.append({"role": "system", "content": _parts(self.system)})
        for m in self.messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
            elif m.role == "assistant":
                msg: dict[str, Any] = {"role": "assistant", "content": _parts(
                    [b for b in m.content if isinstance(b, TextBlock)])}
                calls = [{"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                    for b in m.content if isinstance(b, ToolUseBlock)]
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
            else:
                text: list[TextBlock] = []
                for b in m.content:
                    if isinstance(b, ToolResultBlock):
                        if text:
                            out.append({"role": "user", "content": _parts(text)})
                            text = []
                        out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                    "content": b.text()})
                    elif isinstance(b, TextBlock):
                        text.append(b)
                if text or not m.content:
                    out.append({"role": "user", "content": _parts(text)})
        return out

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's fields for the prompt: messages, tools, tool_choice, format."""
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages()}
        if self.tools:
            body["tools"] = [t.to_chat() for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice.to_chat()
            if self.tool_choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        fmt = self.output_config.format if self.output_config else None
        if fmt is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": fmt.schema_}}
        return body


def _parts(blocks: str | list[TextBlock]) -> str | list[dict[str, str]]:
    if isinstance(blocks, str):
        return blocks
    return [{"type": "text", "text": b.text} for b in blocks]


StopSequence = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1, le=INT64_MAX, description=(
        "at least 1; prompt tokens + max_tokens must not exceed the model's max_model_len"))
    stop_sequences: Annotated[list[Annotated[StopSequence, Field()]],
                              Field(max_length=MAX_STOP)] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=2**31 - 1, description="0: disabled")
    # accepted no-ops (module docstring)
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: Text | None = None
    # not implemented
    container: Annotated[Any, _not_implemented("container", _nothing, "only null")] = None
    diagnostics: Annotated[Any, _not_implemented("diagnostics", _nothing, "only null")] = None

    def to_chat(self) -> dict[str, Any]:
        """The chat completion request (a dict for ChatCompletionRequest) this message is."""
        body = self.chat_fields()
        body.update(max_tokens=self.max_tokens, stream=bool(self.stream))
        if self.stop_sequences:
            body["stop"] = list(self.stop_sequences)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        return body


class CountTokensRequest(_Conversation):
    """`POST /v1/messages/count_tokens`: the prompt a message with these fields would have."""

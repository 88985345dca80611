"""Request bodies of the OpenAI-compatible API: every limit is a pydantic constraint.

Why constraints and not checks in the handlers: `/openapi.json` is generated from these
models, so the published schema states every limit (n <= 128, the stop list's size, the seed's
range, logprobs <= --max-logprobs, no NaN or infinity, ...) and a request valid by the schema is served.
What the schema cannot say statically, max_tokens <= max_model_len - 1, is added
to the published schema per app (server/openapi.py); prompt tokens + max_tokens <=
max_model_len is checked by the engine once the prompt is tokenised.

Models are strict (a string where a number belongs is a 400, not silently coerced), reject
NaN / +-inf in every float field, reject strings with lone UTF-16 surrogates (JSON allows the
escape `"\\udcff"`; no tokenizer or response encoder can handle it), and forbid unknown
fields: an unknown field is a 400 "Unrecognized request argument supplied: <name>", as
OpenAI answers (the rule: no field is silently ignored).

Fields fall in three groups:

* implemented, as OpenAI / vLLM define them;
* accepted no-ops, OpenAI fields that mean nothing for a local server (NO_OP_FIELDS):
  `user`, `store`, `metadata`, `service_tier`, `safety_identifier`, `prompt_cache_key`,
  `stream_options.include_obfuscation`, and in chat messages `refusal` / `annotations` (what
  the client echoes back);
* not implemented yet (NOT_IMPLEMENTED_FIELDS): accepted at their neutral value (null, false,
  empty, `response_format` {"type": "text"}, `tool_choice` "none", ...), any
  other value is a 400 whose `param` names the field and whose `code` is
  "unsupported_parameter".

Tool calling (`tools`, `tool_choice`, `parallel_tool_calls`, assistant messages with
`tool_calls`, `tool` messages with `tool_call_id`) is typed here (`ChatTool`,
`NamedToolChoice`, `MessageToolCall`), so a bad tool definition is a 400 naming the field
(`tools.0.function.name`); what the server does with them is server/serving_tools.py.

Structured outputs (`response_format`, `structured_outputs`, `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`) and `logit_bias`, `min_tokens`, `bad_words`,
`allowed_token_ids`, `include_stop_str_in_output` are implemented: they become SamplingParams
fields, compiled / checked by the engine's input processor (a bad schema is a 400 naming it).
So are vLLM's `prompt_logprobs` (computed by the runner over the prompt rows), completions'
`best_of` > n (V0: the n best of best_of by cumulative logprob; not streamed), `echo`
(with `logprobs`: the prompt's tokens lead them), `truncate_prompt_tokens`,
`return_tokens_as_token_ids`,
`stream_options.continuous_usage_stats` (the server's response writers) and the chat
template's inputs `add_generation_prompt`, `continue_final_message`, `chat_template` (on a
server with --trust-request-chat-template) and `chat_template_kwargs`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Callable, Literal, Mapping, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag,
                      ValidationInfo, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from iterserve.core.request import MAX_SLO_MS, SamplingParams
from iterserve.structured import StructuredOutputsParams

MAX_LOGPROBS = 20       # OpenAI's limit, and --max-logprobs' default (server/openapi.py
                        # states the app's own; the engine checks it)
MAX_N = 128             # OpenAI's cap on n
MAX_STOP = 16           # stop strings per request
MAX_STOP_LEN = 1024     # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPTS = 256       # prompts in one completions request
MAX_TOKEN_ID = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_PRIORITY = 2**31 - 1

NO_OP_FIELDS = ("user", "store", "metadata", "service_tier", "safety_identifier",
                "prompt_cache_key", "stream_options.include_obfuscation",
                "messages[].refusal", "messages[].annotations")
MAX_TOOLS = 128         # OpenAI's cap on tools per request
NOT_IMPLEMENTED_FIELDS: list[str] = []      # filled by _not_implemented below


def _valid_unicode(s: str) -> str:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PydanticCustomError(
                "invalid_unicode",
                "the string contains a lone UTF-16 surrogate at position {pos} (not valid "
                "Unicode text)", {"pos": e.start}) from None
    return s


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


_NEUTRAL_SCHEMAS: dict[str, dict[str, Any]] = {
    "only null": {"type": "null"},
    "only false": {"enum": [False, None]},
    "only true": {"enum": [True, None]},
    "only 1.0": {"enum": [1.0, None]},
    "only 0": {"enum": [0, None]},
}


class _NeutralOnly:
    """Field metadata for a field iterserve does not implement: values `neutral` accepts
    pass, any other is a 400 naming the field; the published schema allows only the neutral
    values (`schema`), so that a schema-valid request is one the server serves."""

    def __init__(self, check: Callable[[Any], Any], schema: dict[str, Any], note: str) -> None:
        self.check = check
        self.schema = schema
        self.note = note

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, core: Any, handler: Any) -> dict[str, Any]:
        return {**self.schema, "description": self.note}


def _not_implemented(name: str, neutral: Callable[[Any], bool], what: str,
                     schema: dict[str, Any] | None = None) -> _NeutralOnly:
    """A field iterserve does not implement yet: `neutral(value)` values pass, others are a
    400 naming the field (never a silent 200). `schema`: the neutral values as JSON Schema
    (default from `what`, e.g. "only null")."""
    NOT_IMPLEMENTED_FIELDS.append(name)

    def check(v: Any) -> Any:
        if v is not None and not neutral(v):
            raise PydanticCustomError(
                "unsupported_parameter",
                "{name} is not supported by iterserve yet ({what})",
                {"name": name, "what": what})
        return v

    return _NeutralOnly(check, schema or _NEUTRAL_SCHEMAS[what],
                        f"not supported by iterserve yet ({what})")


def _deprecated(name: str, neutral: Callable[[Any], bool], use: str,
                schema: dict[str, Any] | None = None) -> _NeutralOnly:
    """OpenAI's deprecated function-calling fields: vLLM does not implement them either, so
    any value that would matter is a 400 that names the field and its replacement."""
    NOT_IMPLEMENTED_FIELDS.append(name)

    def check(v: Any) -> Any:
        if v is not None and not neutral(v):
            raise PydanticCustomError(
                "unsupported_parameter",
                "{name} is OpenAI's deprecated form of function calling, which iterserve (like "
                "vLLM) does not take: use {use}", {"name": name, "use": use})
        return v

    return _NeutralOnly(check, schema or {"type": "null"},
                        f"deprecated, not taken (use {use})")


_EMPTY_LIST = {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]}


def _falsy(v: Any) -> bool:
    return not v


def _nothing(v: Any) -> bool:
    return False


def _integral(v: Any) -> Any:
    """JSON Schema's data model: 2.0 is the integer 2. Pydantic's strict mode (kept: "2" is
    not a number) would refuse it for an int field, so a schema-valid body ({"n": 2.0},
    token ids written as floats) would be a 400; integral floats become ints, in lists too.
    Float fields take ints in strict mode, so nothing else changes."""
    if type(v) is float:
        return int(v) if v.is_integer() and abs(v) < 2 ** 63 else v
    if type(v) is list and any(type(x) is float or type(x) is list for x in v):
        return [_integral(x) for x in v]
    return v


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: _integral(v) for k, v in data.items()}
        return data


class StreamOptions(_Model):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = Field(
        None, description="every chunk carries the usage so far (vLLM)")
    include_obfuscation: bool | None = None                  # no-op


def _sum_rule(max_model_len_note: str = "") -> str:
    return ("At least 1. prompt tokens + max_tokens must not exceed the model's max_model_len "
            "(the published maximum is max_model_len - 1)." + max_model_len_note)


class _TruncateFields(_Model):
    """vLLM's `truncate_prompt_tokens`, on the generating and the pooling bodies alike."""

    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, le=MAX_TOKEN_ID, description="keep only the prompt's last k tokens (-1: "
                                                  "the model's max_model_len)")

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int | None) -> int | None:
        if v == 0:
            raise PydanticCustomError("truncate_prompt_tokens", "truncate_prompt_tokens must "
                                      "be -1 or at least 1, got 0", {})
        return v

    def truncate(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """vLLM's truncate_prompt_tokens: the last k tokens (left truncation)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_ids
        k = max_model_len if k == -1 else k
        return prompt_ids[-k:]


class _SamplingFields(_TruncateFields):
    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX, description=_sum_rule())
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKEN_ID,
                              description="-1 or 0: disabled")
    min_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(1, ge=1, le=MAX_N)
    stop: (Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN),
                     AfterValidator(_valid_unicode)]
           | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN),
                                      AfterValidator(_valid_unicode)]],
                       Field(max_length=MAX_STOP)]
           | None) = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # extensions (vLLM's names)
    priority: int | None = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY,
                                 description="lower is more urgent; anything but 0 needs a "
                                             "server started with --scheduling-policy priority")
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    # latency targets: need --scheduling-policy slo, else a 400 naming them
    ttft_slo_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS, description=(
        "time-to-first-token target in ms (default --slo-ttft-ms); a request that cannot "
        "meet it is refused early with 429 + Retry-After; needs --scheduling-policy slo"))
    tpot_slo_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS, description=(
        "time-per-output-token target in ms (default --slo-tpot-ms); admission holds before "
        "it would break; needs --scheduling-policy slo"))

    # accepted no-ops (module docstring)
    user: Text | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None

    # constrained and edited sampling (vLLM's fields; model/logits_processors.py)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=1024, description="token id (as a string) -> bias in [-100, 100]")
    min_tokens: int | None = Field(None, ge=0, description="no EOS / stop token before this "
                                                           "many output tokens")
    include_stop_str_in_output: bool | None = None
    bad_words: list[NonEmptyText] | None = Field(None, max_length=256)
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=200_000)
    # not implemented yet: a 400 naming the field unless neutral
    use_beam_search: Annotated[
        bool | None, _not_implemented("use_beam_search", _falsy, "only false")] = None
    length_penalty: Annotated[
        float | None, _not_implemented("length_penalty", lambda v: v == 1.0, "only 1.0")] = None
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOKEN_ID, description="vLLM: the top k logprobs (and the actual "
        "token's) of every prompt token; the prefix cache is not used for such a request")
    return_tokens_as_token_ids: bool | None = Field(
        None, description='logprobs name tokens as "token_id:<id>" (vLLM)')
    spaces_between_special_tokens: Annotated[
        bool | None, _not_implemented("spaces_between_special_tokens", bool,
                                      "only true")] = None
    # structured outputs (structured/params.py): OpenAI's response_format, vLLM's
    # structured_outputs extra and its older guided_* names; at most one of them
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text" | "json_object" | "json_schema", "json_schema": '
                          '{"name", "schema", "strict"}}')
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM: exactly one of json, json_object, regex, choice, grammar")
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[NonEmptyText] | None = Field(None, min_length=1, max_length=1024)
    guided_grammar: Text | None = None
    logits_processors: Annotated[Any, _not_implemented("logits_processors", _nothing,
                                                       "only null")] = None
    request_id: Annotated[Any, _not_implemented("request_id", _nothing, "only null")] = None
    cache_salt: Annotated[Any, _not_implemented("cache_salt", _nothing, "only null")] = None
    kv_transfer_params: Annotated[Any, _not_implemented("kv_transfer_params", _nothing,
                                                        "only null")] = None
    vllm_xargs: Annotated[Any, _not_implemented("vllm_xargs", _nothing, "only null")] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)

    def _sampling_params(self, max_tokens: int, logprobs: int | None,
                         defaults: Mapping[str, Any] | None = None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """`defaults`: the server's sampling defaults (the model's generation_config) for
        the fields the request leaves unset; then OpenAI's."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        d = defaults or {}

        def pick(name: str, fallback: Any) -> Any:
            v = getattr(self, name)
            return v if v is not None else d.get(name, fallback)

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(pick("temperature", 1.0)),
            top_p=float(pick("top_p", 1.0)),
            top_k=int(pick("top_k", 0)),
            min_p=float(pick("min_p", 0.0)),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=float(pick("repetition_penalty", 1.0)),
            seed=self.seed,
            n=1 if self.n is None else self.n,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens is not False,
            structured_outputs=self.structured_outputs_params(),
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids else None,
            bad_words=list(self.bad_words) if self.bad_words else None,
            min_tokens=self.min_tokens or 0,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            ttft_slo_ms=self.ttft_slo_ms, tpot_slo_ms=self.tpot_slo_ms,
        ).validate()

    def structured_outputs_params(self):
        """The one structured-output constraint the request asks for, or None (raises
        StructuredOutputsError naming the field: a 400)."""
        return StructuredOutputsParams.from_request(
            response_format=self.response_format, structured_outputs=self.structured_outputs,
            guided_json=self.guided_json, guided_regex=self.guided_regex,
            guided_choice=self.guided_choice, guided_grammar=self.guided_grammar)


PromptField = (NonEmptyText
               | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_PROMPTS)]
               | Annotated[list[TokenId], Field(min_length=1)]
               | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                           Field(min_length=1, max_length=MAX_PROMPTS)])


class CompletionRequest(_SamplingFields):
    prompt: PromptField = Field(description="a string, a list of strings, a list of token ids "
                                            "or a list of token-id lists")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOKEN_ID)
    echo: bool | None = Field(False, description="prefix each choice's text with its prompt "
                                                 "(with logprobs: the prompt's tokens too)")
    suffix: Annotated[Text | None, _not_implemented("suffix", _falsy, "only empty",
                                                    {"enum": ["", None]})] = None
    best_of: int | None = Field(None, ge=1, le=MAX_N, description=(
        "sample best_of sequences per prompt and return the n with the highest cumulative "
        "logprob (vLLM V0); not with stream"))

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1            # n and stream are validated first (parent)
        if best_of is not None and best_of < n:
            raise PydanticCustomError("best_of", "best_of must be at least n ({n}), got "
                                      "{best_of}", {"n": n, "best_of": best_of})
        if best_of is not None and best_of > n and info.data.get("stream"):
            raise PydanticCustomError(
                "unsupported_parameter", "best_of > n cannot be streamed (the n best are known "
                "only at the end, as OpenAI documents): set stream false", {})
        return best_of

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], list):
            return list(p)
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = int((defaults or {}).get("max_tokens", 16))
        plp = self.prompt_logprobs
        if self.echo and self.logprobs is not None:      # echo's logprobs are the prompt's
            plp = max(plp or 0, self.logprobs)
        params = self._sampling_params(max_tokens, self.logprobs, defaults, prompt_logprobs=plp)
        if self.best_of is not None and self.best_of > params.n:
            params.best_of = self.best_of
        return params


class TextPart(_Model):
    type: Literal["text"]
    text: Text


# --- tool calling (OpenAI's shapes) ------------------------------------------------------

FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                                    description="letters, digits, _ . - (at most 64)")]


class FunctionDefinition(_Model):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="a JSON schema for the arguments object (absent: no arguments)")
    strict: bool | None = None          # the schema is enforced when the call is forced

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise PydanticCustomError(
                "tool_parameters", "a function's parameters must be a JSON schema of type "
                "'object', got type '{t}'", {"t": v.get("type")})
        return v


class ChatTool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: FunctionName


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Model):
    name: NonEmptyText
    arguments: Text = Field(description="the arguments as JSON text")


class MessageToolCall(_Model):
    """A call the assistant made earlier in the conversation (what the client echoes back)."""
    id: NonEmptyText
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    # The rules of _needs_content, in the published schema (JSON Schema 2020-12).
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
         "then": {"required": ["tool_call_id"],
                  "properties": {"tool_call_id": {"type": "string", "minLength": 1}}}},
        {"if": {"properties": {"tool_calls": {"type": "array", "minItems": 1}},
                "required": ["tool_calls"]},
         "then": {"properties": {"role": {"const": "assistant"}}},
         "else": {"required": ["content"],
                  "properties": {"content": {"not": {"type": "null"}}}}},
    ]})

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_call_id: Text | None = None
    refusal: Text | None = None                        # no-op (echoed back by clients)
    annotations: list[Any] | None = None               # no-op
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=MAX_TOOLS)
    function_call: Annotated[Any, _deprecated(
        "messages[].function_call", _nothing, "tool_calls")] = None
    audio: Annotated[Any, _not_implemented("messages[].audio", _nothing, "only null")] = None

    @model_validator(mode="after")
    def _needs_content(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError(
                "tool_calls_role", "only assistant messages carry tool_calls (this one is "
                "{role})", {"role": self.role})
        if self.role == "tool" and not self.tool_call_id:
            raise PydanticCustomError(
                "missing_tool_call_id", "a tool message needs 'tool_call_id' (the id of the "
                "call it answers)", {})
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError(
                "missing_content", "a {role} message needs 'content' (a string or a list of "
                "text parts)", {"role": self.role})
        return self

    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return content or ""

    def to_template_dict(self, content_format: str = "string") -> dict[str, Any]:
        """The message as the chat template reads it; `content_format` "openai"
        (--chat-template-content-format) gives the content as OpenAI's list of text parts."""
        content: Any = self.text()
        if content_format == "openai":
            parts = self.content if isinstance(self.content, list) else \
                [] if self.content is None else [TextPart(type="text", text=self.content)]
            content = [{"type": "text", "text": p.text} for p in parts]
        d: dict[str, Any] = {"role": self.role, "content": content}
        if self.name:
            d["name"] = self.name
        if self.tool_call_id:
            d["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # Templates write the arguments with `tojson` (Qwen, Llama 3, Hermes): they want
            # the object, not its JSON text, as HF's and vLLM's chat paths give them.
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls]
        return d


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# Template variables chat_template_kwargs may not set: the server passes them itself.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt",
                                    "continue_final_message", "documents", "bos_token",
                                    "eos_token"})


def _template_kwargs(v: dict[str, Any] | None) -> dict[str, Any] | None:
    clash = sorted(set(v or ()) & RESERVED_TEMPLATE_VARS)
    if clash:
        raise PydanticCustomError(
            "reserved_template_var", "chat_template_kwargs may not set {names} (the server "
            "sets them from the request)", {"names": ", ".join(clash)})
    return v


class _ChatTemplateFields(_Model):
    """What chooses the chat template's output (shared by chat completions and /tokenize)."""
    add_generation_prompt: bool | None = Field(
        None, description="end the prompt with the assistant turn's opening (default true)")
    continue_final_message: bool | None = Field(
        False, description="leave the final (assistant) message open for the model to "
                           "continue; needs add_generation_prompt false")
    chat_template: Text | None = Field(
        None, description="a Jinja chat template used instead of the server's")
    chat_template_kwargs: Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)] = \
        Field(None, description="extra variables for the template (e.g. enable_thinking)")

    @field_validator("continue_final_message")
    @classmethod
    def _generation_prompt(cls, v: bool | None, info: ValidationInfo) -> bool | None:
        if v and info.data.get("add_generation_prompt"):
            raise PydanticCustomError(
                "continue_final_message", "continue_final_message and add_generation_prompt "
                "cannot both be true (set add_generation_prompt false)", {})
        return v

    @property
    def wants_generation_prompt(self) -> bool:
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt


_NEEDS_TOOLS = {   # tool_choice "auto" / "required" / a named function needs tools
    "if": {"required": ["tool_choice"], "properties": {"tool_choice": {
        "anyOf": [{"enum": ["auto", "required"]}, {"type": "object"}]}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}


class ChatCompletionRequest(_ChatTemplateFields, _SamplingFields):
    # The cross-field rules of the validators below, in the published schema.
    model_config = ConfigDict(json_schema_extra={"allOf": [
        _NEEDS_TOOLS,
        {"if": {"required": ["top_logprobs"],
                "properties": {"top_logprobs": {"type": "integer"}}},
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        {"not": {"required": ["continue_final_message", "add_generation_prompt"],
                 "properties": {"continue_final_message": {"const": True},
                                "add_generation_prompt": {"const": True}}}},
    ]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX, description=_sum_rule())
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOKEN_ID)
    echo: bool | None = Field(False, description="prefix the reply with the last message's "
                                                 "content when that message is the "
                                                 "assistant's (vLLM)")
    # tool calling (server/serving_tools.py)
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='default "auto" when tools are given, else "none"; "auto" needs a '
                          "server started with --enable-auto-tool-choice --tool-call-parser")
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one call per reply (default true)")
    # not implemented (the rest of vLLM's chat extras, OpenAI's deprecated functions)
    functions: Annotated[Any, _deprecated(
        "functions", _falsy, 'tools: [{"type": "function", "function": {...}}]',
        _EMPTY_LIST)] = None
    function_call: Annotated[Any, _deprecated(
        "function_call", lambda v: v == "none", 'tool_choice ("auto", "required", "none" or '
        '{"type": "function", "function": {"name": ...}})', {"enum": ["none", None]})] = None
    documents: Annotated[Any, _not_implemented("documents", _nothing, "only null")] = None
    mm_processor_kwargs: Annotated[Any, _not_implemented("mm_processor_kwargs", _nothing,
                                                         "only null")] = None
    modalities: Annotated[list[str] | None, _not_implemented(
        "modalities", lambda v: list(v) == ["text"], 'only ["text"]',
        {"anyOf": [{"const": ["text"]}, {"type": "null"}]})] = None
    audio: Annotated[Any, _not_implemented("audio", _nothing, "only null")] = None
    prediction: Annotated[Any, _not_implemented("prediction", _nothing, "only null")] = None
    reasoning_effort: Annotated[Any, _not_implemented("reasoning_effort", _nothing,
                                                      "only null")] = None
    verbosity: Annotated[Any, _not_implemented("verbosity", _nothing, "only null")] = None
    web_search_options: Annotated[Any, _not_implemented("web_search_options", _nothing,
                                                        "only null")] = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("top_logprobs", "top_logprobs requires logprobs to be "
                                      "true", {})
        return self

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        if choice is None or choice == "none" or "tools" not in info.data:
            return choice                       # (a bad tools list is reported by itself)
        tools = info.data["tools"]
        if not tools:
            raise PydanticCustomError("tool_choice", "tool_choice '{c}' needs a non-empty "
                                      "'tools' list", {"c": choice if isinstance(choice, str)
                                                       else "function"})
        if isinstance(choice, NamedToolChoice) and \
                choice.function.name not in {t.function.name for t in tools}:
            raise PydanticCustomError("tool_choice", "tool_choice names the function '{name}', "
                                      "which is not in 'tools'", {"name": choice.function.name})
        return choice

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """`tools` as the chat template receives them (HF's `tools=` argument)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def to_sampling_params(self, default_max_tokens: int,
                           defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        if max_tokens is None:
            max_tokens = min(default_max_tokens,
                             int((defaults or {}).get("max_tokens", default_max_tokens)))
        return self._sampling_params(max_tokens, logprobs, defaults)


# --- /tokenize and /detokenize (vLLM's bodies) ---------------------------------------------

class TokenizeCompletionRequest(_Model):
    model: Text | None = None
    prompt: NonEmptyText = Field(description="non-empty, as for /v1/completions")
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_ChatTemplateFields):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class DetokenizeRequest(_Model):
    model: Text | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]


def _tokenize_kind(v: Any) -> str:
    if isinstance(v, dict):
        return "Chat" if "messages" in v else "Completion"
    return "Chat" if isinstance(v, TokenizeChatRequest) else "Completion"


# /tokenize takes either body; `messages` decides which (so a bad chat body is reported as one,
# not as a completion body with unknown fields). Capitalised tags: not field names, so an
# error's param leaves them out (errors._loc_to_param).
TokenizeRequest = Annotated[Union[Annotated[TokenizeCompletionRequest, Tag("Completion")],
                                  Annotated[TokenizeChatRequest, Tag("Chat")]],
                            Discriminator(_tokenize_kind)]

"""Request bodies of the OpenAI-compatible API: every limit is a pydantic constraint.

Why constraints and not checks in the handlers: `/openapi.json` is generated from these
models, so the published schema states every limit (n <= 128, the stop list's size, the seed's
range, logprobs <= 20, no NaN or infinity, ...) and a request valid by the schema is served
(issue 15). What the schema cannot say statically, max_tokens <= max_model_len - 1, is added
to the published schema per app (server/openapi.py); prompt tokens + max_tokens <=
max_model_len is checked by the engine once the prompt is tokenised.

Models are strict (a string where a number belongs is a 400, not silently coerced), reject
NaN / +-inf in every float field, reject strings with lone UTF-16 surrogates (JSON allows the
escape `"\\udcff"`; no tokenizer or response encoder can handle it), and forbid unknown
fields: an unknown field is a 400 "Unrecognized request argument supplied: <name>", as
OpenAI answers (issue 14's rule: no field is silently ignored).

Fields fall in three groups:

* implemented, as OpenAI / vLLM define them;
* accepted no-ops, OpenAI fields that mean nothing for a local server (NO_OP_FIELDS):
  `user`, `store`, `metadata`, `service_tier`, `safety_identifier`, `prompt_cache_key`,
  `parallel_tool_calls` (there are no tools yet), `stream_options.include_obfuscation`, and in
  chat messages `refusal` / `annotations` (what the client echoes back);
* not implemented yet (NOT_IMPLEMENTED_FIELDS): accepted at their neutral value (null, false,
  empty, `response_format` {"type": "text"}, `tool_choice` "none", `best_of` == n, ...), any
  other value is a 400 whose `param` names the field and whose `code` is
  "unsupported_parameter". Tool calling will replace the `_not_implemented` annotations of
  `tools` and `tool_choice` with their real models.

Structured outputs (`response_format`, `structured_outputs`, `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`) and `logit_bias`, `min_tokens`, `bad_words`,
`allowed_token_ids`, `include_stop_str_in_output` are implemented: they become SamplingParams
fields, compiled / checked by the engine's input processor (a bad schema is a 400 naming it).
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from iterserve.core.request import MAX_SLO_MS, SamplingParams

MAX_LOGPROBS = 20       # OpenAI allows up to 20 top logprobs
MAX_N = 128             # OpenAI's cap on n
MAX_STOP = 16           # stop strings per request
MAX_STOP_LEN = 1024     # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPTS = 256       # prompts in one completions request
MAX_TOKEN_ID = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_PRIORITY = 2**31 - 1

NO_OP_FIELDS = ("user", "store", "metadata", "service_tier", "safety_identifier",
                "prompt_cache_key", "parallel_tool_calls", "stream_options.include_obfuscation",
                "messages[].refusal", "messages[].annotations")
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


def _not_implemented(name: str, neutral: Callable[[Any], bool], what: str) -> AfterValidator:
    """A field iterserve does not implement yet: `neutral(value)` values pass, others are a
    400 naming the field (never a silent 200)."""
    NOT_IMPLEMENTED_FIELDS.append(name)

    def check(v: Any) -> Any:
        if v is not None and not neutral(v):
            raise PydanticCustomError(
                "unsupported_parameter",
                "{name} is not supported by iterserve yet ({what})",
                {"name": name, "what": what})
        return v

    return AfterValidator(check)


def _falsy(v: Any) -> bool:
    return not v


def _nothing(v: Any) -> bool:
    return False


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool | None = False
    continuous_usage_stats: Annotated[
        bool | None, _not_implemented("stream_options.continuous_usage_stats", _falsy,
                                      "only false")] = None
    include_obfuscation: bool | None = None                  # no-op


def _sum_rule(max_model_len_note: str = "") -> str:
    return ("At least 1. prompt tokens + max_tokens must not exceed the model's max_model_len "
            "(the published maximum is max_model_len - 1)." + max_model_len_note)


class _SamplingFields(_Model):
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
    # latency targets (issue 18): need --scheduling-policy slo, else a 400 naming them
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
    prompt_logprobs: Annotated[
        int | None, _not_implemented("prompt_logprobs", _nothing, "only null")] = None
    truncate_prompt_tokens: Annotated[
        int | None, _not_implemented("truncate_prompt_tokens", _nothing, "only null")] = None
    return_tokens_as_token_ids: Annotated[
        bool | None, _not_implemented("return_tokens_as_token_ids", _falsy, "only false")] = None
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
    guided_choice: list[Text] | None = Field(None, min_length=1, max_length=1024)
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

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
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
            ttft_slo_ms=self.ttft_slo_ms, tpot_slo_ms=self.tpot_slo_ms,
        ).validate()

    def structured_outputs_params(self):
        """The one structured-output constraint the request asks for, or None (raises
        StructuredOutputsError naming the field: a 400)."""
        from iterserve.structured import StructuredOutputsParams

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
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Annotated[bool | None, _not_implemented("echo", _falsy, "only false")] = False
    suffix: Annotated[Text | None, _not_implemented("suffix", _falsy, "only empty")] = None
    best_of: int | None = Field(None, ge=1, le=MAX_N,
                                description="only equal to n (best_of > n is not supported)")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1            # n is validated first (a parent field)
        if best_of is not None and best_of != n:
            if best_of < n:
                raise PydanticCustomError("best_of", "best_of must be at least n ({n}), got "
                                          "{best_of}", {"n": n, "best_of": best_of})
            raise PydanticCustomError(
                "unsupported_parameter", "best_of > n is not supported by iterserve yet "
                "(best_of {best_of}, n {n})", {"n": n, "best_of": best_of})
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

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs)


class TextPart(_Model):
    type: Literal["text"]
    text: Text


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_call_id: Text | None = None
    refusal: Text | None = None                        # no-op (echoed back by clients)
    annotations: list[Any] | None = None               # no-op
    tool_calls: Annotated[list[Any] | None,
                          _not_implemented("messages[].tool_calls", _falsy, "only empty")] = None
    function_call: Annotated[Any, _not_implemented("messages[].function_call", _nothing,
                                                   "only null")] = None
    audio: Annotated[Any, _not_implemented("messages[].audio", _nothing, "only null")] = None

    @model_validator(mode="after")
    def _needs_content(self) -> "ChatMessage":
        if self.content is None:
            raise PydanticCustomError(
                "missing_content", "a {role} message needs 'content' (a string or a list of "
                "text parts)", {"role": self.role})
        return self

    def to_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        d: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            d["name"] = self.name
        if self.tool_call_id:
            d["tool_call_id"] = self.tool_call_id
        return d


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX, description=_sum_rule())
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool | None = True
    # no-op while there are no tools
    parallel_tool_calls: bool | None = None
    # not implemented yet (tool calling, templates, the rest of vLLM's chat extras)
    tools: Annotated[list[Any] | None, _not_implemented("tools", _falsy, "only empty")] = None
    tool_choice: Annotated[Any, _not_implemented("tool_choice", lambda v: v == "none",
                                                 'only "none"')] = None
    functions: Annotated[Any, _not_implemented("functions", _falsy, "only empty")] = None
    function_call: Annotated[Any, _not_implemented("function_call", lambda v: v == "none",
                                                   'only "none"')] = None
    echo: Annotated[bool | None, _not_implemented("echo", _falsy, "only false")] = None
    continue_final_message: Annotated[
        bool | None, _not_implemented("continue_final_message", _falsy, "only false")] = None
    chat_template: Annotated[Any, _not_implemented("chat_template", _nothing,
                                                   "only null")] = None
    chat_template_kwargs: Annotated[Any, _not_implemented("chat_template_kwargs", _falsy,
                                                          "only empty")] = None
    documents: Annotated[Any, _not_implemented("documents", _nothing, "only null")] = None
    mm_processor_kwargs: Annotated[Any, _not_implemented("mm_processor_kwargs", _nothing,
                                                         "only null")] = None
    modalities: Annotated[list[str] | None, _not_implemented(
        "modalities", lambda v: list(v) == ["text"], 'only ["text"]')] = None
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

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        return self._sampling_params(default_max_tokens if max_tokens is None else max_tokens,
                                     logprobs)


# --- /tokenize and /detokenize (vLLM's bodies) ---------------------------------------------

class TokenizeCompletionRequest(_Model):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Model):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    continue_final_message: Annotated[
        bool | None, _not_implemented("continue_final_message", _falsy, "only false")] = None
    chat_template: Annotated[Any, _not_implemented("chat_template", _nothing,
                                                   "only null")] = None
    chat_template_kwargs: Annotated[Any, _not_implemented("chat_template_kwargs", _falsy,
                                                          "only empty")] = None
    tools: Annotated[list[Any] | None, _not_implemented("tools", _falsy, "only empty")] = None


class DetokenizeRequest(_Model):
    model: Text | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]


"""Request bodies of the OpenAI-compatible API, and their translation to SamplingParams.

Models are strict (a string where a number belongs is a 400, not silently coerced) and
ignore unknown fields, as OpenAI does. Range checks live in one place,
`SamplingParams.validate()`, so the server, the offline API and the lab agree; this module
only fills in OpenAI's defaults and the few rules that are about the API itself
(logprobs limits, chat's logprobs/top_logprobs pairing).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from iterserve.core.request import SamplingParams, SamplingParamsError

MAX_LOGPROBS = 20     # OpenAI allows up to 20 top logprobs (5 for legacy completions)


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Model):
    include_usage: bool | None = False


class _SamplingFields(_Model):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions (vLLM's names)
    priority: int | None = 0
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise SamplingParamsError(
                f"logprobs must be at most {MAX_LOGPROBS}, got {logprobs}", "logprobs")
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
        ).validate()


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return [[]]            # an empty list: one empty prompt (rejected by the engine)
        if isinstance(p[0], list):
            return list(p)
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise SamplingParamsError("echo is not supported", "echo")
        if self.suffix:
            raise SamplingParamsError("suffix is not supported", "suffix")
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs)


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        d: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            d["name"] = self.name
        return d


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise SamplingParamsError("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise SamplingParamsError(
                f"top_logprobs must be non-negative, got {self.top_logprobs}", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        return self._sampling_params(default_max_tokens if max_tokens is None else max_tokens,
                                     logprobs)

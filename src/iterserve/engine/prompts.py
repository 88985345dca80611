"""The prompt shapes the offline API takes, as vLLM's `LLM.generate` does.

One prompt is a string, a list of token ids, `{"prompt": str}` (vLLM's TextPrompt) or
`{"prompt_token_ids": [int, ...]}` (TokensPrompt); `prompts` is one of those or a list of
them (shapes may be mixed). A list of ints is one prompt in token ids, never n prompts of one
token each. Anything else is refused with a message that says which prompt is wrong and what
was expected, before any request is queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from iterserve.errors import InvalidRequestError


_EXPECTED = ("a prompt is a string, a list of token ids, {'prompt': str} or "
             "{'prompt_token_ids': [int, ...]}")


@dataclass(slots=True)
class PromptInput:
    """One parsed prompt: text (to tokenise) or token ids, never both."""

    text: str | None = None
    token_ids: list[int] | None = None

    @property
    def value(self) -> str | list[int]:
        return self.text if self.text is not None else self.token_ids  # type: ignore[return-value]


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def parse_prompt(p: Any, where: str = "the prompt") -> PromptInput:
    if isinstance(p, str):
        return PromptInput(text=p)
    if isinstance(p, dict):
        keys = set(p)
        if keys == {"prompt"}:
            if not isinstance(p["prompt"], str):
                raise InvalidRequestError(
                    f"{where}: 'prompt' must be a string, got {type(p['prompt']).__name__} "
                    "(token ids go in 'prompt_token_ids')", "prompts")
            return PromptInput(text=p["prompt"])
        if keys == {"prompt_token_ids"}:
            ids = p["prompt_token_ids"]
            if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
                raise InvalidRequestError(
                    f"{where}: 'prompt_token_ids' must be a list of integer token ids, got "
                    f"{type(ids).__name__}", "prompts")
            bad = next((i for i, t in enumerate(ids) if not _is_token_id(t)), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"{where}: prompt_token_ids[{bad}] is {ids[bad]!r}, not an integer token id",
                    "prompts")
            return PromptInput(token_ids=list(ids))
        if {"prompt", "prompt_token_ids"} <= keys:
            raise InvalidRequestError(
                f"{where}: give either 'prompt' or 'prompt_token_ids', not both", "prompts")
        unknown = sorted(map(str, keys - {"prompt", "prompt_token_ids"}))
        if unknown:
            raise InvalidRequestError(
                f"{where} has unsupported key(s) {', '.join(map(repr, unknown))}; " + _EXPECTED,
                "prompts")
        raise InvalidRequestError(f"{where} is an empty dict; " + _EXPECTED, "prompts")
    if isinstance(p, (list, tuple)):
        bad = next((i for i, t in enumerate(p) if not _is_token_id(t)), None)
        if bad is not None:
            raise InvalidRequestError(
                f"{where} is a list whose item {bad} is {p[bad]!r}: a list prompt holds "
                "integer token ids only", "prompts")
        return PromptInput(token_ids=list(p))
    raise InvalidRequestError(f"{where} is a {type(p).__name__}; " + _EXPECTED, "prompts")


def parse_prompts(prompts: Any) -> list[PromptInput]:
    """The prompts of one generate() call, in order."""
    if isinstance(prompts, (str, dict)):
        return [parse_prompt(prompts)]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError(
            f"prompts is a {type(prompts).__name__}; give one prompt or a list of them ("
            + _EXPECTED + ")", "prompts")
    if prompts and all(_is_token_id(t) for t in prompts):
        return [PromptInput(token_ids=list(prompts))]     # one prompt given as token ids
    if any(_is_token_id(t) for t in prompts):
        raise InvalidRequestError(
            "prompts mixes token ids with other prompts: a list of ints is one prompt; "
            "for several, give a list of lists", "prompts")
    return [parse_prompt(p, f"prompt {i}") for i, p in enumerate(prompts)]

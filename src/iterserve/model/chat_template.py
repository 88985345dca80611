"""Chat templates rendered the way HF transformers renders them.

A chat template is a Jinja2 program shipped with the model (tokenizer_config.json,
chat_template.jinja, or a GGUF's `tokenizer.chat_template`). Models are trained on exactly
the text their template produces, so the environment must match HF's
(`transformers.utils.chat_template_utils`): a sandboxed environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps non-ASCII text,
the `raise_exception` and `strftime_now` globals, and `bos_token` / `eos_token` /
`add_generation_prompt` variables. Any difference (a stray newline, a missing system prompt)
changes the prompt the model sees.

What HF's `apply_chat_template` takes besides the messages is taken the same way: `tools`
(the list of OpenAI tool objects, a template variable; templates that know tools render them,
others ignore them), extra variables (`chat_template_kwargs`, e.g. `enable_thinking`), and
`continue_final_message`, which cuts the rendered text right after the final message's
content so the model continues that message instead of starting a new one.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from iterserve.errors import ChatTemplateError



def _raise_exception(message: str) -> None:
    # Templates call this to reject conversations they cannot express (e.g. roles out of order).
    raise ChatTemplateError(f"the chat template rejected the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's builtin tojson escapes HTML characters and forces ASCII; HF's does neither.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """Compile once per distinct template source (the server renders one per request)."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc


def normalize_messages(messages: Any, keep_parts: bool = False) -> list[dict[str, Any]]:
    """Check the OpenAI-style message list and return it with every `content` a string.

    Content given as a list of parts (`[{"type": "text", "text": ...}]`, as the OpenAI API
    allows) is joined into one string, unless `keep_parts` (a template that loops over a
    message's parts: --chat-template-content-format openai); other part types are rejected
    because a text-only model cannot see them.
    """
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(
            f"messages must be a list of {{'role', 'content'}} objects, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages must contain at least one message")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content', "
                                    f"got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        if "content" not in msg:
            raise ChatTemplateError(f"messages[{i}] has no 'content'")
        content = msg["content"]
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise ChatTemplateError(
                        f"messages[{i}].content[{j}] must be a text part "
                        "{'type': 'text', 'text': str}; this model reads text only")
                texts.append(part["text"])
            if not keep_parts:
                content = "".join(texts)
        elif not isinstance(content, str):
            raise ChatTemplateError(
                f"messages[{i}].content must be a string, got {type(content).__name__}")
        out.append({**msg, "content": content})
    return out


def _continue_final(rendered: str, msgs: list[dict[str, Any]]) -> str:
    """HF's `continue_final_message`: everything up to the end of the final message's
    content (its end-of-turn tokens and what follows are cut)."""
    final = msgs[-1]["content"]
    if isinstance(final, list):                 # OpenAI's parts (content_format "openai")
        final = "".join(part["text"] for part in final)
    stripped = final.strip()
    if not stripped or stripped not in rendered:
        raise ChatTemplateError(
            "continue_final_message is set, but the final message's content does not appear "
            "in the rendered prompt (an empty final message, or a template that rewrites it)")
    loc = rendered.rindex(stripped)
    if rendered[loc:loc + len(final.lstrip())] == final.lstrip():
        return rendered[:loc + len(final.lstrip())]
    return rendered[:loc + len(stripped)]


def render_chat_template(source: str | None, messages: Any, *, add_generation_prompt: bool = True,
                         special_tokens: dict[str, str | None] | None = None,
                         continue_final_message: bool = False,
                         content_format: str = "string", **extra: Any) -> str:
    """Render `messages` with the template `source`; `special_tokens` gives bos_token etc.,
    `extra` the other template variables (`tools`, chat_template_kwargs); `content_format`
    "openai" leaves a message's content as its list of text parts."""
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both "
                                "be true")
    if not source:
        raise ChatTemplateError(
            "this model has no chat template; send a plain completion prompt instead")
    from jinja2 import TemplateError

    template = compile_template(source)
    msgs = normalize_messages(messages, keep_parts=content_format == "openai")
    variables = {k: v for k, v in (special_tokens or {}).items()}
    variables.update(extra)
    try:
        rendered = template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                   **variables)
    except ChatTemplateError:
        raise
    except (TemplateError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from exc
    return _continue_final(rendered, msgs) if continue_final_message else rendered

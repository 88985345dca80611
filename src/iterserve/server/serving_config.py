"""The server-wide settings of the OpenAI endpoints (`iterserve serve` flags, vLLM's names),
in one frozen object that `create_app` hands to every endpoint.

- `chat_template` (`--chat-template FILE|STRING`): replaces the model's template; a
  request's own `chat_template` replaces both, only on a server started with
  `--trust-request-chat-template` (as vLLM: a template is a program, and a sandboxed one can
  still loop for hours).
- `tools` (`--enable-auto-tool-choice`, `--tool-call-parser NAME`): serving_tools.py.
- `sampling_defaults` (`--generation-config auto|vllm|DIR`): the model's
  generation_config.json sampling values (temperature, top_p, top_k, min_p,
  repetition_penalty, max_new_tokens as max_tokens) used for the fields a request leaves
  unset, as vLLM does by default; `vllm` turns them off.
- `log_requests` / `max_log_len` (`--enable-log-requests` / `--disable-log-requests`,
  `--max-log-len`): one INFO line per request with its prompt (cut to max_log_len characters
  and token ids) and sampling params, as vLLM's RequestLogger writes it.
- `content_format` (`--chat-template-content-format auto|string|openai`): a message's
  content reaches the template as its text, or as OpenAI's list of text parts; auto reads
  the template (model/chat_template.py `detect_content_format`).
- `default_chat_template_kwargs` (`--default-chat-template-kwargs JSON`): template variables
  under every request's own `chat_template_kwargs`.
- `response_role` (`--response-role`): the role chat replies carry when the prompt ends with
  the generation prompt (else the last message's role, as vLLM).
- `exclude_tools_when_tool_choice_none`: tool_choice "none" hides the tools from the template.
- `prompt_tokens_details` (`--enable-prompt-tokens-details`): usage carries
  `prompt_tokens_details.cached_tokens`; `force_include_usage`
  (`--enable-force-include-usage`): every stream ends with its usage chunk.
- `--override-generation-config JSON` is merged over the generation config's values into
  `sampling_defaults` (`load_generation_defaults`), with --generation-config vllm too.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from iterserve.server.serving_tools import ToolServerConfig

logger = logging.getLogger("iterserve.requests")

# generation_config.json key -> the request field it defaults (vLLM's list)
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                            "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class ServingConfig:
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    tools: ToolServerConfig = field(default_factory=ToolServerConfig)
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    log_requests: bool = False
    max_log_len: int | None = None
    reasoning_parser: str | None = None      # --reasoning-parser (iterserve.reasoning)
    content_format: str = "auto"
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    response_role: str = "assistant"
    exclude_tools_when_tool_choice_none: bool = False
    prompt_tokens_details: bool = False
    force_include_usage: bool = False

    def content_format_for(self, template: str | None) -> str:
        """"string" or "openai" for a template (None: the model's has no source here)."""
        if self.content_format != "auto":
            return self.content_format
        return detect_content_format(template) if template else "string"

    def log_request(self, request_id: str, prompt: Any, prompt_ids: Any, params: Any) -> None:
        if not self.log_requests:
            return
        n = self.max_log_len
        if isinstance(prompt, str) and n is not None:
            prompt = prompt[:n]
        if prompt_ids is not None and n is not None:
            prompt_ids = list(prompt_ids)[:n]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
                    request_id, prompt, params, prompt_ids)


def detect_content_format(template: str) -> str:
    """vLLM's --chat-template-content-format auto: "openai" when the template loops over a
    message's content (`{% for part in message['content'] %}`: it expects OpenAI's list of
    parts), else "string"."""
    import jinja2
    from jinja2 import nodes

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return "string"
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter) and it.node is not None:
            it = it.node
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) \
                and it.arg.value == "content":
            return "openai"
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return "openai"
    return "string"


def load_chat_template(value: str | None) -> str | None:
    """vLLM's rule for --chat-template: a file's contents, else the string itself when it
    looks like a Jinja template; anything else is an error (a mistyped path)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template "
                     "(a template contains '{{' or '{%')")


def load_generation_defaults(value: str, model: str | None,
                             override: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The sampling defaults `--generation-config` names, with `override`
    (`--override-generation-config`, the same keys as generation_config.json) on top."""
    out = _generation_config_defaults(value, model)
    if override:
        unknown = sorted(set(override) - set(GENERATION_CONFIG_FIELDS))
        if unknown:
            raise ValueError(f"--override-generation-config: {', '.join(unknown)} not "
                             f"supported (keys: {', '.join(GENERATION_CONFIG_FIELDS)})")
        for src, v in override.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"--override-generation-config: {src} must be a number, "
                                 f"got {v!r}")
            out[GENERATION_CONFIG_FIELDS[src]] = v
        logging.getLogger(__name__).info(
            "default sampling parameters with --override-generation-config: %s", out)
    return out


def _generation_config_defaults(value: str, model: str | None) -> dict[str, Any]:
    """"auto" reads the model directory's generation_config.json (none for a GGUF file or
    the bundled model's absence of one), "vllm" none, a directory its
    generation_config.json."""
    if value == "vllm":
        return {}
    if value == "auto":
        if not model or not os.path.isdir(model):
            return {}
        directory = model
    else:
        directory = value
        if not os.path.isfile(os.path.join(directory, "generation_config.json")):
            raise ValueError(f"--generation-config {value!r}: no generation_config.json there "
                             "(give 'auto', 'vllm' or a directory that has one)")
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read as JSON: {e}") from None
    if cfg.get("do_sample") is False and "temperature" not in cfg:
        pass                                   # HF's greedy flag alone changes nothing here
    out = {dst: cfg[src] for src, dst in GENERATION_CONFIG_FIELDS.items()
           if isinstance(cfg.get(src), (int, float)) and not isinstance(cfg.get(src), bool)}
    if out:
        logging.getLogger(__name__).info(
            "default sampling parameters from %s: %s (--generation-config vllm ignores them)",
            path, out)
    return out

"""Structured outputs and forced tool calls apply to the answer, not to the thinking.

With a reasoning parser, a request's constraint (response_format, guided_*, the grammar of a
"required" or named tool_choice) is rewritten into one llguidance Lark grammar: the model's
thinking, free, then the original constraint as a nested grammar (`%lark {...}`), so the
thinking is never forced into the schema and the answer always is. The thinking follows
each parser's format:

- deepseek_r1: free text up to `</think>` (the prompt opened it), then the answer;
- qwen3: optionally `<think>` free text `</think>`, then the answer (with thinking disabled
  the model writes the answer directly);
- openai_gptoss: optionally an `analysis` message, then a `final` message whose body is the
  answer, or (a forced tool call) the call's own `commentary` message (the harmony markers by
  token id: they are special tokens).

The free text ends at the closing tag, so the model decides when to stop thinking. Where the
tokenizer has a tag as one token (Qwen3's, DeepSeek-R1's) the grammar names it by id: the
matcher sees that token as its id, not as the tag's bytes, so a text literal would forbid it;
else the tag is text and the free text a lazy match up to it (`stop="</think>"`). The rewritten constraint is an ordinary `grammar` constraint: it is
compiled, cached and matched like any other.
"""

from __future__ import annotations

import json
from typing import Any

from iterserve.structured.params import StructuredOutputsError, StructuredOutputsParams

_JSON_WS = r"[\x20\x0A\x0D\x09]{0,20}"       # as structured/backend.py's JSON_WHITESPACE


def _inner_lark(params: StructuredOutputsParams) -> str:
    """The constraint as a Lark grammar (llguidance's syntax)."""
    import llguidance
    kind, value = params.kind, params.value
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else value
        if isinstance(schema, str):
            schema = json.loads(schema)
        if isinstance(schema, dict):
            opts = ({"whitespace_flexible": False} if params.disable_any_whitespace
                    else {"whitespace_pattern": _JSON_WS})
            schema = {**schema, "x-guidance": {**opts, **schema.get("x-guidance", {})}}
        return "start: %json " + json.dumps(schema, ensure_ascii=False)
    if kind == "regex":
        return json.loads(llguidance.LLMatcher.grammar_from_regex(value))["grammars"][0][
            "lark_grammar"]
    if kind == "choice":
        return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
    from llguidance.gbnf_to_lark import any_to_lark
    try:
        return any_to_lark(value)
    except Exception as e:                       # the converter raises assorted errors
        raise StructuredOutputsError(f"{params.source or 'structured_outputs.grammar'}: {e}",
                                     params.source) from None


def _special(tokenizer: Any, text: str) -> str:
    tid = tokenizer.token_to_id(text) if tokenizer is not None else None
    if tid is None:
        raise StructuredOutputsError(f"the model's tokenizer has no {text} token, which the "
                                     "openai_gptoss reasoning format needs", "model")
    return f"<[{tid}]>"


def _tag(tokenizer: Any, text: str) -> str:
    """A think tag as the grammar must name it: by token id where the tokenizer has it as one
    token (Qwen3's and DeepSeek-R1's do: the matcher sees such a token as its id, not as the
    tag's bytes), else as text."""
    tid = tokenizer.token_to_id(text) if tokenizer is not None else None
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


def answer_only(params: StructuredOutputsParams, parser_name: str,
                tokenizer: Any = None) -> StructuredOutputsParams:
    """`params` applied after the thinking of `parser_name`'s format (module docstring)."""
    inner = _inner_lark(params)
    if parser_name in ("deepseek_r1", "qwen3"):
        op, cl = _tag(tokenizer, "<think>"), _tag(tokenizer, "</think>")
        if cl.startswith("<["):      # a token: free text cannot contain it, so it ends there
            think = f"think: /(.|\\n)*/ {cl}\n"
        else:                        # text: a lazy match up to it
            think = 'think[stop="</think>"]: /(.|\\n)*/\n'
        opened = "think" if parser_name == "deepseek_r1" else f"{op} think"
        head = (f"start: {op}? think answer\n" if parser_name == "deepseek_r1"
                else f"start: ({opened})? answer\n") + think
    elif parser_name == "openai_gptoss":
        ch, msg, end, st = (_special(tokenizer, t) for t in
                            ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"))
        # a forced tool call is its own commentary message; any other answer the final one
        final = "" if params.source == "tool_choice" else f'{ch} "final" {msg} '
        head = (f'start: analysis? {final}answer\n'
                f'analysis: {ch} "analysis" {msg} /(.|\\n)*/ {end} {st} "assistant"\n')
    else:
        raise ValueError(f"no answer-only grammar for reasoning parser {parser_name!r}")
    return StructuredOutputsParams(grammar=head + "answer: %lark {\n" + inner + "\n}\n",
                                   source=params.source)

"""Constraints apply to the answer, after the thinking (iterserve.reasoning.answer_only), and
the harmony format forces a tool call as gpt-oss writes one: checked token by token against
llguidance with the tiny tokenizer (and one with gpt-oss's special tokens)."""

from __future__ import annotations

import json

import pytest

from fixtures.tiny_tokenizer import HARMONY_TOKENS, build_tiny_tokenizer
from iterserve.reasoning import answer_only
from iterserve.structured import StructuredOutputsParams
from iterserve.structured.backend import StructuredOutputCompiler
from iterserve.tools import tool_choice_constraint

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


class _Tok:
    """What the compiler and the special-token lookups read of a tokenizer."""

    def __init__(self, backend):
        self.backend = backend
        self.eos_token_ids = {2}

    def token_to_id(self, t):
        return self.backend.token_to_id(t)


def _accepts(compiler, params, ids) -> bool:
    m = compiler.compile(params).matcher()
    return all(m.accept(t) for t in ids) and m.is_accepting()


@pytest.fixture(scope="module")
def tiny():
    tok = build_tiny_tokenizer(512)
    return tok, StructuredOutputCompiler(_Tok(tok), 512)


@pytest.mark.parametrize("kind, value, good, bad", [
    ("json", SCHEMA, '{"n": 4}', '{"m": 4}'),
    ("regex", r"[ab]+/x", "abba/x", "abc/x"),
    ("choice", ["yes", "no"], "no", "maybe"),
    ("grammar", 'start: "x" NUM\nNUM: /[0-9]+/', "x42", "y42"),
])
@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_the_constraint_holds_after_free_thinking(tiny, parser, kind, value, good, bad):
    tok, compiler = tiny
    params = answer_only(StructuredOutputsParams(**{kind: value}), parser)
    think = ("<think>" if parser == "qwen3" else "") + "any { text } at all\n</think>"
    assert _accepts(compiler, params, tok.encode(think + good).ids)
    assert not _accepts(compiler, params, tok.encode(think + bad).ids)
    # qwen3 with thinking off answers directly; deepseek_r1's output always starts thinking
    direct = _accepts(compiler, params, tok.encode(good).ids)
    assert direct == (parser == "qwen3")


def test_harmony_answer_and_forced_call(tmp_path):
    tok = build_tiny_tokenizer(512, HARMONY_TOKENS)
    t = _Tok(tok)
    compiler = StructuredOutputCompiler(t, 512)
    sp = {m: tok.token_to_id(m) for m in HARMONY_TOKENS}
    enc = lambda s: tok.encode(s).ids                                       # noqa: E731
    params = answer_only(StructuredOutputsParams(json=SCHEMA), "openai_gptoss", t)
    analysis = [sp["<|channel|>"], *enc("analysis"), sp["<|message|>"], *enc("hm, n is 4"),
                sp["<|end|>"], sp["<|start|>"], *enc("assistant")]
    final = [sp["<|channel|>"], *enc("final"), sp["<|message|>"]]
    assert _accepts(compiler, params, analysis + final + enc('{"n": 4}'))
    assert _accepts(compiler, params, final + enc('{"n": 4}'))
    assert not _accepts(compiler, params, final + enc('{"n": "x"}'))
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
             {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]
    forced = tool_choice_constraint(tools, {"type": "function", "function": {"name": "f"}},
                                    "openai", tokenizer=t)
    call = [sp["<|channel|>"], *enc("commentary to=functions.f "), sp["<|constrain|>"],
            *enc("json"), sp["<|message|>"], *enc('{"n": 7}'), sp["<|call|>"]]
    assert _accepts(compiler, forced, call)
    wrong = [sp["<|channel|>"], *enc("commentary to=functions.g "), sp["<|constrain|>"],
             *enc("json"), sp["<|message|>"], *enc("{}"), sp["<|call|>"]]
    assert not _accepts(compiler, forced, wrong)
    required = answer_only(tool_choice_constraint(tools, "required", "openai", tokenizer=t),
                           "openai_gptoss", t)
    assert _accepts(compiler, required, analysis + call)
    assert _accepts(compiler, required, call)
    assert not _accepts(compiler, required, analysis + final + enc('{"n": 7}'))
    with pytest.raises(ValueError, match="<\\|channel\\|>"):
        tool_choice_constraint(tools, "required", "openai", tokenizer=_Tok(build_tiny_tokenizer()))

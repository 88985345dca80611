"""tool_choice "required" / named: the constraint forces a call the parser reads back, with
arguments valid for the function's schema, on a tiny random model."""

import json

import jsonschema
import pytest

from fixtures.constrained_loop import Row, generate
from iterserve.errors import ToolChoiceError
from iterserve.tools import get_tool_parser, tool_choice_constraint

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer", "minimum": -99,
                                                   "maximum": 99},
                                             "b": {"type": "integer", "minimum": -99,
                                                   "maximum": 99}},
            "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping"}},     # no parameters: any object
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"})
           for t in TOOLS}


def run_forced(compiler, tiny_model, tiny_tok, prompt, params, seeds, max_tokens=150):
    g = compiler.compile(params)
    rows = [Row(prompt, g.matcher(), max_tokens=max_tokens) for _ in seeds]
    outs = []
    for seed, row in zip(seeds, rows):
        generate(tiny_model, [row], compiler.eos_token_ids, temperature=1.0, seed=seed)
        outs.append((row, tiny_tok.decode(row.output)))
    return outs


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_required_forces_parseable_valid_calls(parser, compiler, tiny_model, tiny_tok,
                                               chat_prompt):
    params = tool_choice_constraint(TOOLS, "required", parser, parallel_tool_calls=True)
    assert params.kind == "grammar" and params.source == "tool_choice"
    for row, text in run_forced(compiler, tiny_model, tiny_tok, chat_prompt, params,
                                seeds=[0, 1]):
        ex = get_tool_parser(parser).extract(text)
        assert ex.tool_calls, text
        calls = ex.tool_calls
        if row.finish == "length":    # a random model may keep adding parallel calls: the
            calls = calls[:-1]        # last one may be cut, every one before it is whole
        else:
            assert row.matcher.is_terminated() and ex.content is None, text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_named_choice_forces_that_one_function(compiler, tiny_model, tiny_tok, chat_prompt):
    params = tool_choice_constraint(
        TOOLS, {"type": "function", "function": {"name": "add"}}, "hermes")
    for row, text in run_forced(compiler, tiny_model, tiny_tok, chat_prompt, params,
                                seeds=[3, 4, 5]):
        assert row.finish == "stop" and row.matcher.is_terminated(), text
        assert text.startswith("<tool_call>\n{\"name\": \"add\", \"arguments\": {")
        (call,) = get_tool_parser("hermes").extract(text).tool_calls
        assert call.name == "add"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS["add"])
        # the same output streamed token by token gives the same call
        s = get_tool_parser("hermes").stream()
        for t in row.output:
            s.feed(tiny_tok.decode([t]))
        s.finish()
        assert [(c.name, c.arguments) for c in s.tool_calls] == [(call.name, call.arguments)]


def test_single_call_when_not_parallel(compiler, tiny_model, tiny_tok, chat_prompt):
    params = tool_choice_constraint(TOOLS[:2], "required", "llama3_json",
                                    parallel_tool_calls=False)
    for row, text in run_forced(compiler, tiny_model, tiny_tok, chat_prompt, params, [6, 7]):
        assert row.finish == "stop", text
        (call,) = get_tool_parser("llama3_json").extract(text).tool_calls
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_nothing_forced_and_bad_choices():
    assert tool_choice_constraint(TOOLS, "auto") is None
    assert tool_choice_constraint(TOOLS, "none") is None
    assert tool_choice_constraint(TOOLS, None) is None
    for tools, choice, field in [
        ([], "required", "tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        ([{"type": "function", "function": {"name": ""}}], "required", "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "required",
         "tools[0].function.parameters"),
        ([{"type": "retrieval"}], "required", "tools[0]"),
    ]:
        with pytest.raises(ToolChoiceError) as e:
            tool_choice_constraint(tools, choice)
        assert e.value.param == field
    with pytest.raises(ValueError):
        tool_choice_constraint(TOOLS, "required", "pythonic")


def test_mistral_uses_the_special_token_by_id(compiler, tiny_tok):
    class Tok:
        def token_to_id(self, t):
            return 0 if t == "[TOOL_CALLS]" else None     # <|endoftext|> stands in for it
    params = tool_choice_constraint(TOOLS, "required", "mistral", tokenizer=Tok())
    assert params.grammar.startswith("start: <[0]>")
    m = compiler.compile(params).matcher()
    assert not m.accept(tiny_tok.encode("[", add_special_tokens=False)[0])
    assert m.accept(0)

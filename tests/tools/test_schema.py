"""tools/schema.py: a forced call's arguments schema holds only declared keys (unless the
schema allows others explicitly); strict: true is OpenAI's strict mode. Checked on the
schema and, through the compiled grammar, on what the matcher accepts."""

import copy

import jsonschema
import pytest

from iterserve.tools import tool_choice_constraint
from iterserve.tools.schema import closed_schema

OPEN = {"type": "object", "properties": {"city": {"type": "string"},
                                         "when": {"type": "object",
                                                  "properties": {"day": {"type": "integer"}}}},
        "required": ["city"]}


def test_objects_without_a_rule_for_other_keys_are_closed():
    before = copy.deepcopy(OPEN)
    c = closed_schema(OPEN)
    assert OPEN == before                                   # the client's schema is untouched
    assert c["additionalProperties"] is False
    assert c["properties"]["when"]["additionalProperties"] is False
    assert c["required"] == ["city"]                        # optional stays optional
    jsonschema.validate({"city": "Oslo"}, c)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Oslo", "condition": "rain"}, c)


def test_explicitly_open_objects_and_composites():
    s = {"type": "object", "properties": {
        "tags": {"type": "object", "additionalProperties": {"type": "string"}},
        "free": {"type": "object", "additionalProperties": True},
        "pat": {"type": "object", "patternProperties": {"^x": {}}},
        "list": {"type": "array", "items": {"type": "object", "properties": {"a": {}}}},
        "either": {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "null"}]},
        "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
        "ref": {"$ref": "#/$defs/Point"}},
        "$defs": {"Point": {"type": "object", "properties": {"x": {}, "y": {}}}}}
    c = closed_schema(s)
    p = c["properties"]
    assert p["tags"]["additionalProperties"] == {"type": "string"}
    assert p["free"]["additionalProperties"] is True
    assert "additionalProperties" not in p["pat"]
    assert p["list"]["items"]["additionalProperties"] is False
    assert p["either"]["anyOf"][0]["additionalProperties"] is False
    assert p["either"]["anyOf"][1] == {"type": "null"}
    # allOf: the branches together declare the keys; closing one would refuse the other's
    assert all("additionalProperties" not in b for b in p["both"]["allOf"])
    jsonschema.validate({"both": {"a": 1, "b": 2}}, c)
    assert c["$defs"]["Point"]["additionalProperties"] is False
    assert closed_schema({"type": "object"}) == {"type": "object",
                                                 "additionalProperties": False}


def test_strict_closes_everything_and_requires_every_property():
    s = {"type": "object", "properties": {"a": {"type": "integer"},
                                          "b": {"type": "object", "additionalProperties": True,
                                                "properties": {"c": {}}}},
         "required": ["b"]}
    c = closed_schema(s, strict=True)
    assert c["required"] == ["b", "a"] and c["additionalProperties"] is False
    assert c["properties"]["b"] == {"type": "object", "additionalProperties": False,
                                    "properties": {"c": {}}, "required": ["c"]}


def _accepts(compiler, tiny_tok, params, text):
    m = compiler.compile(params).matcher()
    ids = tiny_tok.encode(text, add_special_tokens=False)
    return all(m.accept(t) for t in ids), m


def _tool(params, strict=None):
    fn = {"name": "f", "parameters": params}
    if strict is not None:
        fn["strict"] = strict
    return [{"type": "function", "function": fn}]


CALL = '<tool_call>\n{"name": "f", "arguments": %s}\n</tool_call>'


def test_the_grammar_refuses_undeclared_keys(compiler, tiny_tok):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    forced = tool_choice_constraint(_tool(schema), "required")
    ok, m = _accepts(compiler, tiny_tok, forced, CALL % '{"city": "Oslo"}')
    assert ok and m.is_accepting()
    assert not _accepts(compiler, tiny_tok, forced, CALL % '{"city": "Oslo", "x": 1}')[0]
    # a schema that allows other keys still gets them
    free = tool_choice_constraint(_tool({**schema, "additionalProperties": True}), "required")
    assert _accepts(compiler, tiny_tok, free, CALL % '{"city": "Oslo", "x": 1}')[0]
    # strict: the optional key must be there
    strict = tool_choice_constraint(_tool(schema, strict=True), "required")
    assert not _accepts(compiler, tiny_tok, strict, CALL % "{}")[0]
    assert _accepts(compiler, tiny_tok, forced, CALL % "{}")[0]


def test_the_call_list_is_bounded(compiler, tiny_tok):
    one = CALL % "{}"
    forced = tool_choice_constraint(_tool({"type": "object"}), "required", max_calls=3)
    ok, m = _accepts(compiler, tiny_tok, forced, "\n".join([one] * 3))
    assert ok and m.is_terminated()                 # nothing may follow the third call
    assert not _accepts(compiler, tiny_tok, forced, "\n".join([one] * 3) + "\n")[0]
    ok, m = _accepts(compiler, tiny_tok, forced, "\n".join([one] * 2))
    assert ok and m.is_accepting() and not m.is_terminated()     # may stop or add one
    single = tool_choice_constraint(_tool({"type": "object"}), "required",
                                    parallel_tool_calls=False)
    ok, m = _accepts(compiler, tiny_tok, single, one)
    assert ok and m.is_terminated()
    with pytest.raises(ValueError):
        tool_choice_constraint(_tool({"type": "object"}), "required", max_calls=0)

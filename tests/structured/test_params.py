"""StructuredOutputsParams: the request fields that ask for a constraint, and their 400s."""

import subprocess
import sys

import pytest

from iterserve.errors import StructuredOutputsError
from iterserve.structured.params import StructuredOutputsParams as P

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_exactly_one_constraint():
    assert P(json=SCHEMA).kind == "json"
    assert P(regex="a+").kind == "regex"
    assert P(choice=["x", "y"]).value == ["x", "y"]
    assert P(grammar='root ::= "a"').kind == "grammar"
    assert P(json_object=True).kind == "json_object"
    with pytest.raises(StructuredOutputsError, match="exactly one") as e:
        P()
    assert e.value.param == "structured_outputs"
    with pytest.raises(StructuredOutputsError, match="got json, regex"):
        P(json=SCHEMA, regex="a")


@pytest.mark.parametrize("kwargs, field", [
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": "[1, 2]"}, "structured_outputs.json"),
    ({"json": 3}, "structured_outputs.json"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"),
    ({"grammar": "  "}, "structured_outputs.grammar"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
])
def test_bad_shapes_name_the_field(kwargs, field):
    with pytest.raises(StructuredOutputsError) as e:
        P(**kwargs)
    assert e.value.param == field
    assert isinstance(e.value, ValueError)


def test_json_text_and_dict_share_a_cache_key():
    import json
    assert P(json=SCHEMA).cache_key() == P(json=json.dumps(SCHEMA, indent=2)).cache_key()
    assert P(json=SCHEMA).cache_key() != P(json=SCHEMA, disable_any_whitespace=True).cache_key()
    assert P(choice=["a", "b"]).cache_key() != P(choice=["b", "a"]).cache_key()
    hash(P(json=SCHEMA).cache_key())


def test_openai_response_format():
    f = P.from_openai_response_format
    assert f(None) is None
    assert f({"type": "text"}) is None
    assert f({"type": "json_object"}).kind == "json_object"
    p = f({"type": "json_schema",
           "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}})
    assert p.json == SCHEMA and p.source == "response_format.json_schema.schema"
    assert f({"type": "json_schema", "json_schema": {"name": "any"}}).kind == "json_object"
    for bad, field in [({"type": "bogus"}, "response_format.type"),
                       ({}, "response_format.type"),
                       ("json", "response_format"),
                       ({"type": "json_schema"}, "response_format.json_schema"),
                       ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "y"}},
                        "response_format.json_schema.strict"),
                       ({"type": "json_schema", "json_schema": {"schema": "{oops"}},
                        "response_format.json_schema.schema")]:
        with pytest.raises(StructuredOutputsError) as e:
            f(bad)
        assert e.value.param == field, bad


def test_pydantic_models_are_read_too():
    from pydantic import BaseModel

    class JsonSchema(BaseModel):
        name: str
        schema_: dict | None = None
        strict: bool | None = None

    class RF(BaseModel):
        type: str
        json_schema: JsonSchema | None = None

    p = P.from_openai_response_format(RF(type="json_schema",
                                         json_schema=JsonSchema(name="x", schema_=SCHEMA)))
    assert p.json == SCHEMA


def test_vllm_structured_outputs_and_guided_names():
    r = P.from_request
    assert r() is None
    assert r(structured_outputs={"regex": "[a-z]+"}).regex == "[a-z]+"
    assert r(structured_outputs={"choice": ["a", "b"]}).source == "structured_outputs.choice"
    assert r(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}
             ).disable_any_whitespace
    assert r(guided_json=SCHEMA).source == "guided_json"
    assert r(guided_regex="a+").regex == "a+"
    assert r(guided_choice=["x"]).choice == ["x"]
    assert r(guided_grammar='root ::= "a"').grammar == 'root ::= "a"'
    assert r(guided_json_object=True).kind == "json_object"
    assert r(response_format={"type": "text"}, guided_regex="a").regex == "a"
    with pytest.raises(StructuredOutputsError) as e:
        r(response_format={"type": "json_object"}, guided_regex="a")
    assert e.value.param == "guided_regex"
    with pytest.raises(StructuredOutputsError) as e:
        r(structured_outputs={"structural_tag": "{}"})
    assert e.value.param == "structured_outputs.structural_tag"
    with pytest.raises(StructuredOutputsError) as e:
        r(structured_outputs={"jsn": SCHEMA})
    assert e.value.param == "structured_outputs.jsn"
    with pytest.raises(StructuredOutputsError) as e:
        r(guided_choice=[])
    assert e.value.param == "guided_choice"
    with pytest.raises(StructuredOutputsError) as e:
        r(guided_whitespace_pattern=" *")
    assert e.value.param == "guided_whitespace_pattern"


def test_params_module_imports_no_torch():
    code = ("import sys; import iterserve.structured as s, iterserve.tools; "
            "s.StructuredOutputsParams(json={'type': 'object'}); "
            "assert 'torch' not in sys.modules and 'llguidance' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr

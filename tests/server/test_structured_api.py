"""Structured outputs and logits fields over HTTP, driven with the official `openai` client:
each test fails if the server dropped the field it sends."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from iterserve.errors import SLOUnattainableError


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def _json_schema_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                   "strict": True}}


def test_response_format_json_schema_constrains_the_output(client, server):
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=60,
                                       temperature=0, response_format=_json_schema_format())
    choice = r.choices[0]
    text = choice.message.content
    # The random model loves whitespace, which JSON allows between tokens: either the object
    # is complete and valid, or the cut left a prefix of one (an unconstrained random model
    # does not start with "{").
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert choice.finish_reason == "length" and text.startswith("{"), choice
        assert re.match(r'\{\s*"(name|age)"\s*:', text), text


COMPACT = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}


def test_structured_outputs_json_output_validates(client, server):
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=80,
                                       temperature=0, extra_body=COMPACT)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_structured_json_streamed_with_n_3(client, server):
    stream = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=7, n=3,
        stream=True, extra_body=COMPACT)
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(texts) == [0, 1, 2]
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_gives_a_json_object(client, server):
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=40,
                                       temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:                                   # cut by max_tokens: a valid prefix of an object
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_guided_choice_and_regex_through_extra_body(client, server):
    r = client.completions.create(model=server.model, prompt="The answer is", max_tokens=10,
                                  temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=server.model, prompt="Code:", max_tokens=10,
                                  temperature=0, extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", r.choices[0].text), r.choices[0].text
    r = client.completions.create(
        model=server.model, prompt="Pick:", max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].text in ("red", "green", "blue")


def test_bad_constraints_are_400s_naming_the_field(server):
    cases = [
        ({"response_format": {"type": "bogus"}}, "response_format"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"logit_bias": {"999999999": 5}}, "logit_bias"),
        ({"allowed_token_ids": [10 ** 9]}, "allowed_token_ids"),
    ]
    for extra, param in cases:
        r = httpx.post(server.v1 + "/completions", timeout=30,
                       json={"prompt": "x", "max_tokens": 2, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"].startswith(param), (extra, r.json())
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_logit_bias_forces_and_bans_a_token(client, server):
    tok = server.engine.tokenizer
    forced = tok.encode(" the", add_special_tokens=False)[-1]
    r = client.completions.create(model=server.model, prompt="x", max_tokens=4, temperature=0,
                                  logit_bias={str(forced): 100},
                                  extra_body={"ignore_eos": True})
    assert tok.encode(r.choices[0].text, add_special_tokens=False) == [forced] * 4 or \
        r.choices[0].text == tok.decode([forced] * 4)
    plain = client.completions.create(model=server.model, prompt="x", max_tokens=1,
                                      temperature=0, extra_body={"ignore_eos": True})
    first = tok.encode(plain.choices[0].text, add_special_tokens=False)
    if first:
        banned = client.completions.create(
            model=server.model, prompt="x", max_tokens=1, temperature=0,
            logit_bias={str(first[0]): -100}, extra_body={"ignore_eos": True})
        assert banned.choices[0].text != plain.choices[0].text


def test_slo_refusal_maps_to_429_with_retry_after():
    from iterserve.server.errors import to_api_error

    err = to_api_error(SLOUnattainableError("cannot meet ttft", retry_after_s=2.2,
                                            predicted_ttft_s=3.0, ttft_slo_s=1.0))
    assert err.status_code == 429 and err.headers["Retry-After"] == "3"
    assert err.code == "slo_unattainable"
    err = to_api_error(SLOUnattainableError("prompt too slow", retry_after_s=None,
                                            predicted_ttft_s=3.0, ttft_slo_s=1.0))
    assert err.status_code == 400 and err.param == "ttft_slo_ms"

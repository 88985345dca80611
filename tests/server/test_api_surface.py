"""Issue 14's rule: every request field works, is a listed no-op, or is a 400 naming it;
and the endpoints vLLM users expect (/ping, /version, /v1/models root, /tokenize,
/detokenize). Driven with the official `openai` client and raw HTTP."""

from __future__ import annotations

import httpx
import openai
import pytest

from iterserve.server.protocol import NO_OP_FIELDS, NOT_IMPLEMENTED_FIELDS

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60)


def test_an_unknown_field_is_a_400_naming_it(client, server):
    for call in (lambda: client.completions.create(model=server.model, prompt="x",
                                                   max_tokens=1, extra_body={"frobnicate": 1}),
                 lambda: client.chat.completions.create(model=server.model, messages=MESSAGES,
                                                        max_tokens=1,
                                                        extra_body={"frobnicate": 1})):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["message"] == "Unrecognized request argument supplied: frobnicate"
        assert e.value.body["param"] == "frobnicate"
    r = httpx.post(server.v1 + "/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "x", "colour": "red"}], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.colour"


def test_no_op_fields_are_accepted(client, server):
    assert {"user", "store", "metadata", "service_tier"} <= set(NO_OP_FIELDS)
    r = client.chat.completions.create(
        model=server.model, messages=MESSAGES + [
            {"role": "assistant", "content": "Hello", "refusal": None, "annotations": []},
            {"role": "user", "content": "More"}],
        max_tokens=2, user="u1", store=False, metadata={"k": "v"}, service_tier="auto",
        parallel_tool_calls=True, stream_options=None)
    assert r.choices[0].message.role == "assistant"
    r = client.completions.create(model=server.model, prompt="x", max_tokens=1, user="u1",
                                  extra_body={"store": True, "metadata": {"a": "b"}})
    assert r.choices


# (endpoint, field, a value that would matter, a neutral value that is accepted or None)
NOT_IMPLEMENTED = [
    ("chat", "tools", [{"type": "function", "function": {"name": "f"}}], []),
    ("chat", "tool_choice", "auto", "none"),
    ("chat", "tool_choice", {"type": "function", "function": {"name": "f"}}, None),
    ("cmpl", "best_of", 2, 1),
    ("both", "use_beam_search", True, False),
    ("both", "prompt_logprobs", 1, None),
    ("chat", "continue_final_message", True, False),
    ("chat", "chat_template", "{{ messages }}", None),
    ("chat", "chat_template_kwargs", {"enable_thinking": False}, {}),
    ("chat", "echo", True, False),
    ("cmpl", "echo", True, False),
    ("cmpl", "suffix", "tail", None),
    ("both", "truncate_prompt_tokens", 5, None),
    ("both", "return_tokens_as_token_ids", True, False),
    ("both", "length_penalty", 2.0, 1.0),
    ("chat", "reasoning_effort", "low", None),
]


def _body(endpoint: str, field: str, value) -> tuple[str, dict]:
    if endpoint == "chat":
        return "/chat/completions", {"messages": MESSAGES, "max_tokens": 1, field: value}
    return "/completions", {"prompt": "x", "max_tokens": 1, field: value}


@pytest.mark.parametrize("endpoint, field, value, neutral", NOT_IMPLEMENTED,
                         ids=[f"{e}-{f}-{i}" for i, (e, f, _, _) in enumerate(NOT_IMPLEMENTED)])
def test_a_field_not_implemented_yet_is_a_400_naming_it(server, endpoint, field, value,
                                                        neutral):
    for ep in (["chat", "cmpl"] if endpoint == "both" else [endpoint]):
        path, body = _body(ep, field, value)
        r = httpx.post(server.v1 + path, json=body, timeout=30)
        assert r.status_code == 400, (ep, r.text)
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], err
        if neutral is not None:
            path, body = _body(ep, field, neutral)
            r = httpx.post(server.v1 + path, json=body, timeout=30)
            assert r.status_code == 200, (ep, field, neutral, r.text)


def test_stream_options_continuous_usage_stats_is_refused_by_name(server):
    r = httpx.post(server.v1 + "/completions", timeout=30, json={
        "prompt": "x", "max_tokens": 1, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream_options.continuous_usage_stats"


def test_every_not_implemented_field_is_in_the_published_schema(server):
    spec = httpx.get(server.base_url + "/openapi.json").json()["components"]["schemas"]
    props = set(spec["CompletionRequest"]["properties"]) | \
        set(spec["ChatCompletionRequest"]["properties"])
    for name in NOT_IMPLEMENTED_FIELDS:
        if "." not in name and "[" not in name:
            assert name in props, name


def test_priority_on_an_fcfs_server_names_the_flag(client, server, start_server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="x", max_tokens=1,
                                  extra_body={"priority": 2})
    assert "--scheduling-policy priority" in e.value.body["message"]
    assert e.value.body["param"] == "priority"
    assert client.completions.create(model=server.model, prompt="x", max_tokens=1,
                                     extra_body={"priority": 0}).choices
    p = start_server(scheduling_policy="priority")
    pc = openai.OpenAI(base_url=p.v1, api_key="x", max_retries=0)
    assert pc.completions.create(model=p.model, prompt="x", max_tokens=1,
                                 extra_body={"priority": -5}).choices


# --- endpoints ---------------------------------------------------------------------------------

def test_ping_version_and_models_root(client, server, tiny_model_dir):
    assert httpx.get(server.base_url + "/ping").status_code == 200
    assert httpx.post(server.base_url + "/ping").status_code == 200
    v = httpx.get(server.base_url + "/version").json()
    assert isinstance(v["version"], str) and v["version"]
    (m,) = client.models.list().data
    assert m.id == server.model and m.root == str(tiny_model_dir)
    assert m.max_model_len == server.engine.max_model_len


def test_tokenize_and_detokenize_with_vllms_bodies(server):
    tok = server.engine.tokenizer
    r = httpx.post(server.base_url + "/tokenize",
                   json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == server.engine.max_model_len
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    r2 = httpx.post(server.base_url + "/tokenize",
                    json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert r2["tokens"] == tok.encode("Hello world", add_special_tokens=False)
    assert r2["token_strs"] is None
    chat = httpx.post(server.base_url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(MESSAGES),
                                        add_special_tokens=False)
    back = httpx.post(server.base_url + "/detokenize", json={"tokens": r2["tokens"]}).json()
    assert back["prompt"] == "Hello world"
    bad = httpx.post(server.base_url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    bad = httpx.post(server.base_url + "/tokenize", json={"prompt": "x", "model": "nope"})
    assert bad.status_code == 404
    bad = httpx.post(server.base_url + "/tokenize", json={"prompt": "x", "extra": 1})
    assert bad.status_code == 400

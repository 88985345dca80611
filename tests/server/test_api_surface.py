"""The API's rule: every request field works, is a listed no-op, or is a 400 naming it;
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
    ("both", "use_beam_search", True, False),
    ("cmpl", "suffix", "tail", None),
    ("both", "length_penalty", 2.0, 1.0),
    ("chat", "reasoning_effort", "low", None),
    ("chat", "functions", [{"name": "f"}], None),
    ("chat", "function_call", "auto", "none"),
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




def test_deprecated_function_fields_say_to_use_tools(server):
    for field, value, use in (("functions", [{"name": "f", "parameters": {}}], "tools"),
                              ("function_call", {"name": "f"}, "tool_choice")):
        r = httpx.post(server.v1 + "/chat/completions", timeout=30, json={
            "messages": MESSAGES, "max_tokens": 1, field: value})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field
        assert "deprecated" in err["message"] and f"use {use}" in err["message"]
    r = httpx.post(server.v1 + "/chat/completions", timeout=30, json={"messages": [
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "user", "content": "x"}], "max_tokens": 1})
    assert r.status_code == 400 and "use tool_calls" in r.json()["error"]["message"]


def test_every_not_implemented_field_is_in_the_published_schema(server):
    spec = httpx.get(server.base_url + "/openapi.json").json()["components"]["schemas"]
    props = set(spec["CompletionRequest"]["properties"]) | \
        set(spec["ChatCompletionRequest"]["properties"]) | \
        set(spec["ResponsesRequest"]["properties"])
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


# --- request fields that work now (each test fails if the server drops its field) ----------

STORY = [{"role": "user", "content": "Tell a story."},
         {"role": "assistant", "content": "Once upon a"}]


def _tokenize(server, **body) -> dict:
    r = httpx.post(server.base_url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_continue_final_message_leaves_the_last_message_open(server, client):
    tok = server.engine.tokenizer
    open_ = _tokenize(server, messages=STORY, add_generation_prompt=False,
                      continue_final_message=True)
    closed = _tokenize(server, messages=STORY, add_generation_prompt=False)
    text = tok.decode(open_["tokens"], skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\nOnce upon a"), text
    assert tok.decode(closed["tokens"], skip_special_tokens=False).endswith(
        "Once upon a<|im_end|>\n")
    r = client.chat.completions.create(
        model=server.model, messages=STORY, max_tokens=2, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.usage.prompt_tokens == open_["count"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server.model, messages=STORY, max_tokens=2,
            extra_body={"continue_final_message": True, "add_generation_prompt": True})
    assert e.value.body["param"] == "continue_final_message"


def test_add_generation_prompt_false_drops_the_assistant_opening(server, client):
    kw = dict(model=server.model, messages=MESSAGES, max_tokens=1)
    with_prompt = client.chat.completions.create(**kw).usage.prompt_tokens
    without = client.chat.completions.create(
        **kw, extra_body={"add_generation_prompt": False}).usage.prompt_tokens
    tok = server.engine.tokenizer
    assert with_prompt - without == len(tok.encode("<|im_start|>assistant\n",
                                                   add_special_tokens=False))


def test_chat_echo_prefixes_the_final_assistant_message(server, client):
    kw = dict(model=server.model, messages=STORY, max_tokens=4, temperature=0)
    cont = {"continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(**kw, extra_body=cont).choices[0].message.content
    echoed = client.chat.completions.create(
        **kw, extra_body={**cont, "echo": True}).choices[0].message.content
    assert echoed == "Once upon a" + plain
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        **kw, stream=True, extra_body={**cont, "echo": True}) if c.choices)
    assert streamed == echoed
    # the last message is the user's: nothing to echo
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=3,
                                       temperature=0, extra_body={"echo": True})
    assert r.choices[0].message.content == client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=3,
        temperature=0).choices[0].message.content


def test_completions_echo_prefixes_the_prompt(server, client):
    kw = dict(model=server.model, max_tokens=3, temperature=0)
    plain = client.completions.create(prompt="Once upon a", **kw).choices[0].text
    r = client.completions.create(prompt=["Once upon a", "Hello"], echo=True, **kw)
    assert r.choices[0].text == "Once upon a" + plain
    assert r.choices[1].text.startswith("Hello")
    ids = server.engine.tokenizer.encode("Once upon a")
    assert client.completions.create(prompt=ids, echo=True, **kw).choices[0].text == \
        server.engine.tokenizer.decode(ids, skip_special_tokens=False) + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        prompt="Once upon a", echo=True, stream=True, **kw))
    assert streamed == "Once upon a" + plain
    # echo + logprobs: the prompt's tokens lead the logprobs (test_prompt_logprobs_api.py)
    r = client.completions.create(prompt="Once upon a", echo=True, logprobs=1, **kw)
    assert r.choices[0].logprobs.tokens[:len(ids)] == [
        server.engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def test_per_request_chat_template_and_its_kwargs(server, client, start_server):
    with pytest.raises(openai.BadRequestError) as e:          # not trusted by default
        client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=1,
                                       extra_body={"chat_template": "{{ messages }}"})
    assert e.value.body["param"] == "chat_template"
    assert "--trust-request-chat-template" in e.value.body["message"]
    from iterserve.server.serving_config import ServingConfig
    server = start_server(serving_config=ServingConfig(trust_request_chat_template=True))
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60)
    tok = server.engine.tokenizer
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    r = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=1,
        extra_body={"chat_template": template,
                    "chat_template_kwargs": {"greeting": "Hello world! "}})
    assert r.usage.prompt_tokens == len(tok.encode("Hello world! Hi", add_special_tokens=False))
    got = _tokenize(server, messages=MESSAGES, chat_template=template,
                    chat_template_kwargs={"greeting": "Once "})
    assert got["tokens"] == tok.encode("Once Hi", add_special_tokens=False)
    for extra, param in (({"chat_template": "{% for %}"}, "chat_template"),
                         ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.model, messages=MESSAGES,
                                           max_tokens=1, extra_body=extra)
        assert e.value.body["param"] == param, e.value.body


def test_truncate_prompt_tokens_keeps_the_last_k(server, client):
    tok = server.engine.tokenizer
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(prompt)
    kw = dict(model=server.model, max_tokens=4, temperature=0)
    r = client.completions.create(prompt=prompt, extra_body={"truncate_prompt_tokens": 3}, **kw)
    assert r.usage.prompt_tokens == 3
    assert r.choices[0].text == client.completions.create(prompt=ids[-3:], **kw).choices[0].text
    c = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=1,
                                       extra_body={"truncate_prompt_tokens": 2})
    assert c.usage.prompt_tokens == 2
    long_prompt = "fox " * 400                      # over max_model_len (256) untruncated
    r = client.completions.create(prompt=long_prompt, extra_body={"truncate_prompt_tokens": 8},
                                  **kw)
    assert r.usage.prompt_tokens == 8
    for bad in (0, -2):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(prompt=prompt, extra_body={"truncate_prompt_tokens": bad},
                                      **kw)
        assert e.value.body["param"] == "truncate_prompt_tokens"


def test_return_tokens_as_token_ids(server, client):
    tok = server.engine.tokenizer
    r = client.completions.create(model=server.model, prompt="Hello", max_tokens=4,
                                  temperature=0, logprobs=2,
                                  extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens), lp.tokens
    ids = [int(t.split(":")[1]) for t in lp.tokens]
    assert tok.decode(ids) == r.choices[0].text
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    c = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": True})
    content = c.choices[0].logprobs.content
    assert content and all(e.token.startswith("token_id:") for e in content)
    plain = client.completions.create(model=server.model, prompt="Hello", max_tokens=4,
                                      temperature=0, logprobs=2)
    assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)


def test_continuous_usage_stats_puts_usage_in_every_chunk(server, client):
    for create, kw in ((client.completions.create, {"prompt": "Hello"}),
                       (client.chat.completions.create, {"messages": MESSAGES})):
        chunks = list(create(model=server.model, max_tokens=4, stream=True,
                             extra_body={"ignore_eos": True},
                             stream_options={"include_usage": True,
                                             "continuous_usage_stats": True}, **kw))
        with_choices = [c for c in chunks if c.choices]
        counts = [c.usage.completion_tokens for c in with_choices]
        assert all(c.usage is not None and c.usage.prompt_tokens > 0 or
                   c.usage.completion_tokens == 0 for c in with_choices)
        assert counts == sorted(counts) and counts[-1] == 4, counts
        assert chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices
        plain = list(create(model=server.model, max_tokens=4, stream=True,
                            stream_options={"include_usage": True}, **kw))
        assert all(c.usage is None for c in plain if c.choices)


def test_best_of_returns_the_n_best_by_cumulative_logprob(client, server):
    kw = dict(model=server.model, prompt="Once upon a", max_tokens=5, temperature=1.0, seed=3,
              extra_body={"ignore_eos": True})
    four = client.completions.create(n=4, logprobs=0, **kw).choices
    # the four samples differ (else "the best two" would be any two and the check below moot)
    assert len({c.text for c in four}) > 2, [c.text for c in four]
    ranked = sorted(four, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert sum(ranked[1].logprobs.token_logprobs) > sum(ranked[3].logprobs.token_logprobs)
    r = client.completions.create(n=2, best_of=4, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [c.text for c in ranked[:2]]
    assert all(c.logprobs is None for c in r.choices)
    assert r.usage.completion_tokens == 10
    for body, match in (({"n": 3, "best_of": 2}, "at least n"),
                        ({"best_of": 3, "stream": True}, "cannot be streamed")):
        resp = httpx.post(server.v1 + "/completions", timeout=30,
                          json={"prompt": "x", "max_tokens": 1, **body})
        assert resp.status_code == 400 and match in resp.json()["error"]["message"]
        assert resp.json()["error"]["param"] == "best_of"


def test_min_tokens_and_include_stop_str_in_output_over_http(client, server):
    """Dropping either field changes the answer: min_tokens keeps a stop string inside the
    first min_tokens tokens from stopping; include_stop_str_in_output keeps it in the text."""
    kw = dict(model=server.model, prompt="Once upon a time", max_tokens=10, temperature=0)
    base = client.completions.create(logprobs=0, extra_body={"ignore_eos": True}, **kw)
    toks = base.choices[0].logprobs.tokens
    text = base.choices[0].text
    first_two = "".join(toks[:2])
    stop = next(first_two[j:j + 2] for j in range(len(first_two) - 2, -1, -1)
                if first_two[j:j + 2].strip() and len(first_two[j:j + 2]) == 2
                and first_two[j:j + 2] not in toks[0])
    cut = text.find(stop)
    body = {"ignore_eos": True}
    plain = client.completions.create(stop=[stop], extra_body=body, **kw).choices[0]
    assert plain.text == text[:cut] and plain.finish_reason == "stop"
    kept = client.completions.create(stop=[stop], extra_body={
        **body, "include_stop_str_in_output": True}, **kw).choices[0]
    assert kept.text == text[:cut + len(stop)] and kept.stop_reason == stop
    held = client.completions.create(stop=[stop], extra_body={**body, "min_tokens": 4},
                                     **kw).choices[0]
    assert held.text.startswith("".join(toks[:4])), (held.text, toks)


def test_a_reasoning_item_an_empty_tokenize_prompt_and_ping(client, server):
    """A previous response's reasoning item sent back is accepted (the templates render no
    past reasoning); /tokenize refuses the empty prompt completions refuses; /ping says its
    (empty) body is text."""
    r = client.responses.create(model=server.model, max_output_tokens=2, input=[
        {"type": "reasoning", "id": "rs_1", "summary": [
            {"type": "summary_text", "text": "thinking"}]},
        {"role": "user", "content": "Hi"}])
    assert r.status == "completed" or r.output, r
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.model, max_output_tokens=2, input=[
            {"type": "reasoning", "id": "rs_1", "summary": []}])
    assert "reasoning" in e.value.body["message"]
    bad = httpx.post(server.base_url + "/tokenize", json={"prompt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt="", max_tokens=1)
    ping = httpx.get(server.base_url + "/ping")
    assert ping.status_code == 200 and ping.headers["content-type"].startswith("text/plain")

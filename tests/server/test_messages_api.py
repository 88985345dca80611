"""Anthropic's Messages API (issue 33) with the official `anthropic` SDK, unmodified, against
a real server on the tiny random llama: a plain message (equal to the chat completion it
is), a stream (the SDK's accumulator gives the same message), stop sequences, a tool round
trip (tool_use, then tool_result, rendered through the template), count_tokens, and errors
in Anthropic's shape, with the key in `x-api-key` or as Bearer."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

anthropic = pytest.importorskip("anthropic")

from fixtures.tool_templates import QWEN_TEMPLATE  # noqa: E402
from iterserve.server.serving_config import ServingConfig  # noqa: E402
from iterserve.server.serving_tools import ToolServerConfig  # noqa: E402

ADD = {"name": "add", "description": "Add two integers", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                     "b": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["a", "b"]}}
WEATHER = {"name": "get_weather", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"]}}
USER = [{"role": "user", "content": "What is 2 + 3?"}]
GREEDY = {"temperature": 0}          # the SDK types no sampling fields any more: extra_body


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server(max_model_len=1024, num_kv_blocks=256, serving_config=ServingConfig(
        chat_template=QWEN_TEMPLATE,
        tools=ToolServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")))


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.base_url, api_key="unused", max_retries=0,
                               timeout=120)


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=120)


def test_a_plain_message_is_the_chat_completion_it_maps_to(client, oai, srv):
    m = client.messages.create(model=srv.model, max_tokens=12, system="Be brief.",
                               messages=[{"role": "user", "content": "Hi"}],
                               extra_body=GREEDY)
    chat = oai.chat.completions.create(
        model=srv.model, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == srv.model
    (block,) = m.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat.choices[0].finish_reason]
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == \
        chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens
    # system as blocks (cache_control is a no-op) renders the same prompt
    same = client.messages.create(
        model=srv.model, max_tokens=12, messages=[{"role": "user", "content": "Hi"}],
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        extra_body=GREEDY)
    assert same.content[0].text == block.text


def test_sampling_fields_reach_the_sampler(client, srv):
    kw = dict(model=srv.model, max_tokens=16, messages=[{"role": "user", "content": "Hi"}])
    greedy = client.messages.create(**kw, extra_body=GREEDY).content[0].text
    top1 = client.messages.create(**kw, extra_body={"temperature": 1.0, "top_k": 1})
    assert top1.content[0].text == greedy                 # top_k 1 is greedy at any heat
    texts = {client.messages.create(**kw, extra_body={"temperature": 1.0, "top_p": 1.0})
             .content[0].text for _ in range(3)}
    assert texts != {greedy}                              # sampling does sample


def test_stop_sequences(client, srv):
    kw = dict(model=srv.model, messages=USER, extra_body=GREEDY)
    text = client.messages.create(max_tokens=24, **kw).content[0].text
    stop = text[6:9]
    assert len(stop) == 3 and text.index(stop) == 6, text
    m = client.messages.create(max_tokens=24, stop_sequences=[stop], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:6]


def test_a_stream_has_anthropics_events_and_accumulates_to_the_message(client, srv):
    kw = dict(model=srv.model, max_tokens=12, messages=USER, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == \
        (whole.stop_reason, whole.usage.output_tokens)
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events[1] == "content_block_start" and events[-3] == "content_block_stop"
    assert "text" in events                   # the SDK's own event for each text delta
    # on the wire: event names match the data's type, a ping, no [DONE]
    r = httpx.post(srv.base_url + "/v1/messages", timeout=60,
                   json={"model": srv.model, "max_tokens": 4, "stream": True, "messages": USER})
    frames = [f for f in r.text.split("\n\n") if f.strip()]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert all(json.loads(f.split("\n")[1].removeprefix("data: "))["type"] == n
               for f, n in zip(frames, names))
    assert names[:2] == ["message_start", "ping"] and "[DONE]" not in r.text


def test_tool_round_trip(client, srv):
    """tool_use forced by name, the tool run, its tool_result sent back: the next turn's
    prompt has the call and the result, as the template writes them."""
    tools = [ADD, WEATHER]
    m = client.messages.create(model=srv.model, max_tokens=100, messages=USER, tools=tools,
                               tool_choice={"type": "tool", "name": "add"}, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "add" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, ADD["input_schema"])
    assert set(use.input) == {"a", "b"}
    # streamed, the SDK accumulates the same call from input_json_delta events
    with client.messages.stream(model=srv.model, max_tokens=100, messages=USER, tools=tools,
                                tool_choice={"type": "tool", "name": "add"},
                                extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    (s_use,) = [b for b in streamed.content if b.type == "tool_use"]
    assert (s_use.name, s_use.input) == (use.name, use.input)
    assert "input_json" in kinds and streamed.stop_reason == "tool_use"
    # the round trip
    result = str(use.input["a"] + use.input["b"])
    convo = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                      for b in m.content]},
                    {"role": "user", "content": [{"type": "tool_result",
                                                  "tool_use_id": use.id, "content": result}]}]
    nxt = client.messages.create(model=srv.model, max_tokens=6, messages=convo, tools=tools,
                                 tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [b.type for b in nxt.content] == ["text"]
    chat = [USER[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function",
         "function": {"name": "add", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": result}]
    tok = httpx.post(srv.base_url + "/tokenize", timeout=30, json={
        "messages": chat, "tools": [{"type": "function", "function": {
            "name": t["name"], **({"description": t["description"]} if "description" in t
                                  else {}), "parameters": t["input_schema"]}} for t in tools]
    }).json()
    assert nxt.usage.input_tokens + (nxt.usage.cache_read_input_tokens or 0) == tok["count"]
    text = srv.engine.tokenizer.decode(tok["tokens"], skip_special_tokens=False)
    assert f'"name": "add", "arguments": {json.dumps(use.input)}' in text
    assert f"<tool_response>\n{result}\n</tool_response>" in text
    counted = client.messages.count_tokens(model=srv.model, messages=convo, tools=tools)
    assert counted.input_tokens == tok["count"]


def test_any_and_disable_parallel_tool_use(client, srv):
    for seed_temp in (0.0, 1.0):
        m = client.messages.create(
            model=srv.model, max_tokens=200, messages=USER, tools=[ADD, WEATHER],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            extra_body={"temperature": seed_temp})
        uses = [b for b in m.content if b.type == "tool_use"]
        assert len(uses) == 1 and m.stop_reason == "tool_use", m
        schema = {"add": ADD, "get_weather": WEATHER}[uses[0].name]["input_schema"]
        jsonschema.validate(uses[0].input, schema)


def test_count_tokens_is_the_prompt_a_message_gets(client, srv):
    kw = dict(model=srv.model, messages=USER, system="Be brief.", tools=[ADD])
    n = client.messages.count_tokens(**kw).input_tokens
    m = client.messages.create(max_tokens=1, tool_choice={"type": "none"}, **kw)
    assert n == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    without_tools = client.messages.count_tokens(model=srv.model, messages=USER,
                                                 system="Be brief.").input_tokens
    assert without_tools < n                          # the template showed the tool


def _anthropic_error(e) -> dict:
    body = e.response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


@pytest.mark.parametrize("body, needle", [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": USER, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, "'image'"),
    ({"max_tokens": 4, "messages": USER, "thinking": {"type": "enabled",
                                                      "budget_tokens": 1024}}, "thinking"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"type": "web_search_20250305",
                                                    "name": "web_search"}]}, "server tools"),
    ({"max_tokens": 4, "messages": USER, "tool_choice": {"type": "any"}}, "tools"),
    ({"max_tokens": 4, "messages": USER, "frobnicate": 1}, "frobnicate"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "add", "input": {}}]}]}, "assistant turns"),
    ({"max_tokens": 10**6, "messages": USER}, "maximum context length"),
    ({"max_tokens": 10**6, "messages": USER, "stream": True}, "maximum context length"),
])
def test_bad_requests_are_400s_in_anthropics_shape(srv, body, needle):
    r = httpx.post(srv.base_url + "/v1/messages", timeout=30, json={"model": srv.model, **body})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert needle in err["error"]["message"], err


def test_sdk_errors_and_the_key_check(client, srv, start_server):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=4, messages=USER)
    assert _anthropic_error(e.value)["type"] == "not_found_error"
    # a server with a key: x-api-key (the SDK's api_key) or Bearer (its auth_token)
    keyed = start_server(api_key="sekrit")
    for kw in ({"api_key": "sekrit"}, {"auth_token": "sekrit"}):
        c = anthropic.Anthropic(base_url=keyed.base_url, max_retries=0, timeout=60, **kw)
        assert c.messages.create(model=keyed.model, max_tokens=2, messages=USER).content
        assert c.messages.count_tokens(model=keyed.model, messages=USER).input_tokens > 0
    bad = anthropic.Anthropic(base_url=keyed.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=keyed.model, max_tokens=2, messages=USER)
    assert _anthropic_error(e.value)["type"] == "authentication_error"
    # the OpenAI routes keep OpenAI's shape, and take x-api-key too
    r = httpx.post(keyed.v1 + "/chat/completions", json={"messages": USER, "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(keyed.v1 + "/chat/completions", headers={"x-api-key": "sekrit"},
                   json={"messages": USER, "max_tokens": 1})
    assert r.status_code == 200


def test_auto_tool_choice_follows_the_server_flags(srv, start_server):
    """tool_choice auto (Anthropic's default with tools) is read by the server's parser; a
    server without --enable-auto-tool-choice refuses it as the chat route does."""
    c = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
    m = c.messages.create(model=srv.model, max_tokens=8, messages=USER, tools=[ADD],
                          extra_body=GREEDY)
    assert m.stop_reason in ("end_turn", "max_tokens") and m.content[0].type == "text"
    plain = start_server()
    c = anthropic.Anthropic(base_url=plain.base_url, api_key="x", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=plain.model, max_tokens=4, messages=USER, tools=[ADD])
    assert "--enable-auto-tool-choice" in _anthropic_error(e.value)["message"]


def test_a_claude_code_shaped_request(client, srv):
    """What Claude Code sends: `?beta=true`, beta headers, system blocks with cache_control,
    tools whose schema names its draft, metadata, a stream; a forced call comes back."""
    tool = {"name": "Read", "description": "Read a file", "input_schema": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "properties": {"file_path": {"type": "string", "maxLength": 20}},
        "required": ["file_path"], "additionalProperties": False}}
    body = {"model": srv.model, "max_tokens": 120, "stream": True, "temperature": 1,
            "metadata": {"user_id": "user_abc_account__session_1"},
            "system": [{"type": "text", "text": "You are a CLI.",
                        "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "read a.txt", "cache_control": {"type": "ephemeral"}}]}],
            "tools": [tool], "tool_choice": {"type": "any"}}
    r = httpx.post(srv.base_url + "/v1/messages?beta=true", json=body, timeout=60, headers={
        "anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219",
        "x-api-key": "unused"})
    assert r.status_code == 200, r.text
    starts = [json.loads(f.split("\ndata: ")[1]) for f in r.text.split("\n\n")
              if f.startswith("event: content_block_start")]
    assert starts and starts[0]["content_block"]["name"] == "Read"
    assert "event: message_stop" in r.text


def test_a_stream_the_client_leaves_is_aborted(srv):
    """Closing a stream mid-way aborts the request: it ends as "abort" with a few tokens of
    its 900, nothing is left running and every KV block is free again."""
    import time

    def stats():
        return httpx.get(srv.v1 + "/engine/stats", timeout=30).json()

    free = stats()["num_free_blocks"]
    body = {"model": srv.model, "max_tokens": 900, "stream": True, "messages": USER}
    with httpx.stream("POST", srv.base_url + "/v1/messages", json=body, timeout=60) as r:
        rid = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("event: content_block_delta"):
                break                                  # leave after the first token
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        trace = httpx.get(f"{srv.v1}/requests/{rid}/trace", timeout=30)
        if trace.status_code == 200 and trace.json().get("finish_reason"):
            break
        time.sleep(0.1)
    assert trace.json()["finish_reason"] == "abort", trace.json()
    assert trace.json()["output_tokens"] < 900
    while stats()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    s = stats()
    assert (s["num_running"], s["num_free_blocks"]) == (0, free), s

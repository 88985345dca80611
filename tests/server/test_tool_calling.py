"""Tool calling over HTTP with the official `openai` client: tools in the chat
template, tool_choice none / auto / required / named, parallel_tool_calls, streamed deltas
that the client's own accumulator reassembles into the non-streamed call, an agent loop
(call -> tool result -> next turn), and 400s naming the field for bad definitions.

The model is the tiny random-weight llama: "required" and named choices are forced by the
grammar, so its calls are valid; "auto" is shown parsing an output forced by a regex (a
random model never writes a call by itself)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from fixtures.tool_templates import QWEN_TEMPLATE
from iterserve.server.serving_config import ServingConfig
from iterserve.server.serving_tools import ToolServerConfig

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object",
                   "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                  "b": {"type": "integer", "minimum": -99, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is 2 + 3, and the weather in Oslo?"}]


@pytest.fixture(scope="module")
def tool_server(start_server):
    return start_server(max_model_len=1024, num_kv_blocks=256, serving_config=ServingConfig(
        chat_template=QWEN_TEMPLATE,
        tools=ToolServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")))


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.v1, api_key="x", max_retries=0, timeout=120)


def _check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_"), call
    assert call.function.name in SCHEMAS, call
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_required_gives_one_valid_call(client, tool_server):
    r = client.chat.completions.create(
        model=tool_server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=100, temperature=1.0, seed=1)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    _check_call(call)


def test_required_with_parallel_calls_gives_valid_calls(client, tool_server):
    r = client.chat.completions.create(
        model=tool_server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        max_tokens=120, temperature=1.0, seed=3)
    choice = r.choices[0]
    calls = choice.message.tool_calls
    assert calls, choice
    # max_tokens may cut the list: the cut call is left out, every call returned is whole
    assert choice.finish_reason in ("length", "tool_calls"), choice
    for call in calls:
        _check_call(call)
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


@pytest.fixture(scope="module")
def roomy(start_server):
    """The model's own template (no tools section), so a long list of calls fits in the
    tiny model's 1024 positions (its tokenizer spends ~70 tokens on one call)."""
    return start_server(max_model_len=1024, num_kv_blocks=256)


@pytest.fixture(scope="module")
def roomy_client(roomy) -> openai.OpenAI:
    return openai.OpenAI(base_url=roomy.v1, api_key="x", max_retries=0, timeout=120)


def test_a_call_cut_by_max_tokens_is_not_returned(roomy_client, roomy):
    """The second call cannot fit: the reply is the first alone, parseable, with "length"."""
    client = roomy_client
    for seed in range(10):                  # the first seed whose reply has several calls
        kw = dict(model=roomy.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  temperature=1.0, seed=seed)
        whole = client.chat.completions.create(max_tokens=900, **kw).choices[0]
        assert whole.finish_reason == "tool_calls", whole
        if len(whole.message.tool_calls) >= 2:
            break
    assert len(whole.message.tool_calls) >= 2, whole
    first_tokens = len(roomy.engine.tokenizer.encode(
        _hermes_text(whole.message.tool_calls[:1]) + "\n<tool_call>\n{",
        add_special_tokens=False))
    cut = client.chat.completions.create(max_tokens=first_tokens + 3, **kw).choices[0]
    assert cut.finish_reason == "length"
    assert cut.message.content is None
    assert [(c.function.name, c.function.arguments) for c in cut.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls[:1]]
    # cut inside the first call: no call, no half a call as text
    cut = client.chat.completions.create(max_tokens=8, **kw).choices[0]
    assert cut.finish_reason == "length"
    assert cut.message.tool_calls is None and not cut.message.content


def _hermes_text(calls) -> str:
    return "\n".join(f'<tool_call>\n{{"name": "{c.function.name}", "arguments": '
                     f'{c.function.arguments}}}\n</tool_call>' for c in calls)


def test_required_ends_its_call_list(roomy_client, roomy):
    """The grammar closes the list: with room to spare, a model that would go on adding
    calls stops after at most MAX_PARALLEL_CALLS, and every call is whole."""
    from iterserve.tools.choice import MAX_PARALLEL_CALLS
    for seed in (3, 11, 12):
        r = roomy_client.chat.completions.create(
            model=roomy.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
            max_tokens=900, temperature=1.0, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert 1 <= len(choice.message.tool_calls) <= MAX_PARALLEL_CALLS
        for call in choice.message.tool_calls:
            _check_call(call)


OPEN_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
        "required": ["city"]}}}


def test_forced_calls_invent_no_keys(client, tool_server):
    """No `additionalProperties` in the schema: still no key it does not name (as vLLM's
    grammar backends); `strict: true` makes every named key required (OpenAI's strict)."""
    kw = dict(model=tool_server.model, messages=MESSAGES, max_tokens=150, temperature=1.0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    seen = set()
    for seed in range(6):
        (call,) = client.chat.completions.create(tools=[OPEN_WEATHER], seed=seed,
                                                 **kw).choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert set(args) <= {"city", "days"} and "city" in args, args
        seen |= set(args)
    strict = {"type": "function", "function": {**OPEN_WEATHER["function"], "strict": True}}
    for seed in range(3):
        (call,) = client.chat.completions.create(tools=[strict], seed=seed,
                                                 **kw).choices[0].message.tool_calls
        assert set(json.loads(call.function.arguments)) == {"city", "days"}


def test_streamed_calls_send_no_empty_deltas(client, tool_server):
    """While the model writes the `<tool_call>` tag nothing is certain, so nothing is sent;
    the logprobs of those tokens arrive with the next chunk (none is lost)."""
    kw = dict(model=tool_server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
              max_tokens=120, temperature=1.0, seed=3, stream=True, logprobs=True,
              stream_options={"include_usage": True})
    chunks = list(client.chat.completions.create(**kw))
    choice_chunks = [c for c in chunks if c.choices]
    assert choice_chunks[0].choices[0].delta.role == "assistant"
    for c in choice_chunks[1:-1]:
        d = c.choices[0].delta
        assert c.choices[0].finish_reason is None
        assert d.content or d.tool_calls, c            # every chunk says something
    assert choice_chunks[-1].choices[0].finish_reason in ("tool_calls", "length")
    lps = [t for c in choice_chunks if c.choices[0].logprobs
           for t in c.choices[0].logprobs.content or []]
    assert len(lps) == chunks[-1].usage.completion_tokens
    # fewer chunks than tokens: the tag's tokens had none of their own
    assert len(choice_chunks) - 2 < chunks[-1].usage.completion_tokens


def test_named_tool_choice_calls_that_function(client, tool_server):
    for seed in (0, 1):
        r = client.chat.completions.create(
            model=tool_server.model, messages=MESSAGES, tools=TOOLS, max_tokens=100,
            tool_choice={"type": "function", "function": {"name": "add"}}, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice       # OpenAI: a named call "stop"s
        (call,) = choice.message.tool_calls
        assert call.function.name == "add"
        _check_call(call)


def test_streamed_deltas_reassemble_to_the_non_streamed_call(client, tool_server):
    kw = dict(model=tool_server.model, messages=MESSAGES, tools=TOOLS, max_tokens=100,
              temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    # the official client's own accumulator
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    got = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in got] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert got[0].id.startswith("call_")
    # and the raw deltas have OpenAI's shape: index, id, type and name first, then fragments
    pieces = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                pieces.append(tc)
            last_finish = c.finish_reason
    assert last_finish == "stop"
    first, rest = pieces[0], pieces[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert rest and all(p.id is None and p.function.name is None for p in rest)
    assert "".join((p.function.arguments or "") for p in pieces) == whole[0].function.arguments


def test_streamed_required_finishes_with_tool_calls(client, tool_server):
    chunks = list(client.chat.completions.create(
        model=tool_server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=100, seed=5, stream=True))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls" and finishes.count("tool_calls") == 1
    args = "".join(tc.function.arguments or "" for c in chunks for tc in
                   (c.choices[0].delta.tool_calls or []))
    names = [tc.function.name for c in chunks for tc in (c.choices[0].delta.tool_calls or [])
             if tc.function.name]
    assert len(names) == 1
    jsonschema.validate(json.loads(args), SCHEMAS[names[0]])


def test_tool_choice_none_gives_text_but_the_template_saw_the_tools(client, tool_server):
    with_tools = client.chat.completions.create(
        model=tool_server.model, messages=MESSAGES, tools=TOOLS, tool_choice="none",
        max_tokens=5, temperature=0)
    choice = with_tools.choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    plain = client.chat.completions.create(model=tool_server.model, messages=MESSAGES,
                                           max_tokens=5, temperature=0)
    tools_json = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in TOOLS)
    tok = tool_server.engine.tokenizer
    # the prompt grew by exactly the tools section of the template
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + len(
        tok.encode(tools_json, add_special_tokens=False)) // 2


def _forced_call_regex(prefix: str, call: str) -> str:
    def esc(text: str) -> str:
        return "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else ch for ch in text)
    return esc(prefix) + "\n<tool_call>\n" + esc(call) + "\n</tool_call>"


AUTO_CALL = '{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}'


def test_auto_parses_what_the_model_writes(client, tool_server):
    """The parser path of "auto": the (random) model's output is forced by a regex to be
    content followed by a hermes call."""
    regex = _forced_call_regex("Let me check.", AUTO_CALL)
    kw = dict(model=tool_server.model, messages=MESSAGES, tools=TOOLS, max_tokens=120,
              extra_body={"guided_regex": regex})
    r = client.chat.completions.create(**kw)               # tool_choice defaults to "auto"
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome", "days": 2}
    with client.chat.completions.stream(tool_choice="auto", **kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert final.message.content == "Let me check."
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]


def test_auto_without_a_call_is_plain_content(client, tool_server):
    r = client.chat.completions.create(model=tool_server.model, messages=MESSAGES, tools=TOOLS,
                                       tool_choice="auto", max_tokens=8, temperature=0)
    plain = client.chat.completions.create(model=tool_server.model, messages=MESSAGES,
                                           tools=TOOLS, tool_choice="none", max_tokens=8,
                                           temperature=0)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.choices[0].finish_reason == plain.choices[0].finish_reason


def test_parallel_tool_calls_false_keeps_the_first_auto_call(client, tool_server):
    two = AUTO_CALL + "\n</tool_call>\n<tool_call>\n" + AUTO_CALL.replace("Rome", "Oslo")
    r = client.chat.completions.create(
        model=tool_server.model, messages=MESSAGES, tools=TOOLS, max_tokens=160,
        extra_body={"guided_regex": _forced_call_regex("", two).lstrip("\n")})
    assert len(r.choices[0].message.tool_calls) == 2
    r = client.chat.completions.create(
        model=tool_server.model, messages=MESSAGES, tools=TOOLS, max_tokens=160,
        parallel_tool_calls=False,
        extra_body={"guided_regex": _forced_call_regex("", two).lstrip("\n")})
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments)["city"] == "Rome"


def test_agent_loop_call_result_next_turn(client, tool_server):
    messages = list(MESSAGES)
    r = client.chat.completions.create(
        model=tool_server.model, messages=messages, tools=TOOLS, max_tokens=100, seed=2,
        tool_choice={"type": "function", "function": {"name": "add"}})
    msg = r.choices[0].message
    (call,) = msg.tool_calls
    args = _check_call(call)
    result = str(args["a"] + args["b"])                     # run the tool
    messages.append(msg.model_dump(exclude_none=True))       # as agent SDKs send it back
    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = client.chat.completions.create(model=tool_server.model, messages=messages,
                                           tools=TOOLS, tool_choice="none", max_tokens=6,
                                           temperature=0)
    assert isinstance(final.choices[0].message.content, str)
    assert final.choices[0].message.tool_calls is None
    # the server rendered the call and its result into the prompt the model saw
    tok = httpx.post(tool_server.base_url + "/tokenize", timeout=30,
                     json={"messages": messages, "tools": TOOLS}).json()
    assert tok["count"] == final.usage.prompt_tokens
    text = tool_server.engine.tokenizer.decode(tok["tokens"], skip_special_tokens=False)
    assert f'<tool_call>\n{{"name": "add", "arguments": {json.dumps(args)}}}\n</tool_call>' \
        in text                                             # arguments as an object
    assert f"<tool_response>\n{result}\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_auto_needs_the_server_flags(server):
    c = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    for extra in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS,
                                      max_tokens=2, **extra)
        assert e.value.body["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in e.value.body["message"]
    # forced choices need no flags (the format defaults to hermes)
    r = c.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS,
                                  max_tokens=100, tool_choice="required",
                                  parallel_tool_calls=False)
    _check_call(r.choices[0].message.tool_calls[0])


BAD = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]},
     "tools.0.function.colour"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "frobnicate"}}}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "tool", "content": "42"}]}, "messages.1"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[p for _, p in BAD])
def test_bad_tool_requests_are_400_naming_the_field(tool_server, extra, param):
    body = {"messages": MESSAGES, "max_tokens": 2, **extra}
    r = httpx.post(tool_server.v1 + "/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# --- /v1/responses: the Responses API over the same chat path --------------------------------

RESP_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_responses_text_input_and_instructions(client, tool_server):
    kw = dict(max_tokens=4, temperature=0)
    chat = client.chat.completions.create(
        model=tool_server.model, messages=[{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Hi"}], **kw)
    r = client.responses.create(model=tool_server.model, input="Hi", instructions="Be brief.",
                                max_output_tokens=4, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert (r.status, r.incomplete_details and r.incomplete_details.reason) in (
        ("incomplete", "max_output_tokens"), ("completed", None))
    # streamed: the official client's accumulator gives the same text
    with client.responses.stream(model=tool_server.model, input="Hi", instructions="Be brief.",
                                 max_output_tokens=4, temperature=0) as stream:
        types = [ev.type for ev in stream]
        final = stream.get_final_response() if r.status == "completed" else None
    assert types[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in types
    assert types[-1] == ("response.completed" if r.status == "completed"
                         else "response.incomplete")
    if final is not None:
        assert final.output_text == r.output_text


def test_responses_function_call_and_agent_loop(client, tool_server):
    kw = dict(model=tool_server.model, tools=RESP_TOOLS, temperature=0,
              max_output_tokens=100, tool_choice={"type": "function", "name": "add"})
    r = client.responses.create(input="What is 2 + 3?", **kw)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and call.name == "add" and call.call_id.startswith("call_")
    args = json.loads(call.arguments)
    jsonschema.validate(args, SCHEMAS["add"])
    with client.responses.stream(input="What is 2 + 3?", **kw) as stream:
        types = [ev.type for ev in stream]
        final = stream.get_final_response()
    (scall,) = [o for o in final.output if o.type == "function_call"]
    assert (scall.name, scall.arguments) == (call.name, call.arguments)
    assert "response.function_call_arguments.delta" in types
    assert types[-1] == "response.completed"
    # the loop: the call and its result go back as input items
    items = [{"role": "user", "content": "What is 2 + 3?"},
             call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id,
              "output": str(args["a"] + args["b"])}]
    nxt = client.responses.create(model=tool_server.model, input=items, tools=RESP_TOOLS,
                                  tool_choice="none", max_output_tokens=4, temperature=0)
    assert isinstance(nxt.output_text, str)
    assert not [o for o in nxt.output if o.type == "function_call"]
    chat_messages = [items[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function",
         "function": {"name": "add", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": items[2]["output"]}]
    tok = httpx.post(tool_server.base_url + "/tokenize", timeout=30,
                     json={"messages": chat_messages, "tools": TOOLS}).json()
    assert nxt.usage.input_tokens == tok["count"]


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),
    ({"tool_choice": "required"}, "input"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
])
def test_responses_bad_requests_are_400_naming_the_field(tool_server, extra, param):
    r = httpx.post(tool_server.v1 + "/responses", timeout=30,
                   json={"input": "Hi", "max_output_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()

"""Tool-call parsers on hand-written model outputs; streams reassemble to extract()."""

import itertools
import json
import random

import pytest

from iterserve.tools import get_tool_parser, make_tool_call_id, TOOL_PARSERS


def counter_ids():
    c = itertools.count()
    return lambda: f"call_{next(c):024d}"


def reassemble(deltas):
    """What an OpenAI client accumulates from the deltas: content, and per index the id,
    name and concatenated arguments."""
    content, calls = "", {}
    for d in deltas:
        if d.content is not None:
            content += d.content
        for t in d.tool_calls:
            c = calls.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
            if t.id is not None:
                assert c["id"] is None, "id sent twice"
                c["id"] = t.id
            if t.name is not None:
                assert c["name"] is None, "name sent twice"
                c["name"] = t.name
            if t.arguments:
                assert c["name"] is not None, "arguments before the name"
                c["arguments"] += t.arguments
    return content or None, [calls[i] for i in sorted(calls)]


def stream(parser_name, text, chunks, cut=False):
    p = get_tool_parser(parser_name, id_factory=counter_ids())
    s = p.stream()
    deltas = []
    for c in chunks:
        deltas += s.feed(c)
    deltas += s.finish(cut)
    return reassemble(deltas), s


def splits(text, seed):
    """Char by char, and random chunkings."""
    yield list(text)
    if len(text) < 2:
        return
    rng = random.Random(seed)
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def check_stream_equals_extract(parser_name, text, cut=False):
    ex = get_tool_parser(parser_name, id_factory=counter_ids()).extract(text, cut)
    want = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in ex.tool_calls]
    for chunks in splits(text, len(text)):
        (content, calls), _ = stream(parser_name, text, chunks, cut)
        assert content == ex.content, chunks
        assert calls == want, chunks
    return ex


HERMES = [
    'Let me check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "unit": "c"}}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
    '{"name": "b", "arguments": {"x": [1, {"y": "}"}], "s": "quote \\" <tool_call>"}}\n'
    '</tool_call>',
    'No tools needed, the answer is 42.',
    'Text with a fake <tool_call>oops</tool_call> tag',
    '<tool_call>{"arguments": {"q": 1}, "name": "late_name"}</tool_call> and after',
    '<tool_call>\n{"name": "cut", "arguments": {"text": "half',
    'A < b and <tool_ca',
    '',
]


@pytest.mark.parametrize("text", HERMES)
def test_hermes_stream_equals_extract(text):
    check_stream_equals_extract("hermes", text)


@pytest.mark.parametrize("parser_text", [("hermes", t) for t in HERMES] + [
    ("hermes", "Checking.\n<tool_call>\n{\"na"), ("hermes", "Trailing space "),
    ("llama3_json", '{"na'), ("mistral", "Sure.[TOOL_CALLS][{\"name\": \"f\"")])
def test_a_cut_output_keeps_out_what_was_undecided(parser_text):
    """max_tokens ended the output: a half-written tag or call name is neither content nor
    a call, in a stream as in extract; text that was never in doubt stays as it is."""
    parser_name, text = parser_text
    ex = check_stream_equals_extract(parser_name, text, cut=True)
    whole = get_tool_parser(parser_name).extract(text)
    assert [c.name for c in ex.tool_calls] == [c.name for c in whole.tool_calls]
    kept = {"Checking.\n<tool_call>\n{\"na": "Checking.", "A < b and <tool_ca": "A < b and"}
    if text in kept:
        assert (ex.content, ex.dropped) == (kept[text], 1)
    if text == "Trailing space ":
        assert (ex.content, ex.dropped) == (text, 0)
    if text == '{"na':
        assert (ex.content, ex.dropped) == (None, 1)


def test_hermes_extract():
    p = get_tool_parser("hermes")
    ex = p.extract(HERMES[0])
    assert ex.content == "Let me check the weather."
    (call,) = ex.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "c"}
    assert call.id.startswith("call_") and len(call.id) == 29
    assert call.to_openai()["function"]["name"] == "get_weather"
    ex = p.extract(HERMES[1])
    assert ex.content is None and [c.name for c in ex.tool_calls] == ["a", "b"]
    assert json.loads(ex.tool_calls[1].arguments)["s"] == 'quote " <tool_call>'
    assert ex.tool_calls[0].id != ex.tool_calls[1].id
    assert p.extract(HERMES[2]).content == HERMES[2] and not p.extract(HERMES[2]).tools_called
    assert p.extract(HERMES[3]).content == HERMES[3]
    ex = p.extract(HERMES[4])
    assert ex.tool_calls[0].name == "late_name" and ex.content == "and after"
    assert json.loads(ex.tool_calls[0].arguments) == {"q": 1}
    cut = p.extract(HERMES[5]).tool_calls[0]
    assert cut.name == "cut" and cut.arguments == '{"text": "half'
    assert p.extract(HERMES[6]).content == HERMES[6]


def test_streaming_holds_back_a_partial_tag_and_sends_name_once():
    p = get_tool_parser("hermes", id_factory=counter_ids())
    s = p.stream()
    assert [d.content for d in s.feed("Hi <tool_")] == ["Hi"]   # " <tool_" is held
    assert s.feed("call>\n{\"na") == []
    (d,) = s.feed('me": "f", "arguments": {"a"')
    (t,) = d.tool_calls
    assert (t.index, t.id, t.name, t.arguments) == (0, "call_" + "0" * 24, "f", '{"a"')
    (d,) = s.feed(": 1}}\n</tool_call>")
    assert d.tool_calls[0].arguments == ": 1}" and d.tool_calls[0].name is None
    assert s.finish() == [] and s.tools_called
    assert s.tool_calls[0].arguments == '{"a": 1}'
    assert d.to_openai() == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}


LLAMA = [
    '{"name": "search", "parameters": {"query": "llamas"}}',
    '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {}}',
    'I think {"name": "x"} is not a call here.',
    '{"not_a_call": true}',
    '{"name": "f", "arguments": {"k": "v"}} trailing words',
    '  {"name": "cut", "parameters": {"a": [1, 2',
]


@pytest.mark.parametrize("text", LLAMA)
def test_llama3_json_stream_equals_extract(text):
    check_stream_equals_extract("llama3_json", text)


def test_llama3_json_extract():
    p = get_tool_parser("llama3_json")
    (c,) = p.extract(LLAMA[0]).tool_calls
    assert c.name == "search" and json.loads(c.arguments) == {"query": "llamas"}
    ex = p.extract(LLAMA[1])
    assert ex.content is None and [c.name for c in ex.tool_calls] == ["a", "b"]
    assert p.extract(LLAMA[2]).content == LLAMA[2] and not p.extract(LLAMA[2]).tool_calls
    assert p.extract(LLAMA[3]).content == LLAMA[3] and not p.extract(LLAMA[3]).tool_calls
    ex = p.extract(LLAMA[4])
    assert ex.content == "trailing words" and ex.tool_calls[0].arguments == '{"k": "v"}'


MISTRAL = [
    'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
    '{"name": "get_time", "arguments": {"tz": "CET"}}]',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',
    'Nothing to call [TOOL_CA',
    '[TOOL_CALLS][{"name": "f", "arguments": "{\\"a\\": 1}"}]',
]


@pytest.mark.parametrize("text", MISTRAL)
def test_mistral_stream_equals_extract(text):
    check_stream_equals_extract("mistral", text)


def test_mistral_extract():
    p = get_tool_parser("mistral")
    assert p.needs_special_tokens
    ex = p.extract(MISTRAL[0])
    assert ex.content == "Sure." and [c.name for c in ex.tool_calls] == ["get_weather", "get_time"]
    ex = p.extract(MISTRAL[1])
    assert [(c.name, json.loads(c.arguments)) for c in ex.tool_calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert p.extract(MISTRAL[2]).content == MISTRAL[2]
    assert json.loads(p.extract(MISTRAL[3]).tool_calls[0].arguments) == {"a": 1}


def test_registry_and_ids():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "openai"}
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("pythonic")
    ids = {make_tool_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("call_") and i[5:].isalnum() for i in ids)


def test_openai_client_accumulates_the_stream():
    """The official client's own stream accumulator rebuilds the message from our deltas."""
    openai = pytest.importorskip("openai")
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    text = HERMES[1]
    p = get_tool_parser("hermes")
    s = p.stream()
    state = ChatCompletionStreamState()
    deltas = [d for c in splits(text, 1).__next__() for d in s.feed(c)] + s.finish()
    for i, d in enumerate(deltas + [None]):
        choice = {"index": 0, "delta": d.to_openai() if d else {},
                  "finish_reason": None if d else "tool_calls"}
        if i == 0:
            choice["delta"]["role"] = "assistant"
        state.handle_chunk(ChatCompletionChunk.model_validate(
            {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [choice]}))
    msg = state.get_final_completion().choices[0].message
    ex = p.extract(text)
    assert [(t.function.name, t.function.arguments) for t in msg.tool_calls] == \
        [(c.name, c.arguments) for c in ex.tool_calls]
    assert [t.id for t in msg.tool_calls] == [t.id for t in s.tool_calls]

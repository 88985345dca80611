"""The API's rule, field by field: each sampling field sent through the official openai client
changes the answer the way OpenAI / vLLM define it, so a server that dropped the field would
fail here (the fields other files already test this way are not repeated: logit_bias,
allowed_token_ids, structured outputs' json/regex/choice, min_tokens, stop strings, echo,
prompt_logprobs, best_of, tools, priority, logprobs, n, seed)."""

from __future__ import annotations

import re

import openai
import pytest

PROMPT = "Once upon a time in a land far away"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60)


def ids(client, server, **kw) -> list[int]:
    """The generated token ids (return_tokens_as_token_ids names them exactly)."""
    r = client.completions.create(model=server.model, prompt=kw.pop("prompt", PROMPT),
                                  logprobs=0, **kw)
    extra = kw.get("extra_body") or {}
    assert r.usage.completion_tokens >= 1, extra
    return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]


def body(**extra):
    return {"extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True, **extra}}


@pytest.fixture(scope="module")
def greedy(client, server) -> list[int]:
    return ids(client, server, max_tokens=24, temperature=0, **body())


@pytest.fixture(scope="module")
def sampled(client, server, greedy) -> list[int]:
    out = ids(client, server, max_tokens=24, temperature=1.5, seed=11, **body())
    assert out != greedy            # so the truncation tests below can tell
    return out


@pytest.mark.parametrize("field, value", [("top_k", 1), ("top_p", 1e-6), ("min_p", 1.0)])
def test_truncation_to_the_best_token_is_greedy(client, server, greedy, sampled, field, value):
    kw = body() if field == "top_k" else {}
    if field == "top_k":
        kw["extra_body"]["top_k"] = value
        got = ids(client, server, max_tokens=24, temperature=1.5, seed=11, **kw)
    elif field == "top_p":
        got = ids(client, server, max_tokens=24, temperature=1.5, seed=11, top_p=value, **body())
    else:
        kw = body(min_p=value)
        got = ids(client, server, max_tokens=24, temperature=1.5, seed=11, **kw)
    assert got == greedy


def test_repetition_penalties_change_a_repetitive_greedy_output(client, server, greedy):
    assert len(set(greedy)) < len(greedy)       # the random model repeats itself
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        got = ids(client, server, max_tokens=24, temperature=0, **kw, **body())
        assert got != greedy, kw
    got = ids(client, server, max_tokens=24, temperature=0, **body(repetition_penalty=100.0))
    assert got != greedy
    prompt_ids = server.engine.tokenizer.encode(PROMPT)
    assert not set(got[:3]) & set(prompt_ids)    # seen (prompt) tokens are held back


def test_stop_token_ids_end_the_output(client, server, greedy):
    stop = greedy[2]
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24,
                                  temperature=0, **body(stop_token_ids=[stop]))
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert r.usage.completion_tokens == greedy.index(stop) + 1


def test_bad_words_are_never_generated(client, server, greedy):
    tok = server.engine.tokenizer
    word = tok.decode([greedy[0]]).strip() or tok.decode(greedy[:2]).strip()
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24,
                                  temperature=0, extra_body={"ignore_eos": True,
                                                             "bad_words": [word]})
    assert r.choices[0].text != tok.decode(greedy)
    assert word not in r.choices[0].text.split()


def test_max_completion_tokens_bounds_a_chat_reply(client, server):
    r = client.chat.completions.create(model=server.model, max_completion_tokens=3,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_guided_json_and_grammar_and_structured_grammar(client, server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    import json
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=60,
                                  temperature=0, extra_body={"guided_json": schema})
    assert set(json.loads(r.choices[0].text)) == {"n"}
    grammar = 'root ::= "ab" [0-9] [0-9]'
    for extra in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=10,
                                      temperature=0, extra_body=extra)
        assert re.fullmatch(r"ab[0-9]{2}", r.choices[0].text), (extra, r.choices[0].text)


def test_skip_special_tokens_false_shows_them(client, server):
    eos = server.engine.tokenizer.eos_token_id
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=2, temperature=0)
    shown = client.completions.create(**kw, extra_body={
        "allowed_token_ids": [eos], "ignore_eos": True, "skip_special_tokens": False})
    hidden = client.completions.create(**kw, extra_body={
        "allowed_token_ids": [eos], "ignore_eos": True})
    assert shown.choices[0].text == server.engine.tokenizer.decode(
        [eos, eos], skip_special_tokens=False) and hidden.choices[0].text == ""

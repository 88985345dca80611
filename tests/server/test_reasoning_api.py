"""`--reasoning-parser qwen3` through the official openai client over real HTTP: the thinking
arrives as `message.reasoning_content` / `delta.reasoning_content`, the answer as content;
`chat_template_kwargs: {"enable_thinking": false}` reaches the template; structured outputs
and tool calls apply to the answer, after the thinking.

The model is a tiny random Qwen3 whose tokenizer has <think> / </think> as added tokens (as
Qwen3's has) and a Qwen3-style template. A random model does not decide to stop thinking, so
the tests that need the thinking to end push `</think>` with `logit_bias`: the grammar still
decides what may come after it."""

from __future__ import annotations

import json

import openai
import pytest

from fixtures.tiny_models import make_tiny_model_dir
from fixtures.tiny_tokenizer import write_tiny_tokenizer
from iterserve.server.serving_config import ServingConfig
from iterserve.server.serving_tools import ToolServerConfig

QWEN3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"]}}}]
MSGS = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    d = make_tiny_model_dir(tmp_path_factory.mktemp("qwen3-think"), "qwen3")
    write_tiny_tokenizer(d, 512, added_tokens=("<think>", "</think>"),
                         chat_template=QWEN3_TEMPLATE)
    return d


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server(max_model_len=512, serving_config=ServingConfig(
        reasoning_parser="qwen3",
        tools=ToolServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")))


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.v1, api_key="x")


def _ids(srv, text):
    import httpx
    r = httpx.post(srv.base_url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
    return r.json()["tokens"]


def test_enable_thinking_false_reaches_the_template(client, srv):
    on = client.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=1)
    off = client.chat.completions.create(model=srv.model, messages=MSGS, max_tokens=1,
                                         extra_body={"chat_template_kwargs":
                                                     {"enable_thinking": False}})
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + len(_ids(srv, "<think>\n\n</think>\n\n"))


def test_thinking_then_answer_streamed_and_not(client, srv):
    think = _ids(srv, "<think>")[0]
    kw = dict(model=srv.model, messages=MSGS, max_tokens=12, temperature=0, seed=1,
              logit_bias={str(think): 100})                 # the model opens its thinking
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.content is None and msg.model_extra["reasoning_content"]   # never closed it
    chunks = list(client.chat.completions.create(**kw, stream=True))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                        for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning == msg.model_extra["reasoning_content"] and content == ""
    # bias 100 makes every token <think>: the first opens the thinking, the rest are its text
    assert reasoning == "<think>" * 11 and r.usage.completion_tokens == 12


def test_structured_output_applies_to_the_answer_after_thinking(client, srv):
    think, end = _ids(srv, "<think>")[0], _ids(srv, "</think>")[0]
    r = client.chat.completions.create(
        model=srv.model, messages=MSGS, max_tokens=40, temperature=0,
        # think (pushed), a few free tokens, then close it (pushed): the answer is the JSON
        logit_bias={str(think): 100, str(end): 30},
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
        logprobs=True)
    msg = r.choices[0].message
    tokens = [t.token for t in r.choices[0].logprobs.content]
    assert tokens[0] == "<think>" and "</think>" in tokens          # it thought, then answered
    assert json.loads(msg.content)["n"] is not None
    assert "<think>" not in msg.content and "</think>" not in msg.content


def test_thinking_disabled_answers_in_the_schema_directly(client, srv):
    r = client.chat.completions.create(
        model=srv.model, messages=MSGS, max_tokens=40, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})
    msg = r.choices[0].message
    assert isinstance(json.loads(msg.content)["n"], int)
    assert msg.model_extra.get("reasoning_content") is None


def test_a_forced_tool_call_follows_the_thinking(client, srv):
    think, end = _ids(srv, "<think>")[0], _ids(srv, "</think>")[0]
    for stream in (False, True):
        kw = dict(model=srv.model, messages=MSGS, max_tokens=80, temperature=0, tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "add"}},
                  logit_bias={str(think): 100, str(end): 30}, logprobs=True)
        if not stream:
            choice = client.chat.completions.create(**kw).choices[0]
            msg, calls = choice.message, choice.message.tool_calls
            tokens = [t.token for t in choice.logprobs.content]
            args = json.loads(calls[0].function.arguments)
            reasoning = msg.model_extra["reasoning_content"] or ""
        else:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            assert deltas[0].function.name == "add"
            args = json.loads("".join(d.function.arguments or "" for d in deltas))
            reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                                for c in chunks if c.choices)
            tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs
                      for t in c.choices[0].logprobs.content]
        # the model opened and closed its thinking (the grammar let it), then made the call
        assert tokens[0] == "<think>" and "</think>" in tokens
        assert "".join(tokens[1:tokens.index("</think>")]).strip("\n") == reasoning
        assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())

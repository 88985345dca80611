"""gpt-oss with `--reasoning-parser openai_gptoss` through the official openai client over
real HTTP, on a tiny random gpt-oss whose tokenizer has the harmony markers as special tokens
and a harmony chat template: a structured answer comes back as content (the final channel),
the analysis channel as reasoning_content, no markers in either, streamed and not alike."""

from __future__ import annotations

import json

import openai
import pytest

from fixtures.tiny_models import make_tiny_model_dir
from fixtures.tiny_tokenizer import HARMONY_TOKENS, write_tiny_tokenizer
from iterserve.server.serving_config import ServingConfig

HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Hello there, how are you today?"}]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    d = make_tiny_model_dir(tmp_path_factory.mktemp("gpt-oss-harmony"), "gpt_oss")
    write_tiny_tokenizer(d, 512, extra_special_tokens=HARMONY_TOKENS,
                         chat_template=HARMONY_TEMPLATE)
    return d


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server(max_model_len=256,
                        serving_config=ServingConfig(reasoning_parser="openai_gptoss"))


def test_harmony_reasoning_and_a_structured_answer(srv):
    """The answer-only grammar makes the random model write harmony messages: an optional
    analysis message, then the final one whose body is the schema's JSON. A frequency
    penalty stops the random model repeating one token, so its analysis ends (at `<|end|>`)
    within the token budget; the model decides where."""
    client = openai.OpenAI(base_url=srv.v1, api_key="x")
    kw = dict(model=srv.model, messages=CHAT, max_tokens=100, temperature=0,
              frequency_penalty=0.5,
              response_format={"type": "json_schema",
                               "json_schema": {"name": "n", "schema": SCHEMA}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", msg
    assert set(json.loads(msg.content)) == {"n"}
    assert not any(t in msg.content for t in HARMONY_TOKENS)
    reasoning = getattr(msg, "reasoning_content", None)
    assert reasoning and not any(t in reasoning for t in HARMONY_TOKENS)
    content, thinking = [], []
    for c in client.chat.completions.create(**kw, stream=True):
        if c.choices:
            content.append(c.choices[0].delta.content or "")
            thinking.append(getattr(c.choices[0].delta, "reasoning_content", None) or "")
    assert "".join(content) == msg.content
    assert ("".join(thinking) or None) == reasoning

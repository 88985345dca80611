"""The reasoning parsers (deepseek_r1, qwen3, openai_gptoss) and the openai (harmony) tool
parser: finished outputs split into reasoning and content, and every stream, fed in pieces of
any size, reassembles to exactly the finished split."""

from __future__ import annotations

import json

import pytest

from iterserve.reasoning import get_reasoning_parser
from iterserve.tools import get_tool_parser

HARMONY_CALL = ('<|channel|>analysis<|message|>The user wants the weather.<|end|>'
                '<|start|>assistant<|channel|>commentary to=functions.get_weather '
                '<|constrain|>json<|message|>{"city": "Paris", "unit": "c"}<|call|>')
HARMONY_ANSWER = ('<|channel|>analysis<|message|>Think: 2+2.\nIt is 4.<|end|>'
                  '<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>')

CASES = [
    ("deepseek_r1", "\nLet me think.\nOK.\n</think>\n\nThe answer.", "Let me think.\nOK.",
     "The answer."),
    ("deepseek_r1", "<think>\nrepeated tag</think>answer", "repeated tag", "answer"),
    ("deepseek_r1", "thinking cut off by max_tokens", "thinking cut off by max_tokens", None),
    ("qwen3", "<think>\nA plan.\n</think>\n\nHello!", "A plan.", "Hello!"),
    ("qwen3", "Hello, no thinking here.", None, "Hello, no thinking here."),
    ("qwen3", "<think>\nstill thinking", "still thinking", None),
    ("qwen3", "a < b and <think> later", None, "a < b and <think> later"),
    ("openai_gptoss", HARMONY_ANSWER, "Think: 2+2.\nIt is 4.", "The answer is 4."),
    ("openai_gptoss", "plain text, not harmony", None, "plain text, not harmony"),
]


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_extract(name, text, reasoning, content):
    assert get_reasoning_parser(name).extract(text) == (reasoning, content)


def _pieces(text: str, size: int) -> list[str]:
    markers = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>",
               "<|return|>", "<|call|>"]
    out, i = [], 0
    while i < len(text):              # special tokens arrive whole, like tokens do
        m = next((m for m in markers if text.startswith(m, i)), None)
        step = len(m) if m else size
        out.append(text[i:i + step])
        i += step
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_streams_reassemble_to_the_finished_split(name, text, reasoning, content, size):
    st = get_reasoning_parser(name).stream()
    r = c = ""
    for piece in _pieces(text, size):
        dr, dc, _ = st.feed(piece)
        r, c = r + dr, c + dc
    dr, dc, _ = st.finish()
    r, c = r + dr, c + dc
    assert (r or None, c or None) == (reasoning, content)


def test_a_partial_closing_tag_is_held_back_while_streaming():
    st = get_reasoning_parser("deepseek_r1").stream()
    assert st.feed("step one</thi") == ("step one", "", "")
    assert st.feed("nk>\n\nDone") == ("", "Done", "Done")


def test_harmony_tool_call_is_the_answer_and_analysis_the_reasoning():
    rp = get_reasoning_parser("openai_gptoss")
    split = rp.split(HARMONY_CALL, final=True)
    assert split.reasoning == "The user wants the weather." and split.content == ""
    ex = get_tool_parser("openai").extract(split.answer_text)
    assert ex.content is None and len(ex.tool_calls) == 1
    call = ex.tool_calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris",
                                                                         "unit": "c"}
    # the whole output through the tool parser alone: analysis is never content
    ex = get_tool_parser("openai").extract(HARMONY_CALL)
    assert ex.content is None and ex.tool_calls[0].name == "get_weather"


@pytest.mark.parametrize("size", [1, 4, 50])
def test_harmony_tool_call_streams(size):
    st = get_tool_parser("openai").stream()
    for piece in _pieces(HARMONY_CALL, size):
        st.feed(piece)
    st.finish()
    assert len(st.tool_calls) == 1 and st.tool_calls[0].name == "get_weather"
    assert json.loads(st.tool_calls[0].arguments) == {"city": "Paris", "unit": "c"}
    assert st.content is None


def test_harmony_preamble_and_final_are_content_beside_a_call():
    text = ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.f'
            '<|channel|>commentary json<|message|>{}<|call|>')
    ex = get_tool_parser("openai").extract(text)
    assert ex.content == "Checking." and ex.tool_calls[0].name == "f"
    assert ex.tool_calls[0].arguments == "{}"


def test_unknown_reasoning_parser_is_refused_with_the_names():
    with pytest.raises(ValueError, match="deepseek_r1, openai_gptoss, qwen3"):
        get_reasoning_parser("granite")

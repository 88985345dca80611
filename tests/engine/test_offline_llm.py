"""The offline API: LLM(model).generate(prompts, params) and LLM.chat(messages)."""

from __future__ import annotations

import pytest

from iterserve.core.request import SamplingParams
from iterserve.engine.errors import TokenIdOutOfRangeError
from iterserve.engine.llm import LLM


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256)


def test_generate_returns_one_output_per_prompt_in_order(llm, capsys):
    prompts = ["Hello world", "The quick brown fox", [1, 20, 30, 40]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(outs) == 3
    assert outs[2].prompt_token_ids == [1, 20, 30, 40]
    for out in outs:
        co = out.outputs[0]
        assert len(co.token_ids) == 4 and co.finish_reason == "length"
        assert co.metrics.time_to_first_token is not None and co.metrics.e2e_latency > 0
    assert "Processed prompts" in capsys.readouterr().err      # the tqdm bar


def test_same_prompt_alone_and_in_a_batch_gives_the_same_greedy_text(llm):
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = llm.generate("Once upon a time", p, use_tqdm=False)[0].outputs[0].text
    batch = llm.generate([f"noise {i}" for i in range(8)] + ["Once upon a time"], p,
                         use_tqdm=False)
    assert batch[-1].outputs[0].text == alone


def test_chat_applies_the_template(llm):
    msgs = [{"role": "user", "content": "Hello"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                   use_tqdm=False)[0]
    expected = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(msgs),
                                    add_special_tokens=False)
    assert out.prompt_token_ids == expected and len(out.outputs[0].token_ids) == 3


def test_a_bad_prompt_raises_before_anything_runs(llm):
    with pytest.raises(TokenIdOutOfRangeError):
        llm.generate(["fine", [10**7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()

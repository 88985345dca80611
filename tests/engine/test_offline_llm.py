"""The offline API: LLM(model).generate(prompts, params) and LLM.chat(messages)."""

from __future__ import annotations

import pytest

from iterserve.core.request import SamplingParams
from iterserve.engine.llm import LLM
from iterserve.errors import (InvalidRequestError, SamplingParamsError, TokenIdOutOfRangeError,
                              ToolChoiceError)


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


# --- vLLM's prompt shapes, top-level imports, get_tokenizer, new RequestOutput fields --------

GREEDY2 = dict(max_tokens=3, temperature=0, ignore_eos=True)


def test_top_level_imports_are_the_offline_api_and_stay_torch_free():
    import subprocess
    import sys

    code = ("import sys, iterserve\n"
            "assert 'torch' not in sys.modules, 'import iterserve imported torch'\n"
            "from iterserve import LLM, SamplingParams\n"
            "from iterserve.engine.llm import LLM as L2\n"
            "from iterserve.core.request import SamplingParams as S2\n"
            "assert LLM is L2 and SamplingParams is S2\n"
            "assert 'torch' not in sys.modules, 'importing LLM imported torch'\n"
            "try:\n    iterserve.NoSuchThing\nexcept AttributeError as e:\n"
            "    assert 'NoSuchThing' in str(e)\nelse:\n    raise SystemExit('no error')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_prompt_shape_gives_the_same_greedy_output(llm):
    p = SamplingParams(**GREEDY2)
    text = "Hello world"
    ids = llm.get_tokenizer().encode(text)
    assert llm.get_tokenizer() is llm.tokenizer
    shapes = [text, ids, {"prompt": text}, {"prompt_token_ids": ids}]
    each = [llm.generate(s, p, use_tqdm=False) for s in shapes]
    assert all(len(outs) == 1 for outs in each)
    tokens = [outs[0].outputs[0].token_ids for outs in each]
    assert all(t == tokens[0] and len(t) == 3 for t in tokens)
    assert [outs[0].prompt_token_ids for outs in each] == [ids] * 4
    assert each[0][0].prompt == each[2][0].prompt == text
    # A list mixing all four shapes: one output per prompt, in order.
    mixed = llm.generate(shapes, p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == tokens
    assert [o.prompt_token_ids for o in mixed] == [ids] * 4


def test_request_output_has_num_cached_tokens_and_prompt_logprobs(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256, block_size=4,
              enable_prefix_caching=True)
    prompt = "The same long prompt, sent twice, shares its blocks"
    first = llm.generate(prompt, SamplingParams(**GREEDY2), use_tqdm=False)[0]
    second = llm.generate(prompt, SamplingParams(**GREEDY2), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 4
    assert second.num_cached_tokens < len(second.prompt_token_ids)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert first.prompt_logprobs is None


@pytest.mark.parametrize("prompts, match", [
    ([{"prompt_token_ids": [1, "x"]}], r"prompt 0: prompt_token_ids\[1\] is 'x'"),
    ({"prompt_token_ids": "1 2 3"}, "must be a list of integer token ids"),
    ({"prompt": [1, 2]}, "'prompt' must be a string"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "not both"),
    ({"text": "a"}, "unsupported key.*'text'"),
    ({}, "empty dict"),
    (["fine", 3], "mixes token ids"),
    ([[1, 2], [3, None]], r"prompt 1 is a list whose item 1 is None"),
    ([True, False], "prompt 0 is a bool"),
    (42, "prompts is a int"),
    (["fine", 4.5], "prompt 1 is a float"),
])
def test_wrong_prompt_shapes_get_a_message_naming_the_prompt(llm, prompts, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_out_of_vocabulary_token_ids_in_a_dict_name_the_prompt(llm):
    with pytest.raises(TokenIdOutOfRangeError, match=r"^prompt 1: .*outside the vocabulary"):
        llm.generate(["fine", {"prompt_token_ids": [10**7]}], SamplingParams(max_tokens=2),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_n_sequences_come_back_in_the_final_output(llm):
    out = llm.generate({"prompt": "Hello"}, SamplingParams(n=3, max_tokens=4, temperature=1.0,
                                                            seed=1, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [co.index for co in out.outputs] == [0, 1, 2]
    assert all(len(co.token_ids) == 4 for co in out.outputs)
    assert out.metrics.num_output_tokens == 12


def test_empty_prompt_list_returns_nothing(llm):
    assert llm.generate([], SamplingParams(max_tokens=2), use_tqdm=False) == []


def test_best_of_returns_the_n_most_likely_of_best_of_samples(llm):
    """vLLM V0's best_of: sequence i of a seeded request samples with seed + i whatever n
    is, so best_of=4, n=2 must return the two of n=4's sequences with the highest
    cumulative logprob, best first, without logprobs unless asked."""
    kw = dict(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    four = llm.generate("Once upon a time", SamplingParams(n=4, logprobs=0, **kw),
                        use_tqdm=False)[0].outputs
    ranked = sorted(four, key=lambda o: o.cumulative_logprob, reverse=True)
    assert len({tuple(o.token_ids) for o in four}) > 2      # the choice matters
    best = llm.generate("Once upon a time", SamplingParams(n=2, best_of=4, **kw),
                        use_tqdm=False)[0].outputs
    assert [o.index for o in best] == [0, 1]
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked[:2]]
    assert all(o.logprobs is None for o in best)
    with_lp = llm.generate("Once upon a time", SamplingParams(n=1, best_of=4, logprobs=1, **kw),
                           use_tqdm=False)[0].outputs
    assert [o.token_ids for o in with_lp] == [ranked[0].token_ids]
    assert with_lp[0].cumulative_logprob == pytest.approx(ranked[0].cumulative_logprob)
    with pytest.raises(SamplingParamsError, match="best_of"):
        llm.generate("x", SamplingParams(n=3, best_of=2), use_tqdm=False)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1,
                                                             "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"], "additionalProperties": False}}}


def _qwen_template() -> str:
    from server.test_tool_calling import QWEN_TEMPLATE    # tests/ is on sys.path
    return QWEN_TEMPLATE


def test_chat_with_tools_renders_them_and_returns_parsed_calls(tiny_model_dir):
    """vLLM's LLM.chat(messages, tools=...): the template gets the tools; with tool_choice
    "required" / named the call is forced (valid for the schema) and parsed into
    CompletionOutput.tool_calls; the call and its result round-trip into the next turn."""
    import json

    import jsonschema

    llm = LLM(str(tiny_model_dir), num_kv_blocks=256, max_model_len=1024)  # tools: long prompts
    template = _qwen_template()
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    tok = llm.get_tokenizer()
    with_tools = tok.apply_chat_template(msgs, True, chat_template=template, tools=[WEATHER])
    assert "get_weather" in with_tools
    greedy = SamplingParams(temperature=0, max_tokens=200)
    # (one call: greedy, a random model would repeat parallel calls up to max_tokens)
    (out,) = llm.chat(msgs, greedy, use_tqdm=False, chat_template=template,
                      tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    co = out.outputs[0]
    assert co.finish_reason == "stop" and co.tool_calls, co.text
    for call in co.tool_calls:
        fn = {"get_weather": WEATHER, "get_time": TIME}[call.name]["function"]
        jsonschema.validate(json.loads(call.arguments), fn["parameters"])
        assert call.id.startswith("call_")
    (named,) = llm.chat(msgs, greedy, use_tqdm=False, chat_template=template,
                        tools=[WEATHER, TIME], parallel_tool_calls=False,
                        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.outputs[0].finish_reason == "stop", named.outputs[0].text
    (call,) = named.outputs[0].tool_calls
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("UTC", "CET")
    # the call and the tool's result go back in (arguments as JSON text, as OpenAI sends)
    turn2 = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    text = tok.apply_chat_template(
        __import__("iterserve.engine.chat_tools", fromlist=["x"]).template_messages(turn2),
        True, chat_template=template, tools=[WEATHER, TIME])
    assert '"zone": "' in text and "12:00" in text
    (final,) = llm.chat(turn2, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                        chat_template=template, tools=[WEATHER, TIME], tool_choice="none")
    assert final.outputs[0].tool_calls is None and final.outputs[0].token_ids
    # "auto" parses what the model writes: a random model writes no call, so content is text
    (auto,) = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                       chat_template=template, tools=[WEATHER])
    assert auto.outputs[0].tool_calls is None
    assert auto.outputs[0].content == auto.outputs[0].text
    with pytest.raises(InvalidRequestError, match="tool_parser"):
        llm.chat(msgs, tools=[WEATHER], tool_parser="nope", use_tqdm=False)
    with pytest.raises(ToolChoiceError, match="not in tools"):
        llm.chat(msgs, tools=[WEATHER], use_tqdm=False,
                 tool_choice={"type": "function", "function": {"name": "missing"}})


def test_beam_search_says_it_is_not_implemented_and_names_best_of(llm):
    with pytest.raises(NotImplementedError, match="best_of"):
        llm.beam_search(["Hello"], None)

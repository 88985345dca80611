"""Speculative decoding through the offline API on real model files: the tokens, logprobs,
stop strings, structured outputs, n > 1 and aborts are those of speculation off, while
drafts are verified and accepted.

Exactness needs a verified position's logits to equal what a decode step computes for it.
The runner verifies drafts as decode rows, so that holds wherever the decode kernels give a
row the same bits whatever the call's row count: the tiny float32 model's dense path; the
bundled GGUF (Q4_1, a Q8_0 LM head) with `kernel_activations="int8"` (the int8 decode
kernels for 1 to 32 rows: their K chunks are fixed by K, kernels/qdot8.c) and with the
default `auto` while a step holds at most 8 rows on a CPU whose int8 kernels are AVX2 (auto
hands 9+ rows of these types to other kernels, as it does between batch sizes without
speculation: k + 1 <= 8 at batch 1). On AVX-512 VNNI CPUs one Q8_0 row (the LM head) takes
a kernel of its own (qdot8.c's dot32_vnni against dot8_vnni), so there auto and int8 are
exact only with `batch_invariant=True`, which makes every row count exact everywhere.
"""

from __future__ import annotations

import json
import re

import pytest

from iterserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}
# A prompt whose own tokens the tiny model's (looping) output keeps meeting.
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    kw = dict(num_kv_blocks=96, max_model_len=256, block_size=4)
    return (LLM(str(tiny_model_dir), **kw),
            LLM(str(tiny_model_dir), speculative_config=NGRAM, **kw))


def both(pair, prompts, **sp):
    params = SamplingParams(**sp)
    off, on = pair
    return (off.generate(prompts, params, use_tqdm=False),
            on.generate(prompts, params, use_tqdm=False))


def spec_totals(llm):
    return llm.engine.scheduler.stats().spec_decoding_total


def test_greedy_output_is_speculation_offs_and_drafts_are_accepted(pair):
    before = spec_totals(pair[1]).num_accepted_tokens
    off, on = both(pair, [PROMPT, "hello world, hello world, hello"], max_tokens=48,
                   temperature=0, ignore_eos=True)
    for a, b in zip(off, on):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text
    total = spec_totals(pair[1])
    assert total.num_drafts and total.num_accepted_tokens > before
    assert pair[1].engine.scheduler.block_manager.num_free_blocks == 96


def test_seeded_sampling_logprobs_and_n_are_speculation_offs(pair):
    off, on = both(pair, [PROMPT], max_tokens=32, temperature=0.8, top_k=20, seed=7, n=3,
                   logprobs=2, ignore_eos=True)
    for a, b in zip(off[0].outputs, on[0].outputs):
        assert b.token_ids == a.token_ids
        assert [lp.token_id for lp in b.logprobs] == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert lb.logprob == pytest.approx(la.logprob, abs=1e-5)
            assert [t for t, _ in lb.top_logprobs] == [t for t, _ in la.top_logprobs]


def test_a_stop_string_inside_a_verification_ends_the_output_where_it_would(pair):
    off0 = pair[0].generate([PROMPT], SamplingParams(max_tokens=40, temperature=0,
                                                     ignore_eos=True), use_tqdm=False)
    text = off0[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    off, on = both(pair, [PROMPT], max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    a, b = off[0].outputs[0], on[0].outputs[0]
    assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == \
        (a.text, a.token_ids, a.finish_reason, a.stop_reason)
    assert b.finish_reason == "stop" and len(b.token_ids) < 40
    assert b.metrics.num_output_tokens == len(b.token_ids)


def test_structured_outputs_check_drafts_against_the_grammar(pair, monkeypatch):
    from iterserve.engine.output_processor import OutputProcessor
    from iterserve.structured import StructuredOutputsParams

    limited = []
    real = OutputProcessor.draft_limits

    def spy(self):
        got = real(self)
        limited.append(got)
        return got

    monkeypatch.setattr(OutputProcessor, "draft_limits", spy)
    regex = r"(cat|mat|sat|on|the)( (cat|mat|sat|on|the)){6,12}\."
    off, on = both(pair, [PROMPT], max_tokens=60, temperature=0,
                   structured_outputs=StructuredOutputsParams(regex=regex))
    a, b = off[0].outputs[0], on[0].outputs[0]
    assert b.token_ids == a.token_ids and re.fullmatch(regex, b.text), b.text
    assert any(limited), "no draft was ever cut by the grammar"

    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}},
              "required": ["a"], "additionalProperties": False}
    off, on = both(pair, ['{"a":"the cat"} {"a":"the'], max_tokens=80, temperature=0,
                   structured_outputs=StructuredOutputsParams(json=schema,
                                                              disable_any_whitespace=True))
    assert on[0].outputs[0].token_ids == off[0].outputs[0].token_ids
    assert on[0].outputs[0].finish_reason == "stop"
    json.loads(on[0].outputs[0].text)


def test_an_abort_mid_speculation_frees_every_block(pair):
    llm = pair[1]
    engine = llm.engine
    engine.add_request("x", PROMPT, SamplingParams(max_tokens=200, temperature=0,
                                                   ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert engine.abort_request("x")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.block_manager.num_free_blocks == 96
    assert len(engine.scheduler.spec) == 0


def test_the_bundled_model_copies_a_file_back_exactly_in_fewer_steps():
    """Real text: a source file continued as its copy. int8 activations make decode rows
    exact whatever their number, so the output is speculation off's token for token."""
    prompt = _bundled_copy_prompt()
    kw = dict(kernel_activations="int8", max_model_len=1024, num_kv_blocks=160)
    sp = SamplingParams(max_tokens=64, temperature=0)
    off = LLM(**kw)
    a = off.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    steps_off = off.engine.num_steps
    del off
    # adaptive off: this is about exactness and steps; the adaptive plan (its own tests)
    # shortens drafts from the step-time model, which moves with the machine
    on = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                 "adaptive": False, "prompt_lookup_min": 2,
                                 "prompt_lookup_max": 4}, **kw)
    b = on.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert b.token_ids == a.token_ids and "which request owns which block" in b.text
    total = spec_totals(on)
    assert total.acceptance_rate > 0.6, total
    assert on.engine.num_steps < 0.6 * steps_off


def _bundled_copy_prompt() -> str:
    """A source file (a fixed copy: the model's greedy answer, and so what is accepted,
    follows the text) and the start of its copy."""
    from pathlib import Path

    code = (Path(__file__).parents[1] / "fixtures" / "copy_source.txt").read_text()
    return code + "\n\n\n# A copy of the module above:\n" + code[:150]


def _greedy_with_logprobs(llm, prompt: str):
    out = llm.generate([prompt], SamplingParams(max_tokens=48, temperature=0, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    return out.token_ids, [lp.logprob for lp in out.logprobs]


@pytest.mark.parametrize("k, batch_invariant", [(7, False), (10, True)])
def test_the_bundled_model_verifies_drafts_as_it_decodes(k, batch_invariant):
    """Speculation off against on, batch 1, the bundled model: with batch_invariant every
    logprob bit equals (for any k); on the default kernels (`auto`) the greedy tokens equal
    and the logprobs agree to 1e-3. The default kernels do not promise bits across row
    counts (the LM head, for one, runs split activations at 1-2 rows and float kernels at 8:
    dispatch.c, split8_takes); a verify step of 8 rows measured logprobs up to 3.5e-6 away
    from one-row decoding on AVX2 int8 kernels (3.2e-6 with the head in float) and 1.4e-4 on
    AVX-512 VNNI ones (one of 48, the rest within 1e-4)."""
    prompt = _bundled_copy_prompt()
    kw = dict(max_model_len=1024, num_kv_blocks=160, batch_invariant=batch_invariant)
    off = LLM(**kw)
    want = _greedy_with_logprobs(off, prompt)
    del off
    on = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                 "adaptive": False, "prompt_lookup_min": 2,
                                 "prompt_lookup_max": 4}, **kw)
    got = _greedy_with_logprobs(on, prompt)
    assert got[0] == want[0]
    if batch_invariant:
        assert got[1] == want[1]                   # bitwise, not approx
    else:
        assert got[1] == pytest.approx(want[1], abs=1e-3)
    total = spec_totals(on)
    assert total.num_accepted_tokens_per_pos[k - 1] > 0, total   # k + 1 rows were verified

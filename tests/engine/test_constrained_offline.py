"""Constrained and edited sampling through the offline API, as a user calls it:
`LLM(...).generate(prompts, SamplingParams(structured_outputs=..., logit_bias=..., ...))`
on the tiny random model (its unconstrained text is gibberish, so every constraint shows).

Each test also checks that the same request without the field does *not* satisfy the
property, so it would fail if the field were dropped on the way to the sampler.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from iterserve import LLM, SamplingParams
from iterserve.errors import GrammarCompileTimeout, InvalidRequestError, StructuredOutputsError
from iterserve.structured import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,6}-[0-9]{2}"
CHOICES = ["the quick brown fox jumps", "a slow green turtle naps"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256)


def gen(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


def parses_and_validates(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_structured_outputs_params_at_the_top_level_and_torch_free():
    import subprocess
    import sys
    code = ("import sys\nfrom iterserve import SamplingParams, StructuredOutputsParams\n"
            "p = SamplingParams(structured_outputs=StructuredOutputsParams(regex='a+'),\n"
            "    logit_bias={1: 2.0}, allowed_token_ids=[1], bad_words=['x'], min_tokens=1)\n"
            "p.validate()\nassert 'torch' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_json_schema_output_parses_and_validates(llm):
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    out = gen(llm, "Give me a person as JSON:", max_tokens=120, temperature=0.0,
              structured_outputs=so).outputs[0]
    assert out.finish_reason == "stop"
    assert parses_and_validates(out.text), out.text
    plain = gen(llm, "Give me a person as JSON:", max_tokens=120, temperature=0.0).outputs[0]
    assert not parses_and_validates(plain.text)


def test_regex_fullmatches_and_n3_sequences_each_match(llm):
    out = gen(llm, "Code:", max_tokens=30, temperature=0.0,
              structured_outputs=StructuredOutputsParams(regex=REGEX)).outputs[0]
    assert re.fullmatch(REGEX, out.text), out.text
    assert out.finish_reason == "stop"
    outs = gen(llm, "Code:", max_tokens=30, temperature=1.0, seed=3, n=3,
               structured_outputs=StructuredOutputsParams(regex=REGEX)).outputs
    assert len(outs) == 3
    for o in outs:
        assert re.fullmatch(REGEX, o.text), o.text
    assert len({o.text for o in outs}) > 1, "each sequence has its own matcher and samples"
    plain = gen(llm, "Code:", max_tokens=30, temperature=0.0).outputs[0]
    assert not re.fullmatch(REGEX, plain.text)


def test_json_with_n3_sampled(llm):
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    outs = gen(llm, "Person:", max_tokens=150, temperature=1.0, seed=11, n=3,
               structured_outputs=so).outputs
    assert [o.index for o in outs] == [0, 1, 2]
    for o in outs:
        assert o.finish_reason == "stop"
        assert parses_and_validates(o.text), o.text


def test_choice_is_one_of_the_choices(llm):
    out = gen(llm, "Pick one:", max_tokens=30, temperature=0.0,
              structured_outputs=StructuredOutputsParams(choice=CHOICES)).outputs[0]
    assert out.text in CHOICES
    assert out.finish_reason == "stop"
    # ended as soon as the grammar was complete: no EOS step after it
    assert not set(out.token_ids) & set(llm.engine.eos_token_ids)
    assert llm.get_tokenizer().decode(out.token_ids) == out.text
    assert gen(llm, "Pick one:", max_tokens=30, temperature=0.0).outputs[0].text not in CHOICES


def test_max_tokens_cut_gives_length_and_a_valid_prefix(llm):
    out = gen(llm, "Pick one:", max_tokens=2, temperature=0.0,
              structured_outputs=StructuredOutputsParams(choice=CHOICES)).outputs[0]
    assert out.finish_reason == "length"
    assert out.text and out.text not in CHOICES
    assert any(c.startswith(out.text) for c in CHOICES), out.text
    # the matcher took every token: a fresh one accepts the same ids and is not done
    compiled = llm.engine.structured_compiler.compile(StructuredOutputsParams(choice=CHOICES))
    m = compiled.matcher()
    assert m.accept_tokens(out.token_ids) == len(out.token_ids)
    assert not m.is_terminated()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_outputs_survive_forced_preemption(tiny_model_dir, mode):
    regex = r"[a-z]{30,40}"
    prompts = [f"Request number {i} says hello to the little model" for i in range(6)]
    p = SamplingParams(max_tokens=40, temperature=0.0,
                       structured_outputs=StructuredOutputsParams(regex=regex))

    def run(**kw):
        llm = LLM(str(tiny_model_dir), max_model_len=256, block_size=4, **kw)
        outs = llm.generate(prompts, p, use_tqdm=False)
        return [o.outputs[0] for o in outs], llm.engine

    roomy, e_roomy = run(num_kv_blocks=256)
    tight, e_tight = run(num_kv_blocks=18, preemption_mode=mode, num_swap_blocks=64)
    assert e_roomy.scheduler.stats().num_preemptions_total == 0
    assert e_tight.scheduler.stats().num_preemptions_total > 0, "the pool was not tight enough"
    for o in tight:
        assert re.fullmatch(regex, o.text), o.text
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert not e_tight.has_unfinished_requests()
    assert e_tight.scheduler.stats().num_running == 0


def test_logit_bias_forces_and_bans_a_token(llm):
    base = gen(llm, "Hello", max_tokens=6, temperature=0.0, ignore_eos=True).outputs[0]
    forced = next(t for t in range(5, 100) if t not in base.token_ids)
    out = gen(llm, "Hello", max_tokens=6, temperature=0.0, ignore_eos=True,
              logit_bias={forced: 100}).outputs[0]
    assert out.token_ids == [forced] * 6
    first = base.token_ids[0]
    banned = gen(llm, "Hello", max_tokens=6, temperature=0.0, ignore_eos=True,
                 logit_bias={first: -100}).outputs[0]
    assert first not in banned.token_ids
    # OpenAI's JSON spelling (string keys) works too
    out = gen(llm, "Hello", max_tokens=3, temperature=1.0, seed=1, ignore_eos=True,
              logit_bias={str(forced): 100.0}).outputs[0]
    assert out.token_ids == [forced] * 3


def test_allowed_token_ids_restricts_sampling(llm):
    allowed = [11, 23, 57]
    out = gen(llm, "Hello", max_tokens=20, temperature=1.0, seed=5, ignore_eos=True,
              allowed_token_ids=allowed).outputs[0]
    assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == 20
    plain = gen(llm, "Hello", max_tokens=20, temperature=1.0, seed=5, ignore_eos=True).outputs[0]
    assert not set(plain.token_ids) <= set(allowed)


def test_bad_words_bans_a_word(llm):
    from iterserve.model.logits_processors import bad_words_token_ids
    tok = llm.get_tokenizer()
    base = gen(llm, "Hello", max_tokens=8, temperature=0.0, ignore_eos=True).outputs[0]
    # a word whose own tokenisation is one of the tokens greedy decoding emits
    for t in base.token_ids:
        word = tok.decode([t]).strip()
        if word.isalpha() and [t] in bad_words_token_ids(tok, [word]):
            break
    else:
        pytest.fail(f"no single-token word in {base.text!r}")
    out = gen(llm, "Hello", max_tokens=8, temperature=0.0, ignore_eos=True,
              bad_words=[word]).outputs[0]
    assert t in base.token_ids and t not in out.token_ids


def test_min_tokens_holds_back_stop_tokens(llm):
    base = gen(llm, "Hello", max_tokens=8, temperature=0.0, ignore_eos=True).outputs[0]
    stop_id = base.token_ids[0]
    early = gen(llm, "Hello", max_tokens=8, temperature=0.0,
                stop_token_ids=[stop_id]).outputs[0]
    assert early.token_ids == [stop_id] and early.finish_reason == "stop"
    held = gen(llm, "Hello", max_tokens=8, temperature=0.0, stop_token_ids=[stop_id],
               min_tokens=4).outputs[0]
    assert len(held.token_ids) >= 4
    assert stop_id not in held.token_ids[:3]


def test_include_stop_str_in_output(llm):
    base = gen(llm, "Once upon a time", max_tokens=12, temperature=0.0,
               ignore_eos=True).outputs[0]
    text = base.text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2)
                if text[i:i + 2].isalpha())
    cut = text.find(stop)
    kw = dict(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    assert gen(llm, "Once upon a time", **kw).outputs[0].text == text[:cut]
    out = gen(llm, "Once upon a time", include_stop_str_in_output=True, **kw).outputs[0]
    assert out.text == text[:cut + len(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_min_tokens_holds_back_stop_strings_too(llm):
    """vLLM's rule: stop strings are checked only after min_tokens tokens, in the new text;
    a stop string inside the first min_tokens tokens' text does not stop the output."""
    kw = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    base = gen(llm, "Once upon a time", **kw).outputs[0]
    tok = llm.get_tokenizer()
    pieces = [tok.decode(base.token_ids[:i + 1]) for i in range(len(base.token_ids))]
    # a stop string that first ends inside token 1 (0-based), not inside token 0
    stop = next(pieces[1][j:j + 2] for j in range(len(pieces[1]) - 2, -1, -1)
                if len(pieces[1][j:j + 2]) == 2 and pieces[1][j:j + 2] not in pieces[0]
                and pieces[1][j:j + 2].strip())
    cut = base.text.find(stop)
    early = gen(llm, "Once upon a time", stop=[stop], **kw).outputs[0]
    assert early.text == base.text[:cut] and early.finish_reason == "stop"
    held = gen(llm, "Once upon a time", stop=[stop], min_tokens=4, **kw).outputs[0]
    # no stop inside the first 4 tokens' text: the output goes on past it
    assert held.text.startswith(pieces[3]) and len(held.token_ids) >= 4
    later = base.text.find(stop, len(pieces[3]) - len(stop) + 1)
    if later == -1:
        assert held.finish_reason == "length" and held.text == base.text
    else:
        assert held.finish_reason == "stop" and held.text == base.text[:later]
    both = gen(llm, "Once upon a time", stop=[stop], min_tokens=4,
               include_stop_str_in_output=True, **kw).outputs[0]
    assert both.text == (base.text if later == -1 else base.text[:later + len(stop)])


def test_stop_string_straddling_the_min_tokens_boundary_stops(llm):
    """A stop string that begins in the held-back tokens and ends in token min_tokens + 1
    still stops (vLLM searches the new text with a stop-length lookback)."""
    from iterserve.model.detokenizer import IncrementalDetokenizer

    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    def run(min_tokens):
        d = IncrementalDetokenizer(Chars(), [ord(">")], stop=["ab", "xyz"],
                                   min_tokens=min_tokens)
        out = ""
        for c in "abcxyzab!":
            delta = d.add(ord(c))
            out += delta.text
            if delta.stopped:
                return out, delta.stop_string
        return out + d.flush(), None
    assert run(0) == ("", "ab")
    assert run(1) == ("", "ab")             # begins in token 1, ends in token 2 > 1: stops
    assert run(2) == ("abc", "xyz")         # "ab" lies inside the first 2 tokens: ignored
    assert run(6) == ("abcxyz", "ab")       # the second "ab" (tokens 7-8) stops
    assert run(8) == ("abcxyzab!", None)    # nothing after token 8 completes a stop


@pytest.mark.parametrize("params, exc, param", [
    (dict(structured_outputs=StructuredOutputsParams(regex="(unclosed")),
     StructuredOutputsError, "structured_outputs.regex"),
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "bogus"})),
     StructuredOutputsError, "structured_outputs.json"),
    (dict(logit_bias={10**9: 1.0}), InvalidRequestError, "logit_bias"),
    (dict(logit_bias={1: float("nan")}), ValueError, "logit_bias"),
    (dict(allowed_token_ids=[10**9]), InvalidRequestError, "allowed_token_ids"),
    (dict(allowed_token_ids=[]), ValueError, "allowed_token_ids"),
    (dict(bad_words=[""]), ValueError, "bad_words"),
    (dict(min_tokens=-1), ValueError, "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), ValueError, "min_tokens"),
    (dict(structured_outputs="json"), ValueError, "structured_outputs"),
])
def test_bad_constraints_are_refused_naming_the_field(llm, params, exc, param):
    with pytest.raises(exc) as info:
        llm.generate(["Hello"], SamplingParams(**params), use_tqdm=False)
    assert info.value.param == param
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.stats().num_running == 0


def test_a_bad_constraint_in_a_batch_queues_nothing(llm):
    good = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex=REGEX))
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(x"))
    with pytest.raises(StructuredOutputsError):
        llm.generate(["Hello", "World"], [good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.stats().num_waiting == 0


def test_constrained_request_with_chunked_prefill(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256,
              max_num_batched_tokens=8, enable_chunked_prefill=True)
    prompt = "A long prompt that takes several chunks to prefill, " * 2
    outs = llm.generate([prompt, "Short"], SamplingParams(
        max_tokens=30, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=REGEX)),
        use_tqdm=False)
    for o in outs:
        assert re.fullmatch(REGEX, o.outputs[0].text), o.outputs[0].text


def test_the_step_carries_masks_only_for_constrained_rows_that_sample(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256,
              max_num_batched_tokens=8, enable_chunked_prefill=True)
    runner = llm.engine.executor
    seen = []
    real_execute = runner.execute

    def execute(out):
        bm = out.grammar_bitmask
        seen.append((dict(out.num_scheduled_tokens), None if bm is None else dict(bm.row_of)))
        return real_execute(out)

    runner.execute = execute
    free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.generate(["Hello", "World"], free, use_tqdm=False)
    assert seen and all(bm is None for _, bm in seen), "unconstrained steps build no mask"
    seen.clear()
    prompt = "A long prompt that takes several chunks to prefill, " * 2
    con = SamplingParams(max_tokens=30, temperature=0.0,
                         structured_outputs=StructuredOutputsParams(regex=REGEX))
    out = llm.generate([prompt, "Hello"], [con, free], use_tqdm=False)
    assert re.fullmatch(REGEX, out[0].outputs[0].text)
    cid = out[0].request_id
    prefill_steps = [bm for sched, bm in seen if sched.get(cid, 0) > 1]
    assert len(prefill_steps) > 1 and prefill_steps[0] is None, "a mid-prompt chunk samples nothing"
    masked = [bm for _, bm in seen if bm is not None]
    assert masked and all(set(bm) == {cid} for bm in masked)
    # one masked step per token, plus any step it sat out (its mask late: masks.py)
    deferred = llm.engine.output_processor._mask_filler.num_deferred
    assert len(masked) == len(out[0].outputs[0].token_ids) + deferred


def test_a_compile_timeout_is_a_400_naming_the_field(tiny_model_dir, monkeypatch):
    import time

    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256)
    compiler = llm.engine.structured_compiler
    compiler.compile_timeout = 0.05
    build = compiler._build

    def slow_build(*args, **kw):            # a compile that takes longer than the bound,
        time.sleep(0.5)                     # however fast or loaded the machine is
        return build(*args, **kw)

    monkeypatch.setattr(compiler, "_build", slow_build)
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(40)}}
    with pytest.raises(GrammarCompileTimeout) as info:
        llm.generate(["Hello"], SamplingParams(
            structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)
    assert info.value.param == "structured_outputs.json"
    assert not llm.engine.has_unfinished_requests()


def test_constrained_requests_with_prefix_cache_hits(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256, block_size=4,
              enable_prefix_caching=True)
    prompt = "The same long prompt is sent twice so the second one hits the cache"
    p = SamplingParams(max_tokens=30, temperature=0.0,
                       structured_outputs=StructuredOutputsParams(regex=REGEX))
    first = llm.generate([prompt], p, use_tqdm=False)[0]
    second = llm.generate([prompt], p, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert re.fullmatch(REGEX, second.outputs[0].text)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failing_mask_fill_ends_only_its_sequence(tiny_model_dir, monkeypatch, overlap):
    """The step's masks are filled on a worker thread while the forward pass runs (or before
    it, overlap off); either way a matcher that fails ends its own sequence with "error" and
    the batch goes on."""
    from iterserve.structured import backend

    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256)
    llm.engine.output_processor.overlap_bitmask_fill = overlap
    real = backend.GrammarMatcher.fill_bitmask
    calls = {"n": 0}

    def flaky(self, bitmask, row=0):
        if self.grammar.kind == "regex" and self.num_tokens == 2:
            raise RuntimeError("matcher broke")
        calls["n"] += 1
        return real(self, bitmask, row)

    monkeypatch.setattr(backend.GrammarMatcher, "fill_bitmask", flaky)
    bad = SamplingParams(max_tokens=8, temperature=0.0,
                         structured_outputs=StructuredOutputsParams(regex=REGEX))
    good = SamplingParams(max_tokens=8, temperature=0.0,
                          structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(["a", "b", "c"], [bad, good, free], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "matcher broke" in outs[0].error
    # overlapped, the failure is known after the step sampled its row (unmasked), so that
    # token is in token_ids but never in the text; serial, the step never ran for it
    bad_out = outs[0].outputs[0]
    assert len(bad_out.token_ids) == (3 if overlap else 2)
    assert bad_out.text == llm.get_tokenizer().decode(bad_out.token_ids[:2])
    assert outs[1].outputs[0].text in ("yes", "no") and outs[1].error is None
    assert len(outs[2].outputs[0].token_ids) == 8
    assert calls["n"] > 0 and not llm.engine.has_unfinished_requests()

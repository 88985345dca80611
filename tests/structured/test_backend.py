"""The llguidance backend driven the way the engine will drive it: a tiny random model's
logits, the batched bitmask, a pick, matcher.accept, until the grammar terminates."""

import asyncio
import json
import re

import jsonschema
import pytest
import torch

from fixtures.constrained_loop import Row, generate
from iterserve.errors import DefaultModelMissing, GrammarCompileError, GrammarCompileTimeout
from iterserve.structured import StructuredOutputsParams as P
from iterserve.structured.backend import StructuredOutputCompiler, build_ll_tokenizer
from iterserve.structured.bitmask import (
    GrammarBitmask, allocate_bitmask, apply_bitmask, fill_bitmasks, unpack_bitmask)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", None]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}


def allowed_ids(bitmask, row=0):
    return unpack_bitmask(bitmask[row:row + 1], bitmask.shape[1] * 32)[0].nonzero().flatten().tolist()


# --- the tokenizer as llguidance sees it --------------------------------------------------
def _check_vocab_bytes(tok, lltok):
    bad = []
    for i in range(tok.vocab_size):
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:        # a partial UTF-8 byte token: no str to compare
            continue
        if lltok.is_special_token(i):
            assert i in tok.all_special_ids, i
            continue
        if lltok.decode_bytes([i]) != text.encode():
            bad.append(i)
    assert not bad, f"tokens whose bytes differ: {bad[:10]}"


def test_tiny_vocab_bytes_and_special_tokens(tiny_tok):
    lltok = build_ll_tokenizer(tiny_tok, tiny_tok.vocab_size)
    assert lltok.vocab_size == tiny_tok.vocab_size
    assert lltok.eos_tokens == sorted(tiny_tok.eos_token_ids)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert lltok.is_special_token(tiny_tok.token_to_id(special))
    _check_vocab_bytes(tiny_tok, lltok)


def test_bundled_gguf_vocab_bytes():
    gguf = pytest.importorskip("gguf")
    from iterserve.model.default_model import default_model_path
    from iterserve.model.tokenizer import Tokenizer
    try:
        path = default_model_path()
    except DefaultModelMissing:
        pytest.skip("the bundled model is not installed")
    tok = Tokenizer.from_gguf_metadata(gguf.GGUFReader(path))
    lltok = build_ll_tokenizer(tok, tok.vocab_size)
    assert lltok.vocab_size == 49152
    _check_vocab_bytes(tok, lltok)


# --- real constrained generation -------------------------------------------------------------
# Greedy on random weights walks into the longest whitespace runs it may, so that case is
# compact JSON; sampled cases keep the (bounded) flexible whitespace.
@pytest.mark.parametrize("temperature, seed, compact", [(0.0, 0, True), (1.0, 1, False),
                                                        (1.0, 2, False)])
def test_json_schema_output_validates(compiler, tiny_model, tiny_tok, chat_prompt,
                                      temperature, seed, compact):
    g = compiler.compile(P(json=PERSON, disable_any_whitespace=compact))
    rows = [Row(chat_prompt, g.matcher(), max_tokens=200) for _ in range(2)]
    rows.append(Row(chat_prompt, None, max_tokens=8))      # an unconstrained neighbour
    generate(tiny_model, rows, compiler.eos_token_ids, temperature=temperature, seed=seed)
    for r in rows[:2]:
        text = tiny_tok.decode(r.output)
        assert r.finish == "stop" and r.matcher.is_terminated(), text
        jsonschema.validate(json.loads(text), PERSON)
    assert rows[2].finish in ("stop", "length")


def test_json_object_and_compact_json(compiler, tiny_model, tiny_tok, chat_prompt):
    small = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                              "n": {"type": "integer", "minimum": 0,
                                                    "maximum": 9}},
             "required": ["ok", "n"], "additionalProperties": False}
    rows = [Row(chat_prompt, compiler.compile(P(json=small, disable_any_whitespace=True))
                .matcher(), max_tokens=40),
            Row(chat_prompt, compiler.compile(P(json_object=True)).matcher(), max_tokens=300)]
    generate(tiny_model, rows, compiler.eos_token_ids, temperature=1.0, seed=3)
    compact = tiny_tok.decode(rows[0].output)
    jsonschema.validate(json.loads(compact), small)
    assert not re.search(r"\s", compact), compact
    if rows[1].finish == "stop":
        assert isinstance(json.loads(tiny_tok.decode(rows[1].output)), dict)
    else:   # a random model may write a long object; it must still be a JSON-object prefix
        assert tiny_tok.decode(rows[1].output).lstrip().startswith("{")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regex_choice_and_grammar(compiler, tiny_model, tiny_tok, chat_prompt, seed):
    regex = r"[0-9]{3}-[a-z]{2,5}(\.[A-Z])?"
    choices = ["red", "green", "blue", "light blue"]
    gbnf = 'root ::= "(" expr ")"\nexpr ::= num (("+" | "*") num)*\nnum ::= [1-9] [0-9]?'
    lark = 'start: "say " WORD ("," WORD)*\nWORD: /[a-z]{1,4}/'
    rows = [Row(chat_prompt, compiler.compile(P(regex=regex)).matcher(), max_tokens=40),
            Row(chat_prompt, compiler.compile(P(choice=choices)).matcher(), max_tokens=40),
            Row(chat_prompt, compiler.compile(P(grammar=gbnf)).matcher(), max_tokens=120),
            Row(chat_prompt, compiler.compile(P(grammar=lark)).matcher(), max_tokens=120)]
    generate(tiny_model, rows, compiler.eos_token_ids, temperature=1.0, seed=seed)
    texts = [tiny_tok.decode(r.output) for r in rows]
    assert re.fullmatch(regex, texts[0]), texts[0]
    assert texts[1] in choices
    if rows[2].finish == "stop":
        assert re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?)*\)", texts[2]), texts[2]
        # the EBNF output is an arithmetic expression Python parses and evaluates
        assert isinstance(eval(texts[2], {"__builtins__": {}}), int)
    else:
        assert re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?)*[+*]?[0-9]?", texts[2]), texts[2]
    assert re.fullmatch(r"say [a-z]{1,4}(,[a-z]{1,4})*,?", texts[3]), texts[3]


def test_choice_that_prefixes_another_allows_eos(compiler, tiny_tok):
    m = compiler.compile(P(choice=["yes", "yesno"])).matcher()
    for t in tiny_tok.encode("yes", add_special_tokens=False):
        assert m.accept(t)
    assert m.is_accepting() and not m.is_terminated()
    bm = allocate_bitmask(1, compiler.vocab_size)
    m.fill_bitmask(bm, 0)
    ids = allowed_ids(bm)
    assert set(compiler.eos_token_ids) <= set(ids)
    assert tiny_tok.decode([i for i in ids if i not in compiler.eos_token_ids]) in ("no", "n")
    assert m.accept(compiler.eos_token_ids[0]) and m.is_terminated()


def test_max_tokens_cut_leaves_a_valid_prefix(compiler, tiny_model, tiny_tok, chat_prompt):
    schema = {"type": "object", "properties": {"text": {"type": "string"}},
              "required": ["text"], "additionalProperties": False}
    g = compiler.compile(P(json=schema))
    row = generate(tiny_model, [Row(chat_prompt, g.matcher(), max_tokens=12)],
                   compiler.eos_token_ids, temperature=1.0, seed=5)[0]
    text = tiny_tok.decode(row.output)
    assert row.finish == "length" and not row.matcher.is_terminated()
    with pytest.raises(ValueError):
        json.loads(text)
    # An independent check: the text re-tokenised differently is still inside the grammar,
    # and some completion of it validates.
    fresh = g.matcher()
    retok = tiny_tok.encode(text, add_special_tokens=False)
    assert fresh.accept_tokens(retok) == len(retok) and not fresh.is_accepting()
    assert any(_validates(text + tail, schema) for tail in ('"}', '}', ' "}', '""}', ':""}'))


def _validates(text, schema):
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_forbidden_token_is_refused_without_harm(compiler, tiny_tok):
    m = compiler.compile(P(regex="[0-9]+")).matcher()
    assert not m.accept(tiny_tok.encode("x", add_special_tokens=False)[0])
    assert m.num_tokens == 0
    assert m.accept(tiny_tok.encode("7", add_special_tokens=False)[0])


def test_rollback_restores_state(compiler, tiny_tok):
    g = compiler.compile(P(json=PERSON))
    text = '{"name": "bo", "age": 42, "pet": "cat", "tags": [true]}'
    ids = tiny_tok.encode(text, add_special_tokens=False)
    m = g.matcher()
    bm = allocate_bitmask(2, compiler.vocab_size)
    assert m.accept_tokens(ids[:5]) == 5
    m.fill_bitmask(bm, 0)
    assert m.accept_tokens(ids[5:]) == len(ids) - 5 and m.is_terminated()
    m.rollback(len(ids) - 5)
    assert m.num_tokens == 5 and not m.is_accepting() and not m.is_terminated()
    m.fill_bitmask(bm, 1)
    assert torch.equal(bm[0], bm[1])
    assert m.accept_tokens(ids[5:]) == len(ids) - 5 and m.is_terminated()
    m.rollback(len(ids))
    assert m.num_tokens == 0
    with pytest.raises(ValueError):
        m.rollback(1)


def test_stop_token_ids_join_eos_and_end_the_match(compiler, tiny_tok):
    stop = tiny_tok.token_to_id("<|endoftext|>")
    assert stop not in compiler.eos_token_ids
    m = compiler.compile(P(regex="[0-9]{1,3}")).matcher(stop_token_ids=[stop])
    bm = allocate_bitmask(1, compiler.vocab_size)
    m.fill_bitmask(bm, 0)
    assert stop not in allowed_ids(bm)          # nothing matched yet: no stop
    assert m.accept(tiny_tok.encode("5", add_special_tokens=False)[0])
    m.fill_bitmask(bm, 0)
    assert stop in allowed_ids(bm) and set(compiler.eos_token_ids) <= set(allowed_ids(bm))
    assert m.accept(stop) and m.is_terminated()
    m.fill_bitmask(bm, 0)
    assert set(allowed_ids(bm)) == {stop, *compiler.eos_token_ids}
    m.rollback(1)
    assert not m.is_terminated() and m.is_accepting()


def test_terminated_grammar_allows_only_eos(compiler, tiny_tok):
    m = compiler.compile(P(choice=["blue"])).matcher()
    m.accept_tokens(tiny_tok.encode("blue", add_special_tokens=False))
    assert m.is_terminated()
    bm = allocate_bitmask(1, compiler.vocab_size)
    m.fill_bitmask(bm, 0)
    assert allowed_ids(bm) == compiler.eos_token_ids


# --- compile: errors, cache, timeout -----------------------------------------------------------
@pytest.mark.parametrize("params, field, match", [
    (P(json={"type": "nope"}), "structured_outputs.json", "nope"),
    (P(json={"$ref": "#/definitions/missing"}), "structured_outputs.json", "missing"),
    (P(regex="[a-", source="guided_regex"), "guided_regex", "regex"),
    (P(grammar="root ::= (", source="structured_outputs.grammar"),
     "structured_outputs.grammar", "grammar"),
    (P(grammar="start: undefined_rule"), "structured_outputs.grammar", "undefined_rule"),
])
def test_bad_constraints_are_400s_naming_the_field(compiler, params, field, match):
    with pytest.raises(GrammarCompileError, match=match) as e:
        compiler.compile(params)
    assert e.value.param == field and isinstance(e.value, ValueError)
    with pytest.raises(GrammarCompileError):      # the failure is cached, and still raised
        compiler.compile(params)


def test_compiled_grammars_are_cached(tiny_tok):
    c = StructuredOutputCompiler(tiny_tok, tiny_tok.vocab_size)
    try:
        a = c.compile(P(json=PERSON))
        b = c.compile(P(json=json.dumps(PERSON)))
        assert a is b and c.num_compiled == 1 and c.num_cache_hits == 1
        assert c.compile(P(json=PERSON, disable_any_whitespace=True)) is not a
        m1, m2 = a.matcher(), a.matcher()
        m1.accept(tiny_tok.encode("{", add_special_tokens=False)[0])
        assert m1.num_tokens == 1 and m2.num_tokens == 0 and not m2.ll_matcher.is_error()
    finally:
        c.close()


def _huge_schema(n):
    """n string fields with patterns, in objects of at most 1,000 properties (the limit)."""
    def obj(lo, hi):
        return {"type": "object",
                "properties": {f"field_{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1}}}x"}
                               for i in range(lo, hi)},
                "required": [f"field_{i}" for i in range(lo, hi)]}
    if n <= 1000:
        return obj(0, n)
    parts = {f"part_{j}": obj(j, min(n, j + 1000)) for j in range(0, n, 1000)}
    return {"type": "object", "properties": parts, "required": list(parts)}


def test_compile_timeout_is_reported_and_the_result_cached_later(tiny_tok):
    c = StructuredOutputCompiler(tiny_tok, tiny_tok.vocab_size, compile_timeout=0.005)
    try:
        params = P(json=_huge_schema(4000), source="response_format.json_schema.schema")
        with pytest.raises(GrammarCompileTimeout, match="did not compile within") as e:
            c.compile(params)
        assert e.value.param == "response_format.json_schema.schema"
        assert isinstance(e.value, GrammarCompileError)
        # The worker finishes on its own; a retry with time to spare is served from cache.
        g = c.compile(params, timeout=120)
        assert g.compile_seconds > 0.005
        assert c.compile(params) is g
    finally:
        c.close()


def test_compile_async(tiny_tok):
    c = StructuredOutputCompiler(tiny_tok, tiny_tok.vocab_size, compile_timeout=0.005)

    async def main():
        g = await c.compile_async(P(regex="[a-z]+"), timeout=30)
        with pytest.raises(GrammarCompileTimeout):
            await c.compile_async(P(json=_huge_schema(3000)))
        return g
    try:
        g = asyncio.run(main())
        assert g.kind == "regex" and c.cached(P(regex="[a-z]+")) is g
    finally:
        c.close()


# --- batched masks ---------------------------------------------------------------------------
def test_apply_bitmask_rows_and_padded_vocab(tiny_tok):
    # The model's logits are wider than the tokenizer (embedding padded to 520 ids).
    c = StructuredOutputCompiler(tiny_tok, 520)
    try:
        assert c.vocab_size == 520 and c.bitmask_width == 17
        m = c.compile(P(json_object=True)).matcher()
        bm = fill_bitmasks([m])
        ids = allowed_ids(bm)
        assert ids and max(ids) < tiny_tok.vocab_size
        logits = torch.randn(3, 544)       # wider still than the mask
        ref = logits.clone()
        apply_bitmask(logits, bm, [1])
        assert torch.equal(logits[0], ref[0]) and torch.equal(logits[2], ref[2])
        finite = torch.isfinite(logits[1]).nonzero().flatten().tolist()
        assert finite == ids
        # narrower logits than the mask: cut to their width
        narrow = torch.randn(1, 300)
        apply_bitmask(narrow, bm)
        assert torch.isfinite(narrow[0]).nonzero().flatten().tolist() == [i for i in ids if i < 300]
    finally:
        c.close()


def test_grammar_bitmask_maps_sequence_ids_to_rows(compiler, tiny_tok):
    ma = compiler.compile(P(regex="[0-9]+")).matcher()
    mb = compiler.compile(P(choice=["red"])).matcher()
    gb = GrammarBitmask.fill({"b": mb, "a": ma})
    logits = torch.zeros(3, compiler.vocab_size)
    gb.apply(logits, ["a", "free", "b"])
    assert torch.isfinite(logits[1]).all()
    digits = {tiny_tok.decode([int(i)]) for i in torch.isfinite(logits[0]).nonzero().flatten()}
    assert digits and all(d.isdigit() for d in digits)
    first = [int(i) for i in torch.isfinite(logits[2]).nonzero().flatten()]
    assert all("red".startswith(tiny_tok.decode([i])) for i in first)
    assert GrammarBitmask.fill({}) is None


@pytest.mark.parametrize("vocab, logits_width", [(100, 100), (100, 130), (100, 70), (64, 64)])
def test_apply_bitmask_matches_a_per_token_reference(vocab, logits_width):
    g = torch.Generator().manual_seed(vocab + logits_width)
    bm = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32,
                       generator=g)
    logits = torch.randn(5, logits_width, generator=g)
    rows = [4, 0, 2]
    want = logits.clone()
    for r, row in enumerate(rows):
        for t in range(logits_width):
            bit = (int(bm[r, t // 32]) >> (t % 32)) & 1 if t < bm.shape[1] * 32 else 0
            if not bit:
                want[row, t] = float("-inf")
    got = apply_bitmask(logits.clone(), bm, rows)
    assert torch.equal(got, want)             # allowed logits are untouched, bit for bit
    assert torch.equal(apply_bitmask(logits[rows].clone(), bm), want[rows])
    half = apply_bitmask(logits.clone().half(), bm, rows)
    assert torch.equal(torch.isinf(half), torch.isinf(want))


def test_todays_sampler_picks_only_allowed_tokens(compiler, tiny_tok):
    """The masked logits go through iterserve's Sampler (greedy, top-k/top-p, min-p,
    penalties, seeds, logprobs): every pick is one the grammar allows."""
    from iterserve.core.request import Request, SamplingParams
    from iterserve.model.sampler import Sampler

    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9),
             SamplingParams(temperature=1.2, top_k=5, seed=7),
             SamplingParams(temperature=1.0, min_p=0.2, repetition_penalty=1.3, logprobs=3)]
    reqs = [Request(f"r{i}", [5, 6, 7], p) for i, p in enumerate(kinds)]
    g = compiler.compile(P(regex="(cat|dog|bird)[0-9]{2}"))
    ms = [g.matcher() for _ in reqs]
    sampler = Sampler(seed=0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        logits = torch.randn(len(reqs), compiler.vocab_size, generator=gen) * 3
        bm = fill_bitmasks(ms)
        apply_bitmask(logits, bm)
        for r, m, res in zip(reqs, ms, sampler(logits, reqs)):
            if m.is_terminated():
                continue
            assert res.token_id in allowed_ids(bm, reqs.index(r)) and m.accept(res.token_id)
            if r.sampling_params.logprobs is not None:
                assert res.logprob > float("-inf")
            r.append_output_token(res.token_id, 0.0)
    for r, m in zip(reqs, ms):
        text = tiny_tok.decode(r.output_token_ids)
        assert re.fullmatch(r"(cat|dog|bird)[0-9]{0,2}", text) or \
            re.fullmatch(r"(c|ca|d|do|b|bi|bir)", text), text


@pytest.mark.parametrize("choice", ['say "hi"\n', "café ☕", "a\\b", "{not: grammar}"])
def test_choices_with_quotes_escapes_and_unicode(compiler, tiny_tok, choice):
    m = compiler.compile(P(choice=[choice, "other"])).matcher()
    ids = tiny_tok.encode(choice, add_special_tokens=False)
    assert m.accept_tokens(ids) == len(ids) and m.is_terminated()

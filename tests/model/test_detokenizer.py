"""Incremental detokenisation: streamed text equals a full decode; stop strings end output."""

import random

import pytest

from fixtures.tiny_tokenizer import EOS_TOKEN_ID, write_tiny_tokenizer
from iterserve.model.detokenizer import IncrementalDetokenizer
from iterserve.model.tokenizer import Tokenizer

MULTIBYTE = "naïve café 日本語のテキスト 🎉🙂 👩‍👩‍👧 Ελληνικά"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(d)
    return Tokenizer.from_hf_dir(d)


def stream(tok, ids, prompt=(5, 6), **kw):
    detok = IncrementalDetokenizer(tok, list(prompt), **kw)
    pieces = [detok.add(i).text for i in ids]
    pieces.append(detok.flush())
    return pieces, detok


def test_multibyte_characters_split_over_tokens_stream_correctly(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert len(ids) > len(MULTIBYTE.encode("utf-8")) // 2, "the tiny vocab must split characters"
    pieces, detok = stream(tok, ids)
    assert "".join(pieces) == MULTIBYTE == detok.output_text
    assert not any("\ufffd" in p for p in pieces), "incomplete characters must be held back"


def test_streamed_text_equals_decode_of_random_token_sequences(tok):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        # Prompts come from encoding text, so they end on a character boundary (random
        # prompt ids could leave half a character for the output to complete).
        prompt = tok.encode(rng.choice(["Q: ", "日本語:", "🎉 go"]), add_special_tokens=False)
        pieces, _ = stream(tok, ids, prompt=prompt)
        assert "".join(pieces) == tok.decode(ids)


def test_streamed_text_equals_decode_of_random_multibyte_texts(tok):
    rng = random.Random(1)
    alphabet = list(MULTIBYTE) + list("abc \n")
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 25)))
        ids = tok.encode(text, add_special_tokens=False)
        pieces, _ = stream(tok, ids)
        assert "".join(pieces) == text


def test_special_tokens_are_skipped_or_kept_as_asked(tok):
    ids = tok.encode("hi", add_special_tokens=False) + [EOS_TOKEN_ID]
    assert "".join(stream(tok, ids)[0]) == "hi"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == "hi<|im_end|>"


def test_decode_window_stays_small_however_long_the_output(tok):
    seen = []

    class Recording:
        def decode(self, ids, skip_special_tokens=True):
            seen.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode("the quick brown fox jumps over the lazy dog " * 60, add_special_tokens=False)
    assert len(ids) > 500
    pieces, detok = stream(Recording(), ids, prompt=list(range(100)))
    assert "".join(pieces).startswith("the quick brown fox")
    assert max(seen) <= 8
    assert len(detok._ids) <= 64 + 8, "dropped tokens must not accumulate"


def test_stop_string_ends_output_and_is_not_returned(tok):
    ids = tok.encode("Hello world, how are you?", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [5], stop=["how"])
    out = []
    for i in ids:
        delta = detok.add(i)
        out.append(delta.text)
        if delta.stopped:
            assert delta.stop_string == "how"
            break
    assert "".join(out) == detok.output_text == "Hello world, "
    assert detok.flush() == ""
    assert detok.add(ids[-1]).text == ""


def test_stop_string_spanning_tokens_is_found(tok):
    text = "one two three four"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "o thr"                     # starts inside "two", ends inside "three"
    pieces = []
    detok = IncrementalDetokenizer(tok, [5], stop=[stop])
    for i in ids:
        delta = detok.add(i)
        pieces.append(delta.text)
        if delta.stopped:
            break
    assert delta.stopped
    assert "".join(pieces) == "one tw"


def test_stop_string_split_across_single_byte_tokens(tok):
    ids = [tok.token_to_id(c) for c in "abcSTOPdef"]   # one token per character
    pieces, detok = stream(tok, ids, stop=["STOP"])
    assert "".join(pieces) == "abc" and detok.stopped


def test_earliest_stop_string_wins(tok):
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    pieces, detok = stream(tok, ids, stop=["gamma", "beta"])
    assert "".join(pieces) == "alpha "


def test_text_that_only_looked_like_a_stop_prefix_is_released(tok):
    ids = tok.encode("the end is near", add_special_tokens=False)
    pieces, detok = stream(tok, ids, stop=["end!"])
    assert "".join(pieces) == "the end is near" and not detok.stopped


def test_prefix_of_a_stop_string_at_the_end_is_released_by_flush(tok):
    ids = tok.encode("wait for it STO", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [5], stop=["STOP"])
    streamed = "".join(detok.add(i).text for i in ids)
    assert not streamed.endswith("STO")
    assert streamed + detok.flush() == "wait for it STO"


def test_stop_string_with_multibyte_characters(tok):
    ids = tok.encode("ok 日本語 done", add_special_tokens=False)
    pieces, detok = stream(tok, ids, stop=["本語"])
    assert "".join(pieces) == "ok 日" and detok.stopped


def test_empty_stop_string_is_rejected(tok):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [1], stop=[""])


def test_sentencepiece_output_keeps_the_space_that_continues_the_prompt(tmp_path):
    # SentencePiece decoders drop a leading space, so decoding outputs alone would glue the
    # first word to the prompt; decoding in the prompt's context (as vLLM does) keeps it.
    from fixtures.tiny_gguf import write_tiny_sentencepiece_gguf
    from iterserve.model.gguf import open_gguf
    write_tiny_sentencepiece_gguf(tmp_path / "spm.gguf")
    tok = Tokenizer.from_gguf_metadata(open_gguf(tmp_path / "spm.gguf"))
    full = tok.encode("The quick brown fox jumps over the lazy dog")
    pieces = tok.convert_ids_to_tokens(full)
    cut = next(i for i in range(3, len(full)) if pieces[i].startswith("▁"))   # a word start
    prompt, output = full[:cut], full[cut:]
    pieces, _ = stream(tok, output, prompt=prompt)
    assert "".join(pieces) == tok.decode(full)[len(tok.decode(prompt)):]
    assert "".join(pieces).startswith(" ")


def _reference_stop(tok, ids, stops):
    """The same rule computed the slow way: decode everything after each token; the first
    token after which some stop string appears ends the text at that string's start."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[:min(found)], True
    return tok.decode(ids), False


def test_stop_strings_agree_with_a_full_decode_reference_on_random_texts(tok):
    rng = random.Random(2)
    alphabet = "ab é日🎉"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 20)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4)))
                 for _ in range(rng.randrange(1, 3))]
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, [5], stop=stops)
        out = ""
        for i in ids:
            delta = detok.add(i)
            out += delta.text
            if delta.stopped:
                break
        else:
            out += detok.flush()
        assert (out, detok.stopped) == _reference_stop(tok, ids, stops), (text, stops)

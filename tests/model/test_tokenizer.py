"""Tokenizer and chat templates: HF directories, GGUF metadata, and parity with transformers."""

import json
import os

import pytest

from fixtures.tiny_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, build_tiny_tokenizer, write_tiny_tokenizer
from iterserve.errors import ChatTemplateError, DefaultModelMissing, TokenizerLoadError
from iterserve.model.tokenizer import Tokenizer

SAMPLES = [
    "Hello, world!",
    "héllo wörld — 日本語のテキスト 🎉🙂 👩‍👩‍👧",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))",
    "  leading spaces and trailing   ",
    "<|im_start|>user\nhi<|im_end|>",
    "numbers 2024, 3.14159 and 1e-5",
]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What's 2+2? ünïcode ✓"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_tok")
    write_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return Tokenizer.from_hf_dir(tiny_dir)


def test_tiny_tokenizer_fixture_has_exactly_the_requested_vocab_size():
    for size in (259, 512, 1000):
        assert build_tiny_tokenizer(size).get_vocab_size(with_added_tokens=True) == size
    with pytest.raises(ValueError, match="at least 259"):
        build_tiny_tokenizer(100)


def test_tiny_tokenizer_fixture_is_deterministic():
    assert build_tiny_tokenizer(512).to_str() == build_tiny_tokenizer(512).to_str()


def test_hf_dir_special_tokens_and_template(tiny):
    assert tiny.vocab_size == 512
    assert (tiny.bos_token_id, tiny.eos_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID)
    assert tiny.eos_token_ids == {EOS_TOKEN_ID}
    assert {0, 1, 2} <= tiny.all_special_ids
    assert tiny.chat_template and "<|im_start|>" in tiny.chat_template


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_decode_round_trip(tiny, text):
    ids = tiny.encode(text)
    assert all(0 <= i < tiny.vocab_size for i in ids)
    assert tiny.decode(ids, skip_special_tokens=False) == text


def test_decode_skips_special_tokens_by_default(tiny):
    ids = tiny.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == BOS_TOKEN_ID and ids[-1] == EOS_TOKEN_ID
    assert tiny.decode(ids) == "user\nhi"
    assert tiny.convert_ids_to_tokens([BOS_TOKEN_ID, EOS_TOKEN_ID]) == ["<|im_start|>", "<|im_end|>"]


def test_eos_ids_include_generation_config_and_bos_is_added_when_configured(tmp_path):
    write_tiny_tokenizer(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = True
    cfg_path.write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.eos_token_ids == {0, 2}
    assert tok.encode("hi")[0] == BOS_TOKEN_ID
    assert tok.encode("hi", add_special_tokens=False)[0] != BOS_TOKEN_ID


def test_chat_template_file_overrides_config(tmp_path):
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerLoadError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_hf_dir_tokenizer_matches_transformers(tiny, tiny_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    for text in SAMPLES:
        assert tiny.encode(text) == hf.encode(text)
    assert tiny.apply_chat_template(CHAT) == hf.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True)
    assert tiny.apply_chat_template(CHAT, add_generation_prompt=False) == hf.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=False)


def test_chat_template_renders_chatml_with_generation_prompt(tiny):
    text = tiny.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny.encode_chat([{"role": "user", "content": "hi"}]) == tiny.encode(text, add_special_tokens=False)


def test_chat_template_accepts_openai_text_parts(tiny):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "user\nab<|im_end|>" in tiny.apply_chat_template(parts)


@pytest.mark.parametrize("messages, message", [
    ("hello", "must be a list"),
    ([], "at least one message"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"content": "x"}], r"messages\[0\].role"),
    ([{"role": "user"}], r"messages\[0\] has no 'content'"),
    ([{"role": "user", "content": 5}], r"messages\[0\].content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "text part"),
])
def test_malformed_messages_raise_chat_template_error(tiny, messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        tiny.apply_chat_template(messages)


def test_chat_template_error_is_a_value_error():
    assert issubclass(ChatTemplateError, ValueError)


def test_model_without_template_raises_chat_template_error(tmp_path):
    write_tiny_tokenizer(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_raise_exception_and_syntax_errors_become_chat_template_errors(tiny):
    tiny_raise = Tokenizer(tiny.backend, chat_template=(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"))
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tiny_raise.apply_chat_template([{"role": "assistant", "content": "x"}])
    broken = Tokenizer(tiny.backend, chat_template="{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_tojson_keeps_unicode_and_sandbox_blocks_attribute_escapes(tiny):
    tok = Tokenizer(tiny.backend, chat_template="{{ messages[0]['content'] | tojson }}")
    assert tok.apply_chat_template([{"role": "user", "content": "日本 <b>"}]) == '"日本 <b>"'
    evil = Tokenizer(tiny.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


# --- the bundled SmolLM2 GGUF against transformers loading the same file ------------------
@pytest.fixture(scope="module")
def smollm2():
    from iterserve.model.default_model import default_model_path
    from iterserve.model.gguf import open_gguf
    try:
        path = default_model_path()
    except DefaultModelMissing as exc:
        pytest.skip(f"default model not installed: {exc}")
    return path, Tokenizer.from_gguf_metadata(open_gguf(path))


@pytest.fixture(scope="module")
def smollm2_hf(smollm2):
    transformers = pytest.importorskip("transformers")
    path = smollm2[0]
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                      gguf_file=os.path.basename(path))


def test_gguf_tokenizer_special_tokens(smollm2):
    tok = smollm2[1]
    assert tok.vocab_size == 49152
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2) and 2 in tok.eos_token_ids
    assert tok.encode("hi")[0] != tok.bos_token_id      # tokenizer.ggml.add_bos_token is false


def test_gguf_tokenizer_matches_transformers(smollm2, smollm2_hf):
    tok = smollm2[1]
    for text in SAMPLES:
        assert tok.encode(text) == smollm2_hf.encode(text), text
        assert tok.decode(tok.encode(text)) == smollm2_hf.decode(smollm2_hf.encode(text),
                                                                  skip_special_tokens=True)


def test_gguf_tokenizer_splits_digits_individually_like_smollm(smollm2):
    tok = smollm2[1]
    assert tok.convert_ids_to_tokens(tok.encode("2024")) == ["2", "0", "2", "4"]


def test_gguf_chat_template_matches_transformers(smollm2, smollm2_hf):
    tok = smollm2[1]
    for messages in (CHAT, CHAT[1:2]):
        for gen in (True, False):
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == \
                smollm2_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    # SmolLM2's template adds its default system prompt when there is none
    assert "You are a helpful AI assistant named SmolLM" in tok.apply_chat_template(CHAT[1:2])


# --- a SentencePiece ("llama") GGUF vocabulary ------------------------------------------
SPM_SAMPLES = ["Hello world", "The quick brown fox.", " two  spaces", "日本 🎉 bytes", "a\nb\tc",
               "scheduler preempts the newest request"]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    from fixtures.tiny_gguf import write_tiny_sentencepiece_gguf
    from iterserve.model.gguf import open_gguf
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    write_tiny_sentencepiece_gguf(path)
    return path, Tokenizer.from_gguf_metadata(open_gguf(path))


def test_sentencepiece_gguf_round_trips_with_byte_fallback(spm_gguf):
    tok = spm_gguf[1]
    assert tok.bos_token_id == 1 and tok.encode("hi")[0] == 1    # llama vocabularies add BOS
    for text in SPM_SAMPLES:
        # SentencePiece decoding strips the one space it prepended, so a leading space is lost
        expected = text[1:] if text.startswith(" ") else text
        assert tok.decode(tok.encode(text)) == expected
    pieces = tok.convert_ids_to_tokens(tok.encode("日", add_special_tokens=False))
    assert pieces == ["▁", "<0xE6>", "<0x97>", "<0xA5>"]


def test_sentencepiece_gguf_matches_transformers(spm_gguf):
    transformers = pytest.importorskip("transformers")
    path, tok = spm_gguf
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in SPM_SAMPLES:
        assert tok.encode(text) == hf.encode(text), text
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)


# --- `--tokenizer x.gguf`: Tokenizer.from_path reads the metadata only -------------------
def test_from_path_gguf_reads_metadata_only_and_matches_gguf_py(smollm2, monkeypatch):
    """`Tokenizer.from_path(x.gguf)` parses the key/value header with the loader's parser
    and stops before the tensor table (gguf-py's GGUFReader parsed every tensor's info:
    ~3 s on a 1.7B or 8B file); the tokenizer is the one gguf-py's view of the file gives."""
    import gguf

    from iterserve.model import gguf as gguf_header
    path = smollm2[0]
    ref = Tokenizer.from_gguf_metadata(gguf.GGUFReader(path))
    opened = []
    real_open = gguf_header.open_gguf

    def spy(p, tensors=True):
        header = real_open(p, tensors)
        opened.append((tensors, len(header.tensors)))
        return header

    monkeypatch.setattr(gguf_header, "open_gguf", spy)
    monkeypatch.setattr(gguf, "GGUFReader", None)          # must not be used
    tok = Tokenizer.from_path(path)
    assert opened == [(False, 0)]
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids, tok.chat_template) == \
        (ref.vocab_size, ref.bos_token_id, ref.eos_token_ids, ref.chat_template)
    for text in SAMPLES:
        assert tok.encode(text) == ref.encode(text)


def test_from_path_bad_gguf_is_a_tokenizer_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 9)      # header cut short
    with pytest.raises(TokenizerLoadError, match="cannot be parsed as GGUF"):
        Tokenizer.from_path(bad)
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 a zip")
    with pytest.raises(TokenizerLoadError, match="not a GGUF file"):
        Tokenizer.from_path(tmp_path / "not.gguf")

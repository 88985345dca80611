"""The model's tokenizer: HF `tokenizers` underneath, built from an HF directory or a GGUF.

One class serves both sources so the engine never cares where a model came from. The fast
Rust tokenizer does the encoding and decoding; this wrapper adds what `tokenizers` does not
know: which ids end a generation (`eos_token_ids`), whether to prepend BOS, and the chat
template (rendered by `chat_template.render_chat_template`, HF's environment).

GGUF files carry no tokenizer.json; llama.cpp stores the vocabulary, merges, token types and
a pre-tokenizer *name* (`tokenizer.ggml.pre`). We rebuild the tokenizer the way llama.cpp
runs it: byte-level BPE for `tokenizer.ggml.model == "gpt2"` with the split regexes
llama.cpp uses for that pre-tokenizer name, and a SentencePiece-style BPE (byte fallback,
"▁" for spaces) for `"llama"`.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterable, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _RustTokenizer

from iterserve.errors import GGUFLoadError, TokenizerLoadError
from iterserve.model.chat_template import render_chat_template

__all__ = ["Tokenizer"]

log = logging.getLogger(__name__)


# llama.cpp's split regexes per `tokenizer.ggml.pre` (src/llama-vocab.cpp). Each is applied in
# turn, keeping the matches as separate pieces ("isolated"), before byte-level encoding.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZER_SPLITS: dict[str, list[str]] = {
    "default": [_GPT2_SPLIT],
    "gpt-2": [_GPT2_SPLIT],
    "gpt2": [_GPT2_SPLIT],
    # SmolLM/StarCoder split every digit on its own first (their tokenizer.json has a
    # Digits(individual_digits=True) pre-tokenizer before ByteLevel).
    "smollm": [r"\p{N}", _GPT2_SPLIT],
    "starcoder": [r"\p{N}", _GPT2_SPLIT],
    "refact": [r"\p{N}", _GPT2_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "llama-v3": [_LLAMA3_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "smaug-bpe": [_LLAMA3_SPLIT],
    "falcon3": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
    "deepseek-r1-qwen": [_QWEN2_SPLIT],
}

_TOKEN_TYPE_CONTROL = 3        # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL (<|im_end|>, <s>, ...)
_TOKEN_TYPE_USER_DEFINED = 4   # added tokens matched whole but not special (<think>)
_TOKEN_TYPE_BYTE = 6           # <0x0A> byte-fallback pieces of SentencePiece vocabularies


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _gguf_value(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


class Tokenizer:
    """Encode/decode text, know the special ids, render the chat template."""

    def __init__(self, backend: _RustTokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, add_bos_token: bool = False,
                 chat_template: str | None = None, extra_eos_token_ids: Iterable[int] = (),
                 special_tokens: dict[str, str | None] | None = None,
                 vocab_size: int | None = None) -> None:
        self._tok = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id: int | None = backend.token_to_id(eos_token) if eos_token else None
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.chat_template = chat_template or None
        self.vocab_size: int = vocab_size if vocab_size is not None else backend.get_vocab_size(
            with_added_tokens=True)
        self.eos_token_ids: set[int] = set(extra_eos_token_ids)
        if self.eos_token_id is not None:
            self.eos_token_ids.add(self.eos_token_id)
        self.all_special_ids: set[int] = {
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        self._special_tokens = dict(special_tokens or {})
        self._special_tokens.setdefault("bos_token", bos_token)
        self._special_tokens.setdefault("eos_token", eos_token)

    # --- construction ----------------------------------------------------------------
    @classmethod
    def from_path(cls, path: str | os.PathLike) -> "Tokenizer":
        """vLLM's `--tokenizer PATH`: an HF tokenizer directory (tokenizer.json and its
        configs), a tokenizer.json file (its directory's configs are read too), or a .gguf
        file whose metadata holds the tokenizer."""
        path = os.fspath(path)
        if os.path.isdir(path):
            return cls.from_hf_dir(path)
        if not os.path.isfile(path):
            raise TokenizerLoadError(f"tokenizer path {path!r} does not exist")
        if path.lower().endswith(".gguf"):
            # The loader's own parser, metadata only: gguf-py's GGUFReader also parses every
            # tensor's info into numpy views (3.0-3.3 s on a 1.7B or 8B file vs 0.15 s).
            from iterserve.model.gguf import open_gguf  # torch (weights.map_file): .gguf only
            try:
                header = open_gguf(path, tensors=False)
            except GGUFLoadError as exc:
                raise TokenizerLoadError(str(exc)) from exc
            return cls.from_gguf_metadata(header)
        if os.path.basename(path) == "tokenizer.json":
            return cls.from_hf_dir(os.path.dirname(path) or ".")
        raise TokenizerLoadError(f"tokenizer path {path!r} is neither a directory with "
                                 "tokenizer.json, a tokenizer.json file nor a .gguf file")

    def check_model_vocab(self, model_vocab_size: int, where: str = "--tokenizer") -> None:
        """A tokenizer whose ids reach past the model's embedding rows cannot be served (its
        tokens would index nothing); a smaller one is fine (models pad their vocabulary)."""
        if self.vocab_size > model_vocab_size:
            raise TokenizerLoadError(
                f"{where}: the tokenizer has {self.vocab_size} tokens but the model's "
                f"vocabulary has {model_vocab_size} rows; this tokenizer does not belong to "
                "this model")

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """tokenizer.json + tokenizer_config.json (+ special_tokens_map.json,
        chat_template.jinja, generation_config.json / config.json for extra eos ids)."""
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_file):
            raise TokenizerLoadError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
        try:
            backend = _RustTokenizer.from_file(tok_file)
        except Exception as exc:  # the Rust side raises a bare Exception on bad JSON
            raise TokenizerLoadError(f"{tok_file}: cannot be read by `tokenizers`: {exc}") from exc
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        smap = _read_json(os.path.join(path, "special_tokens_map.json"))

        def special(name: str) -> str | None:
            return _token_str(cfg.get(name)) or _token_str(smap.get(name))

        template = cfg.get("chat_template")
        if isinstance(template, list):   # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()

        extra_eos: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            extra_eos.update(_ids(_read_json(os.path.join(path, name)).get("eos_token_id")))
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return cls(backend, bos_token=special("bos_token"), eos_token=special("eos_token"),
                   add_bos_token=bool(cfg.get("add_bos_token", False)),
                   chat_template=template, extra_eos_token_ids=extra_eos,
                   special_tokens={n: special(n) for n in names})

    @classmethod
    def from_gguf_metadata(cls, reader) -> "Tokenizer":
        """Rebuild the tokenizer llama.cpp would run from a GGUF's metadata (`fields`, as
        model/gguf.py's open_gguf or gguf-py's `GGUFReader` give them)."""
        kind = _gguf_value(reader, "tokenizer.ggml.model")
        tokens = _gguf_value(reader, "tokenizer.ggml.tokens")
        if kind is None or tokens is None:
            raise TokenizerLoadError("the GGUF file has no tokenizer (tokenizer.ggml.model/tokens)")
        token_types = _gguf_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = _gguf_value(reader, "tokenizer.ggml.merges")
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, merges, _gguf_value(reader, "tokenizer.ggml.pre"))
            default_add_bos = False
        elif kind == "llama":
            scores = _gguf_value(reader, "tokenizer.ggml.scores")
            add_space = _gguf_value(reader, "tokenizer.ggml.add_space_prefix", True)
            backend = _sentencepiece_bpe(tokens, scores, merges, token_types, add_space)
            default_add_bos = True
        else:
            raise TokenizerLoadError(
                f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')")

        special, plain = [], []
        for tok, ttype in zip(tokens, token_types):
            if ttype == _TOKEN_TYPE_CONTROL:
                special.append(AddedToken(tok, special=True, normalized=False))
            elif ttype == _TOKEN_TYPE_USER_DEFINED:
                plain.append(AddedToken(tok, special=False, normalized=False))
        if special:
            backend.add_special_tokens(special)
        if plain:
            backend.add_tokens(plain)

        def tok_of(key: str) -> str | None:
            i = _gguf_value(reader, f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        eos_extra = {i for i in (_gguf_value(reader, "tokenizer.ggml.eot_token_id"),
                                 _gguf_value(reader, "tokenizer.ggml.eom_token_id")) if i is not None}
        return cls(backend, bos_token=tok_of("bos_token_id"), eos_token=tok_of("eos_token_id"),
                   add_bos_token=bool(_gguf_value(reader, "tokenizer.ggml.add_bos_token",
                                                  default_add_bos)),
                   chat_template=_gguf_value(reader, "tokenizer.chat_template"),
                   extra_eos_token_ids=eos_extra,
                   special_tokens={"bos_token": tok_of("bos_token_id"),
                                   "eos_token": tok_of("eos_token_id"),
                                   "unk_token": tok_of("unknown_token_id"),
                                   "pad_token": tok_of("padding_token_id")},
                   vocab_size=len(tokens))

    # --- text <-> ids ---------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self._tok.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def backend(self) -> _RustTokenizer:
        """The underlying `tokenizers.Tokenizer` (for batch encoding, offsets, ...)."""
        return self._tok

    # --- chat -----------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **template_vars: Any) -> str:
        """The prompt text for `messages`; encode it with `add_special_tokens=False` (the
        template writes BOS itself when the model wants one), or use `encode_chat`.
        `chat_template` replaces the model's template (HF's argument of that name)."""
        return render_chat_template(chat_template or self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt,
                                    special_tokens=self._special_tokens, **template_vars)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt),
                           add_special_tokens=False)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, chat_template={'yes' if self.chat_template else 'no'})")


# --- GGUF tokenizer builders -----------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what byte-level vocabularies use)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _byte_level_bpe(tokens: list[str], merges: list[str] | None, pre: str | None) -> _RustTokenizer:
    if not merges:
        raise TokenizerLoadError("GGUF byte-level (gpt2) tokenizer has no tokenizer.ggml.merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise TokenizerLoadError(f"malformed GGUF merge {m!r} (expected 'left right')")
        pairs.append((a, b))
    tok = _RustTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    splits = _PRE_TOKENIZER_SPLITS.get(pre or "default")
    if splits is None:
        log.warning("GGUF pre-tokenizer %r is not known; splitting text the GPT-2 way", pre)
        splits = _PRE_TOKENIZER_SPLITS["default"]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float] | None, merges: list[str] | None,
                       token_types: list[int], add_space_prefix: bool) -> _RustTokenizer:
    """Llama/Mistral-style SentencePiece BPE: "▁" for spaces, <0xNN> byte fallback.

    GGUF "llama" vocabularies usually have scores but no merges. SentencePiece's BPE merges
    the adjacent pair whose result scores highest, so a merge list ranked by the score of the
    merged token reproduces it; the tie-breaking follows transformers' `generate_merges`
    (score, then longer left piece, then longer right piece, then vocabulary order), so the
    ids match what transformers builds from the same file.
    """
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        if scores is None:
            raise TokenizerLoadError("GGUF llama tokenizer has neither merges nor scores")
        ranked = []
        for tok, score in zip(tokens, scores):
            local = [(tok[:cut], tok[cut:]) for cut in range(1, len(tok))
                     if tok[:cut] in vocab and tok[cut:] in vocab]
            local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
            ranked.extend((left, right, score) for left, right in local)
        ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
        pairs = [(left, right) for left, right, _ in ranked]
    unk = next((t for t, ty in zip(tokens, token_types) if ty == 2), None)  # 2 = UNKNOWN
    tok = _RustTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True,
                                    byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def load_tokenizer_for(path: str | os.PathLike, model_vocab_size: int) -> Tokenizer:
    """`--tokenizer PATH` for a model with `model_vocab_size` embedding rows: loaded and
    checked at start, so a tokenizer of another model fails there with a clear message
    instead of out-of-range token ids at the first request."""
    tok = Tokenizer.from_path(path)
    tok.check_model_vocab(model_vocab_size, f"--tokenizer {os.fspath(path)!r}")
    return tok

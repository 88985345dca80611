"""The grammar engine behind structured outputs: llguidance, compiled once, matched per token.

Why llguidance and not xgrammar: xgrammar 0.2.8 on PyPI depends on `triton` on Linux x86-64
(a 286 MB wheel, 1.04 GB unpacked, used only for its CUDA kernels) plus transformers at run
time; llguidance 1.9.1 (also a vLLM backend, `--structured-outputs-config.backend guidance`)
is one 3 MB wheel with no dependencies. It parses on bytes with an Earley parser over a lazy
lexer, so "compiling" a grammar is cheap (build the lexer, check the grammar) and every mask
step is bounded by fuel limits (`LLParserLimits`) instead of running unbounded.

Three objects:

- `StructuredOutputCompiler(tokenizer, vocab_size)`: built once per model. Turns iterserve's
  `Tokenizer` into an `llguidance.LLTokenizer` (from the same tokenizer.json text the HF
  `tokenizers` backend serialises, so byte-level and SentencePiece byte-fallback vocabularies
  decode to the same bytes and special tokens stay special: a grammar can only emit them by
  name). `compile(params)` builds and checks the grammar in a worker thread and gives up
  after `compile_timeout` seconds (a GrammarCompileTimeout, i.e. a 400, instead of a
  stalled engine); results are cached by the constraint (`params.cache_key()`), and a
  compile that finishes after its caller gave up still lands in the cache.
- `CompiledGrammar`: the checked grammar as a matcher in its start state; `matcher()` hands
  each sequence its own copy (cheap: no re-compilation).
- `GrammarMatcher`: one sequence's parse state. `fill_bitmask(bitmask, row)` writes the
  allowed next tokens, `accept(token)` advances (False, and no state change, for a token the
  grammar forbids), `is_terminated()` says the grammar is complete and cannot be extended
  (the sequence should finish now), `rollback(n)` withdraws the last n tokens.

EOS: while the grammar is in an accepting state the mask also allows the model's EOS ids and
the request's stop token ids; once it is terminated it allows only those. The output
processor ends the sequence as soon as `is_terminated()` turns true, so that last step is
normally never run.

The masks are batched (`structured.bitmask`): one int32 bit per token, rows for the
constrained sequences only.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import logging
import threading
from typing import Any, Iterable, Iterator, Sequence

import llguidance
import numpy as np
import torch

from iterserve.errors import GrammarCompileError, GrammarCompileTimeout, StructuredOutputsError
from iterserve.structured import limits as _limits
from iterserve.structured.bitmask import allocate_bitmask
from iterserve.structured.params import StructuredOutputsParams
from iterserve.structured.workers import WorkerPool

log = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT = 5.0     # seconds a request may wait for its grammar
COMPILE_NICE = 5                  # compile threads run this much below the engine (workers.py)
PROBE_TOKENS = 3                  # first tokens tried at compile time (see _probe)
MAX_ERROR_CHARS = 600             # of llguidance's message in a 400
# llguidance's own limits (LLParserLimits; its defaults but for the short errors)
PARSER_LIMITS: dict[str, Any] = {"verbose_errors": False}
# Whitespace allowed between JSON tokens. llguidance's default is unbounded ([ \t\n\r]+),
# which lets a weak model spend its whole budget on spaces; pretty-printed JSON a few levels
# deep needs a newline and well under 20 indent characters.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"


def build_ll_tokenizer(tokenizer: Any, vocab_size: int | None = None,
                       eos_token_ids: Iterable[int] | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of an iterserve `Tokenizer` (or a `tokenizers.Tokenizer`).

    `vocab_size` is the width of the model's logits: embedding tables are often padded
    beyond the tokenizer's last id, and those ids get a 0 bit in every mask (never allowed).
    """
    backend = getattr(tokenizer, "backend", tokenizer)
    if eos_token_ids is None:
        eos_token_ids = getattr(tokenizer, "eos_token_ids", None) or ()
    eos = sorted(set(int(t) for t in eos_token_ids))
    n_tok = backend.get_vocab_size(with_added_tokens=True)
    n_vocab = max(n_tok, vocab_size or 0, (max(eos) + 1) if eos else 0)
    if not eos:
        raise ValueError("structured outputs need at least one EOS token id")
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)


class GrammarMatcher:
    """One sequence's position in its grammar (see the module docstring)."""

    __slots__ = ("_m", "_stop_ids", "_stopped_by_extra", "num_tokens", "grammar")

    def __init__(self, matcher: llguidance.LLMatcher, grammar: "CompiledGrammar",
                 stop_token_ids: Iterable[int] = ()) -> None:
        self._m = matcher
        self.grammar = grammar
        vocab = grammar.vocab_size
        extra = {int(t) for t in stop_token_ids if 0 <= int(t) < vocab}
        self._stop_ids = np.array(sorted(extra - set(grammar.eos_token_ids)), dtype=np.int64)
        self._stopped_by_extra = False
        self.num_tokens = 0

    @property
    def ll_matcher(self) -> llguidance.LLMatcher:
        return self._m

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write this sequence's allowed next tokens into `bitmask[row]` (int32, CPU,
        contiguous rows of `grammar.bitmask_width` words; bit t%32 of word t//32)."""
        if self._stopped_by_extra or self._m.is_error():
            self._allow_only_stops(bitmask, row)
            return
        _fill_row(self._m, bitmask, row)
        self._post_fill(bitmask, row)

    def _post_fill(self, bitmask: torch.Tensor, row: int) -> None:
        """After llguidance wrote the row: the request's own stop ids join EOS."""
        if self._stop_ids.size and self._m.is_accepting():
            _set_bits(bitmask, row, self._stop_ids)

    def _allow_only_stops(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        _set_bits(bitmask, row, np.array(self.grammar.eos_token_ids, dtype=np.int64))
        if self._stop_ids.size:
            _set_bits(bitmask, row, self._stop_ids)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar forbids it."""
        if self._stopped_by_extra:
            return False
        token_id = int(token_id)
        if self._stop_ids.size and token_id in self._stop_ids and self._m.is_accepting():
            self._stopped_by_extra = True
            self.num_tokens += 1
            return True
        if self._m.try_consume_tokens([token_id]) != 1:
            return False
        self.num_tokens += 1
        return True

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Advance by several tokens (re-attaching a matcher to existing output); returns how
        many were accepted before the first forbidden one."""
        n = 0
        for t in token_ids:
            if not self.accept(t):
                break
            n += 1
        return n

    def engine_error(self) -> str | None:
        """The grammar engine's own error (a limit it reached: an Earley row, lexer
        expressions, fuel), or None; a token the grammar merely forbids is not one."""
        if self._m.is_error():
            return " ".join(self._m.get_error().split())[:MAX_ERROR_CHARS]
        return None

    def is_terminated(self) -> bool:
        """The grammar is complete and admits no further token (only EOS/stop): finish."""
        return self._stopped_by_extra or self._m.is_stopped()

    def is_accepting(self) -> bool:
        """The output so far is a complete match (it may still be extended)."""
        return self._stopped_by_extra or self._m.is_accepting()

    def rollback(self, num_tokens: int) -> None:
        """Withdraw the last `num_tokens` accepted tokens (speculative tokens rejected, ...)."""
        if num_tokens < 0 or num_tokens > self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens; "
                             f"{self.num_tokens} were accepted")
        if num_tokens == 0:
            return
        n = num_tokens
        if self._stopped_by_extra:
            self._stopped_by_extra = False
            n -= 1
        if n and not self._m.rollback(n):
            raise RuntimeError(f"grammar matcher could not roll back {n} tokens: "
                               f"{self._m.get_error()}")
        self.num_tokens -= num_tokens

    def reset(self) -> None:
        self._m.reset()
        self._stopped_by_extra = False
        self.num_tokens = 0

    def __repr__(self) -> str:
        return (f"GrammarMatcher({self.grammar.kind}, tokens={self.num_tokens}, "
                f"accepting={self.is_accepting()}, terminated={self.is_terminated()})")


def _fill_row(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """llguidance writes the row in place (what `llguidance.torch.fill_next_token_bitmask`
    does; that module is not imported because it sets up torch.compile at import time)."""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
        raise ValueError("the bitmask must be a 2-D int32 CPU tensor")
    v = bitmask[row]
    if not v.is_contiguous():
        raise ValueError("bitmask rows must be contiguous")
    matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)


def _set_bits(bitmask: torch.Tensor, row: int, ids: np.ndarray) -> None:
    words = bitmask[row].numpy().view(np.uint32)      # shares memory with the tensor
    np.bitwise_or.at(words, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))


class CompiledGrammar:
    """A checked grammar, ready to hand out matchers (one per sequence)."""

    __slots__ = ("key", "kind", "grammar", "vocab_size", "eos_token_ids", "_template",
                 "compile_seconds")

    def __init__(self, key: tuple, kind: str, grammar: str, template: llguidance.LLMatcher,
                 vocab_size: int, eos_token_ids: Sequence[int], compile_seconds: float) -> None:
        self.key = key
        self.kind = kind
        self.grammar = grammar            # llguidance's grammar text (for logs and traces)
        self._template = template         # never advanced: copies start from here
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.compile_seconds = compile_seconds

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def matcher(self, stop_token_ids: Iterable[int] = ()) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar. `stop_token_ids`: the request's own
        stop tokens, allowed (and ending the match) wherever EOS is."""
        return GrammarMatcher(self._template.deep_copy(), self, stop_token_ids)


class StructuredOutputCompiler:
    """Compiles `StructuredOutputsParams` for one tokenizer; thread-safe.

    `limits`: an `llguidance.LLParserLimits` bounding grammar size, lexer states and
    per-step work (llguidance's defaults otherwise); a grammar over them fails to compile.
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, *,
                 eos_token_ids: Iterable[int] | None = None,
                 compile_timeout: float = DEFAULT_COMPILE_TIMEOUT, cache_size: int = 256,
                 limits: llguidance.LLParserLimits | None = None, max_workers: int = 2,
                 max_overrun_workers: int = 4) -> None:
        self.ll_tokenizer = build_ll_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = self.ll_tokenizer.vocab_size
        self.eos_token_ids = list(self.ll_tokenizer.eos_tokens)
        self.compile_timeout = compile_timeout
        # Short errors: the verbose ones hold the whole grammar and parser state (a 100 KB
        # grammar gave a 300 KB 400 body) and may leak a schema into logs.
        self._limits = limits or llguidance.LLParserLimits(**PARSER_LIMITS)
        self._cache: collections.OrderedDict[tuple, CompiledGrammar | GrammarCompileError] = \
            collections.OrderedDict()
        self._cache_size = cache_size
        self._inflight: dict[tuple, concurrent.futures.Future] = {}
        self._pinned: dict[tuple, list] = {}        # key -> [grammar, holders]
        self._lock = threading.Lock()
        # Big-stack, lower-priority threads (structured/workers.py); compiles that overrun
        # their budget keep theirs and up to `max_overrun_workers` more start meanwhile.
        self._pool = WorkerPool("grammar-compile", max_workers,
                                max_workers=max_workers + max_overrun_workers,
                                nice=COMPILE_NICE)
        self.num_compiled = 0
        self.num_cache_hits = 0
        self.num_timeouts = 0

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return allocate_bitmask(num_rows, self.vocab_size)

    # --- compile ------------------------------------------------------------------------
    def compile(self, params: StructuredOutputsParams, timeout: float | None = None
                ) -> CompiledGrammar:
        """The compiled grammar for `params`, from the cache or built within `timeout`
        (default `compile_timeout`) seconds. Raises GrammarCompileError (bad constraint)
        or GrammarCompileTimeout; both are StructuredOutputsError, i.e. a 400."""
        future = self._future(params)
        if isinstance(future, CompiledGrammar):
            return future
        timeout = self.compile_timeout if timeout is None else timeout
        try:
            result = future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise self._timeout_error(params, timeout) from None
        return self._unwrap(result)

    async def compile_async(self, params: StructuredOutputsParams,
                            timeout: float | None = None) -> CompiledGrammar:
        """`compile` for an event loop: waits without blocking it."""
        future = self._future(params)
        if isinstance(future, CompiledGrammar):
            return future
        timeout = self.compile_timeout if timeout is None else timeout
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                            timeout)
        except asyncio.TimeoutError:
            raise self._timeout_error(params, timeout) from None
        return self._unwrap(result)

    def cached(self, params: StructuredOutputsParams) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(params.cache_key())
        return hit if isinstance(hit, CompiledGrammar) else None

    @contextlib.contextmanager
    def pinned(self, grammar: CompiledGrammar) -> Iterator[CompiledGrammar]:
        """Within the block, `compile` of the same constraint returns `grammar` whatever the
        cache evicted: a caller that compiled off the engine thread (AsyncEngine) hands the
        engine thread a grammar it can never have to build itself."""
        with self._lock:
            entry = self._pinned.setdefault(grammar.key, [grammar, 0])
            entry[1] += 1
        try:
            yield grammar
        finally:
            with self._lock:
                entry[1] -= 1
                if entry[1] <= 0:
                    self._pinned.pop(grammar.key, None)

    def warm(self) -> float:
        """Compile and use a small grammar once (a JSON object: the lexer, the parser, a mask,
        the bitmask's penalty table), so the first real constrained request pays none of the
        one-time costs. Returns the seconds it took."""
        import time
        from iterserve.structured.bitmask import GrammarBitmask

        t0 = time.perf_counter()
        g = self.compile(StructuredOutputsParams(json_object=True), timeout=60)
        m = g.matcher()
        mask = GrammarBitmask.fill({"warm": m})
        logits = torch.zeros((1, self.vocab_size), dtype=torch.float32)
        mask.apply(logits, ["warm"])
        m.accept(int(torch.argmax(logits[0]).item()))
        return time.perf_counter() - t0

    def close(self) -> None:
        self._pool.shutdown()

    def _future(self, params: StructuredOutputsParams
                ) -> CompiledGrammar | concurrent.futures.Future:
        if not isinstance(params, StructuredOutputsParams):
            raise TypeError(f"expected StructuredOutputsParams, got {type(params).__name__}")
        key = params.cache_key()
        with self._lock:
            pin = self._pinned.get(key)
            if pin is not None:
                return pin[0]
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                if isinstance(hit, StructuredOutputsError):
                    raise _fresh(hit, self._param(params))
                return hit
            future = self._inflight.get(key)
            new = future is None
            if new:
                future = self._pool.submit(self._build, params, key)
                self._inflight[key] = future
        if new:   # outside the lock: a future already done runs the callback right here
            future.add_done_callback(lambda f, key=key: self._store(key, f))
        return future

    def _store(self, key: tuple, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._inflight.pop(key, None)
            if future.cancelled() or future.exception() is not None:
                return
            self._cache[key] = future.result()
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def _unwrap(self, result: CompiledGrammar | StructuredOutputsError) -> CompiledGrammar:
        if isinstance(result, StructuredOutputsError):
            raise _fresh(result, result.param)
        return result

    @staticmethod
    def _param(params: StructuredOutputsParams) -> str:
        return params.source or f"structured_outputs.{params.kind}"

    def _timeout_error(self, params: StructuredOutputsParams, timeout: float
                       ) -> GrammarCompileTimeout:
        log.warning("structured output %s did not compile within %.3gs", params.kind, timeout)
        self.num_timeouts += 1
        return GrammarCompileTimeout(
            f"{self._param(params)}: the constraint did not compile within {timeout:g} s; "
            "simplify it", self._param(params))

    def _grammar_text(self, params: StructuredOutputsParams) -> str:
        kind, value = params.kind, params.value
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else value
            options = ({"whitespace_flexible": False} if params.disable_any_whitespace
                       else {"whitespace_pattern": JSON_WHITESPACE})
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            # One terminal (a lexeme), not one Earley alternative per item: a row of the
            # parser holds every alternative of a rule (llguidance caps a row at 2,000 items),
            # while a lexeme's alternatives cost the lexer only (20,000: 0.4 s, no row).
            return llguidance.LLMatcher.grammar_from_lark(
                "start: CHOICE\nCHOICE: "
                + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
        return llguidance.grammar_from("grammar", value)

    def _build(self, params: StructuredOutputsParams, key: tuple
               ) -> CompiledGrammar | GrammarCompileError:
        """Runs on a compile worker (llguidance drops the GIL while it builds): the limits
        first (structured/limits.py), then the grammar, its first mask and a probe."""
        import time
        t0 = time.perf_counter()
        param = self._param(params)
        try:
            _limits.check(params, param)
        except _limits.ConstraintLimitError as exc:
            return exc
        try:
            grammar = self._grammar_text(params)
        except (ValueError, TypeError) as exc:
            return GrammarCompileError(f"{param}: {_short(str(exc))}", param)
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0,
                                        limits=self._limits)
        if not template.is_error():
            # The first mask builds the lexer's start state: a grammar whose lexer blows its
            # limits fails here, at compile time, rather than in the engine's first step.
            scratch = torch.zeros((1, self.bitmask_width), dtype=torch.int32)
            _fill_row(template, scratch, 0)
            if not template.is_error():
                probe_error = self._probe(template, scratch)
                if probe_error is not None:
                    return GrammarCompileError(
                        f"{param} is beyond what the grammar engine can follow: "
                        f"{_short(probe_error)}; simplify it", param)
        if template.is_error():
            return GrammarCompileError(f"{param} is not a valid {params.kind} constraint: "
                                       f"{_short(template.get_error())}", param)
        self.num_compiled += 1
        return CompiledGrammar(key, params.kind, grammar, template, self.vocab_size,
                               self.eos_token_ids, time.perf_counter() - t0)

    def _probe(self, template: llguidance.LLMatcher, mask: torch.Tensor) -> str | None:
        """Try a few of the first allowed tokens on copies of the matcher, with the mask after
        each: a constraint whose first token already overruns the engine's limits (an Earley
        row over 2,000 items, "too many expressions" in the lexer) is refused now, with a 400,
        instead of failing in the middle of generation. None: every probe passed."""
        words = mask[0].numpy().view(np.uint32)
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
        eos = set(self.eos_token_ids)
        allowed = [int(t) for t in allowed if int(t) not in eos and int(t) < self.vocab_size]
        if not allowed:
            return None
        picks = sorted({allowed[0], allowed[len(allowed) // 2], allowed[-1]})[:PROBE_TOKENS]
        scratch = torch.zeros_like(mask)
        for t in picks:
            m = template.deep_copy()
            m.try_consume_tokens([t])
            if not m.is_error() and not m.is_stopped():
                _fill_row(m, scratch, 0)
            if m.is_error():
                return m.get_error()
        return None


def _fresh(err: StructuredOutputsError, param: str | None) -> StructuredOutputsError:
    """A new exception like the cached `err` (a cached one must not collect tracebacks)."""
    import copy
    e = copy.copy(err)
    e.param = param
    e.__traceback__ = None
    return e


def _short(message: str) -> str:
    message = " ".join(message.strip().split())
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."

"""The input side of the engine: from what a caller sends to the scheduler's Requests.

    prompt (text or token ids) + SamplingParams
        -> tokenise, check the vocabulary and the context length, validate the params
        -> one scheduler `Request` per sequence (n > 1 fans out into n of them)

Everything here can refuse a request, and does so before any state exists anywhere, with the
precise ValueErrors of iterserve/errors.py (HTTP 400 in the server). The fan-out rule, as in
vLLM: sequence i of a request with `n > 1` is its own scheduler request `<id>-n<i>` with
n = 1 and, when the request is seeded, seed + i, so it samples exactly what a single request
with that seed would.

Constrained sampling is resolved here too, once per request: `structured_outputs` is
compiled (`structured.backend.StructuredOutputCompiler`, built on the first constrained
request: ~0.15 s) and a bad schema or a compile timeout is a StructuredOutputsError naming
the field; `bad_words` are tokenised, `logit_bias` and `allowed_token_ids` checked against
the vocabulary (model.logits_processors), and the ids min_tokens holds back are worked out.
The results ride on each sequence's SamplingParams (plain data) and, for the grammar, on
the ProcessedRequest: the output processor gives every sequence its own matcher.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from iterserve.core.request import PoolingParams, Request, SamplingParams
from iterserve.errors import (EmptyPromptError, InvalidRequestError, LogitsParamError,
                              MaxTokensTooLargeError, PromptTooLongError, TokenIdOutOfRangeError,
                              WrongRunnerError)


@dataclass(eq=False)
class ProcessedRequest:
    """A validated request, ready for the scheduler (`requests`) and the output processor."""

    request_id: str
    prompt: str | None               # the text, when known (for outputs and traces)
    prompt_token_ids: list[int]
    params: SamplingParams           # as the caller sent them
    priority: int
    arrival_time: float
    arrival_wall_time: float
    requests: list[Request]          # one per sequence, by index, with per-sequence params
    grammar: Any = None              # structured.backend.CompiledGrammar, when constrained
    pooling_params: PoolingParams | None = None   # a pooling request (an embedding)


class InputProcessor:
    """`max_logprobs` (--max-logprobs; -1: the vocabulary) bounds what a request's logprobs
    and prompt_logprobs may ask for; `structured_outputs_config` (vLLM's
    --structured-outputs-config) gives every constrained request its server-wide
    defaults: disable_any_whitespace, and disable_additional_properties (a JSON schema's
    objects take only the keys they declare unless they allow others explicitly)."""

    def __init__(self, tokenizer: Any, *, vocab_size: int, max_model_len: int,
                 eos_token_ids: Iterable[int] = (),
                 clock: Callable[[], float] = time.monotonic, max_logprobs: int = -1,
                 structured_outputs_config: dict[str, Any] | None = None,
                 pooler_config: Any = None) -> None:
        self.tokenizer = tokenizer
        # Served as an embedding model (model.pooler.PoolerConfig): every request is a
        # pooling request; None: every request generates.
        self.pooler_config = pooler_config
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
        self.structured_defaults = dict(structured_outputs_config or {})
        # The scheduler's Request carries one eos id; the model's others become stop tokens.
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.clock = clock
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()

    @property
    def structured_compiler(self) -> Any:
        """The grammar compiler for this tokenizer (built on first use; the server may call
        `compile_async` on it before add_request, which then finds the grammar cached)."""
        if self._compiler is None:
            with self._compiler_lock:     # the server's event loop may ask first
                if self._compiler is None:
                    # llguidance and torch: once a request asks for structured outputs
                    from iterserve.structured.backend import StructuredOutputCompiler
                    try:
                        self._compiler = StructuredOutputCompiler(
                            self.tokenizer, self.vocab_size,
                            eos_token_ids=self.eos_token_ids or None)
                    except (ValueError, TypeError, AttributeError) as e:
                        raise InvalidRequestError(
                            f"structured outputs are not available for this model's "
                            f"tokenizer: {e}", "structured_outputs") from e
        return self._compiler

    # --- checks --------------------------------------------------------------------------
    @staticmethod
    def check_request_id(request_id: Any) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", "request_id")

    def tokenize_prompt(self, prompt: str | Sequence[int], *, add_special_tokens: bool = True
                        ) -> list[int]:
        """Token ids of `prompt`, validated against the vocabulary (no length checks)."""
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPromptError("the prompt is empty", "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, dict):
            raise InvalidRequestError(
                "the prompt is a dict: LLMEngine takes a string or a list of token ids "
                "(LLM.generate also takes {'prompt': ...} and {'prompt_token_ids': [...]})",
                "prompt")
        ids = list(prompt)
        if not ids:
            raise EmptyPromptError("the prompt is empty (no token ids)", "prompt")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise TokenIdOutOfRangeError(
                    f"prompt token {i} is {t!r}, not an integer token id", "prompt")
            if not 0 <= t < self.vocab_size:
                raise TokenIdOutOfRangeError(
                    f"prompt token id {t} (position {i}) is outside the vocabulary "
                    f"[0, {self.vocab_size})", "prompt")
        return ids

    def check_lengths(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {num_prompt_tokens} tokens, but this model's maximum context "
                f"length is {self.max_model_len} tokens (prompt and output together)", "prompt")
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise MaxTokensTooLargeError(
                f"this model's maximum context length is {self.max_model_len} tokens; you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the prompt, {max_tokens} in the completion)", "max_tokens")

    def check_params(self, params: SamplingParams) -> None:
        params.validate()
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise InvalidRequestError(
                    f"Requested {name} of {k}, which is greater than max allowed: "
                    f"{self.max_logprobs} (the server's --max-logprobs)", name)

    # --- the request ---------------------------------------------------------------------
    def process(self, request_id: str, prompt: str | Sequence[int],
                params: SamplingParams | None = None, *, priority: int = 0,
                arrival_time: float | None = None, timeout: float | None = None,
                prompt_text: str | None = None) -> ProcessedRequest:
        """Validate and tokenise; the scheduler requests of all n sequences (one for a
        pooling request)."""
        if isinstance(params, PoolingParams) or (params is None and self.pooler_config):
            return self.process_pooling(request_id, prompt, params or PoolingParams(),
                                        priority=priority, arrival_time=arrival_time,
                                        timeout=timeout, prompt_text=prompt_text)
        if self.pooler_config is not None:
            raise WrongRunnerError(
                "this model is served as an embedding model (--runner pooling): it answers "
                "/v1/embeddings, /v1/score and /rerank, and generates no text", "model")
        params = params or SamplingParams()
        self.check_request_id(request_id)
        self.check_params(params)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", "priority")
        prompt_ids = self.tokenize_prompt(prompt)
        self.check_lengths(len(prompt_ids), params.max_tokens)
        params, grammar = self.resolve_constraints(params)
        now = self.clock() if arrival_time is None else arrival_time
        deadline = now + timeout if timeout is not None else None
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        n = params.num_sequences          # best_of > n: best_of sequences, n returned
        requests = [
            Request(request_id if n == 1 else f"{request_id}-n{i}", prompt_ids,
                    self.sequence_params(params, i), priority=priority, arrival_time=now,
                    eos_token_id=eos, deadline=deadline, user_data=request_id)
            for i in range(n)]
        return ProcessedRequest(request_id, prompt if isinstance(prompt, str) else prompt_text,
                                prompt_ids, params, priority, now, time.time(), requests,
                                grammar)

    def process_pooling(self, request_id: str, prompt: str | Sequence[int],
                        params: PoolingParams, *, priority: int = 0,
                        arrival_time: float | None = None, timeout: float | None = None,
                        prompt_text: str | None = None) -> ProcessedRequest:
        """A pooling request: its prompt (at most max_model_len tokens: nothing is generated
        after it) and `dimensions` checked against the model's pooler."""
        cfg = self.pooler_config
        if cfg is None:
            raise WrongRunnerError(
                "this model is served for text generation: embeddings need a server started "
                "with --runner pooling (or --convert embed) on an embedding model", "model")
        self.check_request_id(request_id)
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError("a pooling request takes PoolingParams", "params")
        params.validate()
        cfg.check_dimensions(params.dimensions)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", "priority")
        prompt_ids = self.tokenize_prompt(prompt)
        if len(prompt_ids) > self.max_model_len:
            raise PromptTooLongError(
                f"the input has {len(prompt_ids)} tokens, but this model's maximum context "
                f"length is {self.max_model_len} tokens", "input")
        if params.reads_every_row != cfg.reads_every_row:
            params = dataclasses.replace(params, reads_every_row=cfg.reads_every_row)
        now = self.clock() if arrival_time is None else arrival_time
        deadline = now + timeout if timeout is not None else None
        req = Request(request_id, prompt_ids, priority=priority, arrival_time=now,
                      deadline=deadline, user_data=request_id, pooling_params=params)
        return ProcessedRequest(request_id, prompt if isinstance(prompt, str) else prompt_text,
                                prompt_ids, req.sampling_params, priority, now, time.time(),
                                [req], pooling_params=params)

    def resolve_constraints(self, params: SamplingParams) -> tuple[SamplingParams, Any]:
        """(params with the derived constraint data filled in, compiled grammar or None).
        A request that uses none of the constrained-sampling fields passes untouched."""
        if not (params.structured_outputs is not None or params.logit_bias
                or params.allowed_token_ids or params.bad_words or params.min_tokens):
            return params, None
        # torch: only for a request with logit_bias, allowed/bad tokens or min_tokens
        from iterserve.model.logits_processors import (bad_words_token_ids, validate_logit_bias,
                                                       validate_token_ids)
        changes: dict[str, Any] = {}
        try:
            if params.logit_bias:
                changes["logit_bias"] = validate_logit_bias(params.logit_bias, self.vocab_size)
            if params.allowed_token_ids:
                changes["allowed_token_ids"] = validate_token_ids(
                    params.allowed_token_ids, self.vocab_size, "allowed_token_ids")
            if params.bad_words:
                changes["bad_words_token_ids"] = bad_words_token_ids(
                    self.tokenizer, params.bad_words) or None
        except LogitsParamError as e:
            raise InvalidRequestError(str(e), e.param) from None
        if params.min_tokens:
            eos = () if params.ignore_eos else self.eos_token_ids
            changes["all_stop_token_ids"] = tuple(sorted(set(eos) | set(params.stop_token_ids)))
        grammar = None
        if params.structured_outputs is not None:
            so = self._with_server_defaults(params.structured_outputs)
            if so is not params.structured_outputs:
                changes["structured_outputs"] = so
            grammar = self.structured_compiler.compile(so)
        return (dataclasses.replace(params, **changes) if changes else params), grammar

    def _with_server_defaults(self, so: Any) -> Any:
        """The request's constraint with --structured-outputs-config's defaults applied."""
        d = self.structured_defaults
        changes: dict[str, Any] = {}
        if d.get("disable_any_whitespace") and not so.disable_any_whitespace:
            changes["disable_any_whitespace"] = True
        if d.get("disable_additional_properties") and so.kind == "json":
            # the tools package (its parsers and chat formats) loads only for this option
            from iterserve.tools.schema import closed_schema
            schema = json.loads(so.json) if isinstance(so.json, str) else so.json
            closed = closed_schema(schema)
            if closed != schema:
                changes["json"] = closed
        return dataclasses.replace(so, **changes) if changes else so

    def sequence_params(self, params: SamplingParams, i: int) -> SamplingParams:
        """Sequence i's own params: n = 1, seed + i, every eos id of the model as a stop,
        prompt_logprobs on sequence 0 only."""
        changes: dict[str, Any] = {"n": 1, "best_of": None}
        if params.num_sequences > params.n and params.logprobs is None:
            changes["logprobs"] = 0              # best_of ranks by the sampled logprobs
        if i and params.prompt_logprobs is not None:
            changes["prompt_logprobs"] = None    # one sequence computes them (same prompt)
        if params.seed is not None:
            changes["seed"] = params.seed + i
        if not params.ignore_eos and len(self.eos_token_ids) > 1:
            extra = [t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids]
            changes["stop_token_ids"] = list(params.stop_token_ids) + extra
        changes["stop"] = list(params.stop)
        return dataclasses.replace(params, **changes)

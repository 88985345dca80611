"""Every error iterserve raises on purpose: one hierarchy, where whose fault it is decides the
HTTP answer, not the Python base class.

    IterserveError
    ├── ClientError (also a ValueError)       the request or the input is wrong   -> 4xx
    │   ├── InvalidRequestError               400, `param` names the field
    │   │   ├── EmptyPromptError, TokenIdOutOfRangeError, PromptTooLongError,
    │   │   │   MaxTokensTooLargeError, DuplicateRequestIdError
    │   │   ├── UnsupportedParameterError     a field iterserve does not implement (yet)
    │   │   └── UnknownModelError             404
    │   ├── RequestTooLargeError              413 (the body-size limit)
    │   ├── SamplingParamsError               SamplingParams.validate()
    │   ├── LogitsParamError                  logit_bias, allowed_token_ids, bad_words
    │   ├── StructuredOutputsError            a structured-output spec
    │   │   ├── GrammarCompileError           not a grammar the engine can use
    │   │   │   └── GrammarCompileTimeout     it did not compile in time
    │   │   ├── ConstraintTooComplexError     over a documented limit, or beyond the grammar
    │   │   │                                 engine's own limits while it generates
    │   │   └── ToolChoiceError               `tools` / `tool_choice`
    │   ├── ChatTemplateError                 the conversation cannot be rendered
    │   ├── ConfigError                       a knob with a value that cannot work
    │   └── WorkloadError, LabOptionsError, CostModelError, CalibrationError,
    │       BenchClientError, SLOError, OfflineBenchError   the lab's and the benchmarks' input
    ├── ServerError (also a RuntimeError)     the server is at fault              -> 5xx
    │   ├── EngineDeadError                   503: the engine loop stopped
    │   ├── ReplicaDiedError                  503: a data-parallel replica died mid-request
    │   ├── NoHealthyReplicaError             503: no replica can take the request
    │   ├── RankFailedError                   a tensor-parallel rank died
    │   ├── KVCacheError                      a block id outside the pools (an engine bug)
    │   ├── NoFreeBlocksError                 an allocation without a free-block check (a bug)
    │   ├── KernelsUnavailable                a C-kernel wrapper called without the kernels
    │   ├── SimulationError                   the scheduler broke a lab invariant (a bug)
    │   ├── RayNotInstalledError              --data-parallel-size without Ray Serve
    │   ├── RayExposedError                   a local Ray cluster listening beyond loopback
    │   ├── DefaultModelMissing               the bundled model is not installed
    │   └── ModelLoadError (also a ValueError)   the model cannot be loaded
    │       ├── UnsupportedModelError         an architecture iterserve does not implement
    │       ├── InsufficientMemoryError       model + KV cache do not fit
    │       ├── GGUFLoadError                 not a GGUF file iterserve can load
    │       └── TokenizerLoadError            tokenizer files it cannot build
    └── QueueFullError (also a RuntimeError)  busy, not wrong: 503 + Retry-After
        └── SLOUnattainableError              429 + Retry-After, or 400 when waiting cannot help

The HTTP answer is all in the error: `status_code`, `error_type`, `code`, `param`,
`http_message()` and `retry_after_s` (a Retry-After header), so server/errors.py renders any
of them as an OpenAI body without knowing one class from another. Anything that is not an
IterserveError and escapes a route is a bug: a 500 with an OpenAI body.

Why some types sit where they do:
- ChatTemplateError is a client error: it is raised for a malformed message list, for a
  conversation the template itself refuses (its `raise_exception`, e.g. roles out of order)
  and for a template that fails on *these* messages; the same template renders other
  conversations, so the client can fix its request. (A template that does not compile at all
  is also reported through it, as a 400 naming the template; that case is an operator
  mistake found at the first chat request.)
- ModelLoadError is a server fault: nothing in a request can cause or fix it. It stays a
  ValueError too, because at startup it is the operator's bad argument (`--model /no/such`)
  and the CLIs exit 2 on ValueErrors; the server maps by status, and its status is 500.
  DefaultModelMissing stays a FileNotFoundError for the same reason.
- KVCacheError is a server fault: the pools were sized by the engine; a bad block id or swap
  pair means the engine's books are wrong.
- QueueFullError is neither: the request is fine and so is the server, which is full
  (max_queued_requests); the client should come back. The scheduler's ValueErrors from
  `add_request` ("can never fit") are the request's fault and AsyncEngine re-raises them as
  InvalidRequestError.
- The lab's and the benchmarks' errors are bad input (an option, a file, a workload): client
  errors, which their CLIs print as one line and exit 2 on, and the lab's HTTP endpoints
  answer 400.

This module imports nothing: every layer may raise these.
"""

from __future__ import annotations

import math


class IterserveError(Exception):
    """Root of iterserve's own errors; `status_code` / `error_type` / `code` / `param` are
    the HTTP answer, `retry_after_s` (when not None) its Retry-After header."""

    status_code: int = 500
    error_type: str = "internal_error"
    code: str | None = None
    retry_after_s: float | None = None

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None):
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code

    def http_message(self) -> str:
        """The message an HTTP client is shown."""
        return str(self)

    def http_headers(self) -> dict[str, str]:
        """Headers of the HTTP answer: Retry-After (whole seconds, at least 1) when the
        client may come back."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class ClientError(IterserveError, ValueError):
    """The request is wrong; the message is fit for a 4xx body. A ValueError too, as Python
    code (the offline API, tests) expects for a bad argument."""

    status_code = 400
    error_type = "invalid_request_error"


class ServerError(IterserveError, RuntimeError):
    """The server is at fault (a bug, a broken model, a dead engine); answered 5xx, with the
    error's type in the message (it is not the client's to fix)."""

    status_code = 500
    error_type = "internal_error"

    def http_message(self) -> str:
        return f"internal server error: {type(self).__name__}: {self}"


# --- the request ---------------------------------------------------------------------------

class InvalidRequestError(ClientError):
    """The request cannot be served as given; the message is fit for an HTTP 400 body."""


class EmptyPromptError(InvalidRequestError):
    """The prompt has no tokens (an empty string or an empty token list)."""


class TokenIdOutOfRangeError(InvalidRequestError):
    """A prompt token id is not in the model's vocabulary."""


class PromptTooLongError(InvalidRequestError):
    """The prompt leaves no room for even one generated token within max_model_len."""


class MaxTokensTooLargeError(InvalidRequestError):
    """prompt tokens + max_tokens exceed max_model_len."""


class DuplicateRequestIdError(InvalidRequestError):
    """A request with this id is still being served."""


class UnsupportedParameterError(InvalidRequestError):
    """A request field iterserve does not implement (yet), set to a value that would matter:
    refused by name rather than silently ignored."""

    code = "unsupported_parameter"


class WrongRunnerError(InvalidRequestError):
    """The request needs what this server's model is not served as: an embedding request
    to a text-generation server, or a completion to an embedding (pooling) server."""

    code = "model_not_supported"


class UnknownModelError(InvalidRequestError):
    """The request names a model this server does not serve (HTTP 404)."""

    status_code = 404
    error_type = "not_found_error"
    code = "model_not_found"


class RequestTooLargeError(ClientError):
    """The request body exceeds --max-request-body-bytes (HTTP 413)."""

    status_code = 413


class SamplingParamsError(ClientError):
    """Raised by SamplingParams.validate() with a message fit for an HTTP 400 body."""


class LogitsParamError(ClientError):
    """A request field the logits processors cannot take; `param` names it (HTTP 400)."""


class StructuredOutputsError(ClientError):
    """A structured-output spec the server must refuse (HTTP 400); `param` names the field."""


class GrammarCompileError(StructuredOutputsError):
    """The constraint is not a grammar the engine can use (bad schema, regex, EBNF...)."""


class GrammarCompileTimeout(GrammarCompileError):
    """Compiling the constraint took longer than the compiler's `compile_timeout`."""


class ConstraintTooComplexError(StructuredOutputsError):
    """A constraint too complex to honour: over a documented limit (structured/limits.py,
    checked before compiling) or, mid-generation, beyond the grammar engine's own limits at
    that length (its sequence ends with finish_reason "error"; the answer is this 400)."""

    code = "constraint_too_complex"


class ToolChoiceError(StructuredOutputsError):
    """`tools` / `tool_choice` the server must refuse (400); `param` names the field."""


class ChatTemplateError(ClientError):
    """The messages cannot be rendered: malformed input, no template, or the template refused.
    `param` is "messages" unless the error names another field."""

    def __init__(self, message: str, param: str | None = "messages", *,
                 code: str | None = None):
        super().__init__(message, param, code=code)


# --- knobs and the lab's / benchmarks' input -----------------------------------------------

class ConfigError(ClientError):
    """A knob has a value that cannot work; the message names the knob (`knob` holds it)."""

    def __init__(self, message: str, knob: str | None = None):
        super().__init__(message, knob)
        self.knob = knob


class WorkloadError(ClientError):
    """A workload that cannot be drawn, read or built (the lab's output/prompt lengths,
    ranges, a lengths file; the benchmark client's workload names, rates, length families);
    the message names the option, file or line at fault."""


class LabOptionsError(ClientError):
    """A lab option with a bad value (or an unknown option); the message names it, `option`
    holds it."""

    code = "invalid_lab_option"

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message, option)
        self.option = option


class CostModelError(ClientError):
    """A cost-model file or dict that cannot be used; the message names the key."""


class CalibrationError(ClientError):
    """Bad calibration input (options, grid, timings); the message says which."""


class BenchClientError(ClientError):
    """Bad benchmark-client arguments (URL, endpoint, rates); the message says which."""


class SLOError(ClientError):
    """An --slo specification that cannot be parsed."""


class OfflineBenchError(ClientError):
    """Bad offline-benchmark arguments (batching mode, workload with arrivals)."""


# --- the server's faults -------------------------------------------------------------------

class EngineDeadError(ServerError):
    """The engine loop stopped (shutdown or a fatal error); no request can be served."""

    status_code = 503
    error_type = "service_unavailable"

    def http_message(self) -> str:
        return str(self)


class ReplicaDiedError(ServerError):
    """A replica died (or became unreachable) while serving the request: a 503 with
    Retry-After (another replica, or this one restarted by Ray Serve, serves a retry), and
    mid-stream finish_reason "error" then an error event with the same body."""

    status_code = 503
    error_type = "service_unavailable"
    code = "replica_unavailable"
    retry_after_s = 1

    def http_message(self) -> str:
        return str(self)


class NoHealthyReplicaError(ServerError):
    """No replica can take the request (none given, or all unhealthy): a 503 for the
    client, with a message saying how many replicas there are."""

    status_code = 503
    error_type = "service_unavailable"


class RankFailedError(ServerError):
    """A tensor-parallel rank died or the group broke: the executor cannot run steps."""


class KVCacheError(ServerError):
    """A block id or swap pair is outside the pools."""


class NoFreeBlocksError(ServerError):
    """An allocation was attempted without checking that enough blocks are free (a bug)."""


class KernelsUnavailable(ServerError):
    """A C-kernel wrapper was called while `kernels.available()` is False (see
    `kernels.unavailable`)."""


class SimulationError(ServerError):
    """The scheduler broke an invariant the lab relies on (a bug to report, not bad input)."""


class RayNotInstalledError(ServerError):
    """--data-parallel-size > 1 needs Ray Serve, which is not installed."""


class RayExposedError(ServerError):
    """A local Ray cluster that would listen beyond 127.0.0.1 (anyone reaching it could run
    code on the machine): serving is refused."""


class DefaultModelMissing(ServerError, FileNotFoundError):
    """The bundled model package is not installed (or lacks its GGUF file)."""


class ModelLoadError(ServerError, ValueError):
    """A model path, config or weight file cannot be used; the message says which and why."""


class UnsupportedModelError(ModelLoadError):
    """The config names an architecture iterserve does not implement."""


class InsufficientMemoryError(ModelLoadError):
    """Model + requested KV cache do not fit in the memory available."""


class GGUFLoadError(ModelLoadError):
    """The file is not a GGUF we can load (bad magic, architecture, quant type, tensors)."""


class TokenizerLoadError(ModelLoadError):
    """The tokenizer files or GGUF metadata are missing or describe something we cannot build."""


# --- back-pressure -------------------------------------------------------------------------

class QueueFullError(IterserveError, RuntimeError):
    """The waiting queue holds `max_queued_requests` requests; retry later (HTTP 503 with
    Retry-After: 1)."""

    status_code = 503
    error_type = "service_unavailable"
    retry_after_s = 1.0

    def http_message(self) -> str:
        return f"the server is busy: {self}"


class SLOUnattainableError(QueueFullError):
    """A request that cannot meet its TTFT target, refused before it is queued.

    `retry_after_s`: seconds after which the same request could be admitted in time (the
    queue ahead having drained): a 429 with `Retry-After: ceil(retry_after_s)`. None when it
    could not be even on an idle engine (its prefill alone is slower than its target):
    retrying cannot help, so it is the request's own 400 (param `ttft_slo_ms`).
    """

    code = "slo_unattainable"

    def __init__(self, message: str, *, retry_after_s: float | None,
                 predicted_ttft_s: float, ttft_slo_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.predicted_ttft_s = predicted_ttft_s
        self.ttft_slo_s = ttft_slo_s
        if retry_after_s is None:
            self.status_code, self.error_type = 400, "invalid_request_error"
            self.param = "ttft_slo_ms"
        else:
            self.status_code, self.error_type = 429, "rate_limit_exceeded"

    def http_message(self) -> str:
        return str(self)

    def http_headers(self) -> dict[str, str]:
        """Retry-After in whole seconds (what every HTTP client reads) and retry-after-ms
        (OpenAI's SDKs read it first), both the predicted wait capped at 120 s, the longest
        wait those SDKs honour."""
        if self.retry_after_s is None:
            return {}
        wait = min(self.retry_after_s, 120.0)
        return {"Retry-After": str(max(1, math.ceil(wait))),
                "retry-after-ms": str(max(1, math.ceil(wait * 1000)))}

"""One error hierarchy: whose fault it is decides the HTTP status, not the Python base class.

    IterserveError
    ├── ClientError (also a ValueError)           the request is wrong  -> 4xx
    │   ├── InvalidRequestError                   400, `param` names the field
    │   │   ├── EmptyPromptError, TokenIdOutOfRangeError, PromptTooLongError,
    │   │   │   MaxTokensTooLargeError, DuplicateRequestIdError
    │   │   ├── UnsupportedParameterError         a field iterserve does not implement (yet)
    │   │   └── UnknownModelError                 404
    │   ├── RequestTooLargeError                  413 (the body-size limit)
    │   └── model.chat_template.ChatTemplateError the conversation cannot be rendered
    └── ServerError (also a RuntimeError)         the server is at fault -> 5xx
        ├── EngineDeadError                       503: the engine loop stopped
        ├── model.config.ModelLoadError           the model cannot be loaded (operator's fault)
        └── model.kv_cache.KVCacheError           a block id outside the pools (an engine bug)

Why each model-side type sits where it does:
- ChatTemplateError is a client error: it is raised for a malformed message list, for a
  conversation the template itself refuses (its `raise_exception`, e.g. roles out of order)
  and for a template that fails on *these* messages; the same template renders other
  conversations, so the client can fix its request. (A template that does not compile at all
  is also reported through it, as a 400 naming the template; that case is an operator
  mistake found at the first chat request.)
- ModelLoadError is a server fault: nothing in a request can cause or fix it. It stays a
  ValueError too, because at startup it is the operator's bad argument (`--model /no/such`)
  and the CLIs exit 2 on ValueErrors; the server never maps by ValueError, it maps
  ServerError first.
- KVCacheError is a server fault: the pools were sized by the engine; a bad block id or swap
  pair means the engine's books are wrong.

The server (server/serving_common.py `to_api_error`) answers every IterserveError with its
`status_code` and `error_type`; anything else that escapes a route is a 500 with an OpenAI
body (server/errors.py), never a reset connection. The scheduler's QueueFullError (core, a
RuntimeError: busy, not wrong) is answered 503 + Retry-After; its ValueErrors from
`add_request` ("can never fit") are the request's fault and AsyncEngine re-raises them as
InvalidRequestError. SamplingParamsError (core/request.py) is a ValueError with a `param`,
mapped to 400 by name.
"""

from __future__ import annotations


class IterserveError(Exception):
    """Root of iterserve's own errors; `status_code` / `error_type` are the HTTP answer."""

    status_code: int = 500
    error_type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None):
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code


class ClientError(IterserveError, ValueError):
    """The request is wrong; the message is fit for a 4xx body. A ValueError too, as Python
    code (the offline API, tests) expects for a bad argument."""

    status_code = 400
    error_type = "invalid_request_error"


class ServerError(IterserveError, RuntimeError):
    """The server is at fault (a bug, a broken model, a dead engine); answered 5xx."""

    status_code = 500
    error_type = "internal_error"


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


class UnknownModelError(InvalidRequestError):
    """The request names a model this server does not serve (HTTP 404)."""

    status_code = 404
    error_type = "not_found_error"
    code = "model_not_found"


class RequestTooLargeError(ClientError):
    """The request body exceeds --max-request-body-bytes (HTTP 413)."""

    status_code = 413


class EngineDeadError(ServerError):
    """The engine loop stopped (shutdown or a fatal error); no request can be served."""

    status_code = 503
    error_type = "service_unavailable"

"""Why the engine refuses a request, as precise ValueError subclasses.

Everything here is the caller's fault and maps to HTTP 400 in the server (except
UnknownModelError, 404). `param` names the request field at fault, as OpenAI's error body
does. SamplingParamsError (core/request.py) is the same kind of error for sampling fields.
The scheduler's QueueFullError (a RuntimeError: the server is busy, not the request wrong)
is not one of these; the server answers it with 503.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request cannot be served as given; the message is fit for an HTTP 400 body."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


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


class UnknownModelError(InvalidRequestError):
    """The request names a model this server does not serve (HTTP 404)."""

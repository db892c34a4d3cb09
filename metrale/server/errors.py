"""OpenAI-style errors: one exception type for every HTTP failure, and the engine's errors mapped to it.

Every error body is `{"error": {"message", "type", "param", "code"}}`. The status table:

    400 invalid_request_error   bad JSON, wrong types, invalid parameters, bad messages, prompt too long
    401 authentication_error    --api-key set and the request's bearer token is missing or wrong
    404 invalid_request_error   unknown route, or a model this server does not serve (code model_not_found)
    405 invalid_request_error   wrong method for the route
    408 invalid_request_error   the request body did not arrive in time
    413 invalid_request_error   body over --max-body-bytes
    429 rate_limit_error        the engine's waiting queue is full (Retry-After: 1)
    500 internal_error          a request failed inside the engine
    503 service_unavailable     loading, draining for shutdown, unhealthy, or the request was aborted
"""

from __future__ import annotations

import re

import msgspec

from metrale.errors import EngineUnavailableError, QueueFullError, RequestRejectedError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_error", 503: "service_unavailable"}
_MSGSPEC_PATH = re.compile(r"at `\$\.?([^`]*)`")
_UNAVAILABLE = {"draining": "server is shutting down and accepts no new requests",
                "loading": "model is loading; retry shortly"}


class APIError(Exception):
    """An HTTP error with an OpenAI error body. `reject_reason` names the rejection metric, if any."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 reject_reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.reject_reason = reject_reason

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """Extra response headers: a retry hint on 429 and 503."""
        return [(b"retry-after", b"1")] if self.status in (429, 503) else []

    def body(self) -> dict:
        """The OpenAI error object."""
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "internal_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 for a request the server itself refuses (counted as invalid_request)."""
    return APIError(400, message, param=param, reject_reason="invalid_request")


def from_decode_error(error: msgspec.DecodeError) -> APIError:
    """A 400 for an unparsable body or one of the wrong shape; `param` is the offending field's path."""
    match = _MSGSPEC_PATH.search(str(error))
    param = match.group(1) or None if match else None
    return bad_request(f"invalid request body: {error}", param)


def from_engine_error(error: Exception, param_names: tuple[str, ...] = ()) -> APIError | None:
    """Map an exception raised by `engine.generate`/`engine.chat` at submit time; None if not ours.

    The engine's typed errors carry their status and code (metrale.errors); it has already counted
    its own rejections, so these carry no `reject_reason`. Other ValueError / TypeError (e.g. bad
    SamplingParams) are a 400 naming the field the message names.
    """
    if isinstance(error, EngineUnavailableError):
        return APIError(error.http_status, _UNAVAILABLE.get(error.code, str(error)), code=error.code)
    if isinstance(error, RequestRejectedError):
        message = f"server is busy: {error}" if isinstance(error, QueueFullError) else str(error)
        return APIError(error.http_status, message, param=guess_param(str(error), param_names), code=error.code)
    if isinstance(error, (ValueError, TypeError)):
        message = str(error)
        return APIError(400, message, param=guess_param(message, param_names))
    return None


def guess_param(message: str, param_names: tuple[str, ...]) -> str | None:
    """The first request field named in a validation message (SamplingParams names its field)."""
    for name in sorted(param_names, key=len, reverse=True):
        if re.search(rf"\b{re.escape(name)}\b", message):
            return name
    return None

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

The engine's errors get their status from their type (STATUS_OF_ERROR below) and their `param` from the
`field` they carry (metrale/errors.py); nothing is read from a message except msgspec's decode errors,
whose path is the only place it says which field failed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec

from metrale.errors import EngineUnavailableError, LoraNotFoundError, QueueFullError, RequestRejectedError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
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


# The engine's error types and the status each gets: the first type the error is an instance of wins.
STATUS_OF_ERROR: tuple[tuple[type[Exception], int], ...] = (
    (QueueFullError, 429),
    (LoraNotFoundError, 404),  # unloaded between the model lookup and the submit
    (RequestRejectedError, 400),
    (EngineUnavailableError, 503),
)


def status_of(error: Exception) -> int | None:
    """The HTTP status of an engine error (STATUS_OF_ERROR), None for an error that is not the engine's."""
    return next((status for kind, status in STATUS_OF_ERROR if isinstance(error, kind)), None)


def from_engine_error(error: Exception, renames: Mapping[str, str] | None = None) -> APIError | None:
    """Map an exception raised by `engine.generate`/`engine.chat` at submit time; None if not ours.

    The status comes from the error's type (STATUS_OF_ERROR), `code` and `param` from what it carries:
    `param` is its `field` (the engine's parameter name), renamed to the endpoint's request field by
    `renames` (e.g. {"prompt": "messages"} for chat). The engine has already counted its own rejections,
    so these carry no `reject_reason`. Other ValueError / TypeError are a 400 (naming their `field` when
    they have one).
    """
    status = status_of(error)
    if isinstance(error, EngineUnavailableError):
        return APIError(status, _UNAVAILABLE.get(error.code, str(error)), code=error.code)
    if isinstance(error, RequestRejectedError):
        message = f"server is busy: {error}" if isinstance(error, QueueFullError) else str(error)
        return APIError(status, message, param=request_field(error, renames), code=error.code)
    if isinstance(error, (ValueError, TypeError)):
        return APIError(400, str(error), param=request_field(error, renames))
    return None


def request_field(error: Exception, renames: Mapping[str, str] | None = None) -> str | None:
    """The request field an error names (its `field`, renamed for the endpoint), or None."""
    field = getattr(error, "field", None)
    return (renames or {}).get(field, field) if isinstance(field, str) else None

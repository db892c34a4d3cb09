"""Errors raised when a request is submitted. Rejection leaves the scheduler unchanged."""


class QueueFullError(Exception):
    """The waiting queue is full; retrying later may succeed (HTTP 429)."""


class RequestRejectedError(ValueError):
    """The request can never be served as given (bad parameters, too long, too big for the pool)."""


class DuplicateRequestError(RequestRejectedError):
    """A request with the same id is still in flight."""

"""Errors a caller of the engine can meet, in one place.

Submission errors are raised by `generate`/`chat`/`complete` before anything is queued (the engine
state is unchanged); a request that fails later ends its stream with finish_reason "error" and the
stream raises `RequestFailedError` to its consumer.
"""

from __future__ import annotations

from scheduler.errors import DuplicateRequestError, QueueFullError, RequestRejectedError

__all__ = [
    "DuplicateRequestError",
    "EngineDeadError",
    "EngineDrainingError",
    "EngineNotRunningError",
    "QueueFullError",
    "RequestFailedError",
    "RequestRejectedError",
]


class EngineNotRunningError(RuntimeError):
    """The engine was not started, or has been shut down."""


class EngineDrainingError(RuntimeError):
    """The engine is draining for shutdown and accepts no new requests."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped and can make no more progress."""


class RequestFailedError(RuntimeError):
    """A request ended with an error during a step; `__cause__` holds the original exception."""

    def __init__(self, request_id: str, message: str):
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id

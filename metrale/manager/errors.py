"""Why the manager cannot give a request its model (the server maps each onto an HTTP status)."""

from __future__ import annotations


class ModelManagerError(RuntimeError):
    """A request's model cannot be served now."""


class UnknownModelError(ModelManagerError, LookupError):
    """The request names a model the server does not answer for (404)."""

    def __init__(self, requested: str, known: list[str]) -> None:
        self.requested = requested
        self.known = known
        super().__init__(f"model {requested!r} does not exist")


class ModelLoadError(ModelManagerError):
    """The model's load failed (503, the loader's message); the next request for it tries again."""

    def __init__(self, model_id: str, reason: str) -> None:
        self.model_id = model_id
        self.reason = reason
        super().__init__(f"model {model_id!r} failed to load: {reason}")


class NoRoomError(ModelManagerError):
    """The model does not fit in the memory budget and no resident model is idle enough to unload (503)."""


class LoadQueueFullError(ModelManagerError):
    """Too many requests already wait for this model's load (429)."""


class ManagerClosedError(ModelManagerError):
    """The server is draining or stopped: no new request is served (503)."""

"""Errors a caller of the engine can meet, in one place.

Submission errors are raised by `generate`/`chat`/`complete` before anything is queued (the engine
state is unchanged). Each carries `reason` (the `metrale_requests_rejected_total` label, or None
when it is not counted), `code` and, for a refused request, `field` (the parameter at fault), so no
caller matches message text; the server maps the types to HTTP statuses (metrale/server/errors.py). The request-level ones come from the scheduler (scheduler/errors.py lists them);
a request that fails later ends its stream with finish_reason "error" and the stream raises
`RequestFailedError` to its consumer.
"""

from __future__ import annotations

from scheduler.errors import (DuplicateRequestError, EmptyPromptError, InvalidParamsError, InvalidPriorityError,
                              InvalidTokenIdError, PromptTooLongError, QueueFullError, RequestRejectedError)

__all__ = [
    "DuplicateRequestError", "EmptyPromptError", "EngineDeadError", "EngineDrainingError", "EngineNotRunningError",
    "EngineRestartingError", "EngineUnavailableError", "InvalidMessagesError", "InvalidParamsError", "InvalidPriorityError",
    "InvalidLoraAdapterError", "InvalidPromptError", "InvalidStructuredOutputError", "InvalidTokenIdError",
    "LoraNotFoundError", "PromptTooLongError",
    "QueueFullError", "RequestFailedError", "RequestRejectedError", "StructuredOutputUnavailableError",
    "TensorParallelError",
]


class InvalidPromptError(RequestRejectedError, TypeError):
    """The prompt is neither a string nor a list of token ids (also a TypeError)."""

    code = "invalid_prompt"
    field = "prompt"


class InvalidMessagesError(RequestRejectedError):
    """Chat messages the template cannot render (bad roles or content, or the template refused them)."""

    code = "invalid_messages"
    field = "messages"


class InvalidStructuredOutputError(RequestRejectedError):
    """A structured-output constraint the grammar engine cannot use (bad JSON schema, regex or grammar);
    the message names the problem."""

    code = "invalid_structured_output"
    field = "structured_outputs"


class StructuredOutputUnavailableError(RequestRejectedError):
    """Structured outputs (or a tool_choice that needs them) without the `metrale[structured]` extra."""

    code = "structured_output_unavailable"
    field = "structured_outputs"


class LoraNotFoundError(RequestRejectedError):
    """A request names a LoRA adapter the engine has not registered (the server answers 404)."""

    code = "lora_not_found"
    field = "lora"


class InvalidLoraAdapterError(RequestRejectedError):
    """A LoRA adapter folder that cannot be served on this model (unreadable, another layout, shapes or
    targets the base model does not have, a rank above max_lora_rank), or a name already registered;
    the message names the problem."""

    code = "invalid_lora_adapter"
    field = "lora_path"


class EngineUnavailableError(RuntimeError):
    """The engine cannot take requests right now (the server answers 503)."""

    reason: str | None = None  # not counted as a rejection of the request itself
    code = "unavailable"


class EngineNotRunningError(EngineUnavailableError):
    """The engine was not started (or is still loading), or has been shut down."""

    code = "loading"


class EngineDrainingError(EngineUnavailableError):
    """The engine is draining for shutdown and accepts no new requests."""

    reason = "draining"
    code = "draining"


class EngineDeadError(EngineUnavailableError):
    """The engine loop stopped and can make no more progress."""

    code = "unhealthy"


class EngineRestartingError(EngineUnavailableError):
    """The engine process died and a new one is starting with the same config (HTTP 503, Retry-After)."""

    code = "restarting"


class RequestFailedError(RuntimeError):
    """A request ended with an error during a step; `__cause__` holds the original exception."""

    def __init__(self, request_id: str, message: str):
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group died, hung or fell out of step: the group cannot run another
    step (the ring cannot be rebuilt in this process), so the engine dies and every open request ends
    with an error."""

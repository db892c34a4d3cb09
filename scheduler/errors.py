"""Why a request was refused at submit time: one error type per cause. Rejection changes nothing.

Each type carries what its callers need without reading the message: `reason`, the label of the
`metrale_requests_rejected_total` counter, `code`, the machine-readable cause, and `field`, the request
parameter at fault (None when no one parameter is). The server maps the types to HTTP statuses
(metrale/server/errors.py).

    error                    reason            code                      field
    RequestRejectedError     invalid_request   invalid_request           (base: any other bad request)
    InvalidParamsError       invalid_request   invalid_request           the parameter (max_tokens, ...)
    EmptyPromptError         invalid_request   empty_prompt              prompt
    InvalidTokenIdError      invalid_request   invalid_token_id          prompt (or the ids' parameter)
    InvalidPriorityError     invalid_request   invalid_priority          priority
    DuplicateRequestError    invalid_request   duplicate_request_id      request_id
    PromptTooLongError       too_long          context_length_exceeded   prompt
    QueueFullError           queue_full        queue_full                None
"""

from __future__ import annotations


class RequestRejectedError(ValueError):
    """The request can never be served as given; the base of every submit-time refusal."""

    reason = "invalid_request"
    code = "invalid_request"
    field: str | None = None  # the request parameter at fault; a type's default, or given

    def __init__(self, message: str = "", *, field: str | None = None) -> None:
        super().__init__(message)
        if field is not None:
            self.field = field


class InvalidParamsError(RequestRejectedError):
    """A parameter is out of range (SamplingParams' fields, max_tokens, min_tokens, arrival_time,
    request_id); `field` names it."""


class EmptyPromptError(RequestRejectedError):
    """The prompt has no tokens."""

    code = "empty_prompt"
    field = "prompt"


class InvalidTokenIdError(RequestRejectedError):
    """A prompt token id is outside the model's vocabulary."""

    code = "invalid_token_id"
    field = "prompt"


class InvalidPriorityError(RequestRejectedError):
    """The priority is not an int."""

    code = "invalid_priority"
    field = "priority"


class DuplicateRequestError(RequestRejectedError):
    """A request with the same id is still in flight."""

    code = "duplicate_request_id"
    field = "request_id"


class PromptTooLongError(RequestRejectedError):
    """prompt + max_tokens exceeds max_model_len, or needs more KV blocks than the whole pool."""

    reason = "too_long"
    code = "context_length_exceeded"
    field = "prompt"


class QueueFullError(RequestRejectedError):
    """The waiting queue is full; retrying later may succeed."""

    reason = "queue_full"
    code = "queue_full"

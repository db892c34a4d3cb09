"""Why a request was refused at submit time: one error type per cause. Rejection changes nothing.

Each type carries what its callers need without reading the message: `reason`, the label of the
`metrale_requests_rejected_total` counter, and `http_status` / `code`, the server's answer.

    error                    reason            status  code
    RequestRejectedError     invalid_request   400     invalid_request   (base: any other bad request)
    InvalidParamsError       invalid_request   400     invalid_request   (max_tokens, min_tokens, ...)
    EmptyPromptError         invalid_request   400     empty_prompt
    InvalidTokenIdError      invalid_request   400     invalid_token_id
    InvalidPriorityError     invalid_request   400     invalid_priority
    DuplicateRequestError    invalid_request   400     duplicate_request_id
    PromptTooLongError       too_long          400     context_length_exceeded
    QueueFullError           queue_full        429     queue_full
"""

from __future__ import annotations


class RequestRejectedError(ValueError):
    """The request can never be served as given; the base of every submit-time refusal."""

    reason = "invalid_request"
    http_status = 400
    code = "invalid_request"


class InvalidParamsError(RequestRejectedError):
    """A scheduling parameter is out of range (max_tokens, min_tokens, arrival_time, request_id)."""


class EmptyPromptError(RequestRejectedError):
    """The prompt has no tokens."""

    code = "empty_prompt"


class InvalidTokenIdError(RequestRejectedError):
    """A prompt token id is outside the model's vocabulary."""

    code = "invalid_token_id"


class InvalidPriorityError(RequestRejectedError):
    """The priority is not an int."""

    code = "invalid_priority"


class DuplicateRequestError(RequestRejectedError):
    """A request with the same id is still in flight."""

    code = "duplicate_request_id"


class PromptTooLongError(RequestRejectedError):
    """prompt + max_tokens exceeds max_model_len, or needs more KV blocks than the whole pool."""

    reason = "too_long"
    code = "context_length_exceeded"


class QueueFullError(RequestRejectedError):
    """The waiting queue is full; retrying later may succeed."""

    reason = "queue_full"
    http_status = 429
    code = "queue_full"

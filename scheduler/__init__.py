"""scheduler: pure-Python request scheduling (queue, admission, token budget, preemption).

Never imports mlx or metrale; depends only on kvcache's pure-Python accounting.
"""

from scheduler.config import SchedulerConfig
from scheduler.errors import (DuplicateRequestError, EmptyPromptError, InvalidParamsError, InvalidPriorityError,
                              InvalidTokenIdError, PromptTooLongError, QueueFullError, RequestRejectedError)
from scheduler.output import RequestEvent, ScheduledRequest, SchedulerOutput
from scheduler.request import FinishReason, LoraRef, Request, RequestStatus
from scheduler.scheduler import Scheduler

__all__ = [
    "DuplicateRequestError",
    "EmptyPromptError",
    "FinishReason",
    "InvalidParamsError",
    "InvalidPriorityError",
    "InvalidTokenIdError",
    "LoraRef",
    "PromptTooLongError",
    "QueueFullError",
    "Request",
    "RequestEvent",
    "RequestRejectedError",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]

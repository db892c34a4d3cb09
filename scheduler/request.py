"""Request: the one record that owns a request's scheduling state (pure Python)."""

from __future__ import annotations

import enum
import operator
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class FinishReason(enum.StrEnum):
    """Why a request ended. A str: `reason == "stop"` holds, and it is written as its value at the API edge."""

    STOP = "stop"  # eos, a stop token id, a stop string or a complete grammar
    LENGTH = "length"  # max_tokens (or the context) reached
    ABORT = "abort"  # cancelled by the client or the engine
    ERROR = "error"  # a step failed for this request


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every status after PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, to be recomputed
    FINISHED_STOPPED = 3  # eos or a stop token id (or a stop string, set by the engine)
    FINISHED_LENGTH = 4  # max_tokens reached
    FINISHED_ABORTED = 5  # cancelled by the client or the engine
    FINISHED_ERROR = 6  # a step failed for this request

    @property
    def is_finished(self) -> bool:
        """True for the four finished statuses."""
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The reason of a finished status, else None."""
        return _FINISH_REASONS.get(self)

    @classmethod
    def finished_with(cls, reason: FinishReason) -> RequestStatus:
        """The finished status for `reason`."""
        return _FINISHED_STATUSES[FinishReason(reason)]


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}
_FINISHED_STATUSES = {reason: status for status, reason in _FINISH_REASONS.items()}


@dataclass(frozen=True, slots=True)
class LoraRef:
    """The LoRA adapter a request runs with: its name (a model id at the API, and part of the prefix-cache
    hashes) and the folder the runner loads it from (again after an eviction)."""

    name: str
    path: str


class Request:
    """A request's token ids, its scheduling parameters and its progress.

    Token layout (prompt P tokens, O output tokens so far):

        all_token_ids  | prompt (P) | output (O) |
                       | computed (num_computed_tokens) | not yet computed |

    The last known token is computed by the step that samples the next one, so while a request
    runs, num_computed_tokens < num_tokens before each step. `priority`: lower values are served
    first under the "priority" policy (vLLM's convention); ignored under "fcfs".

    Speculation: before a step the engine may give the scheduler draft tokens to follow the last
    known one (Scheduler.update_draft_token_ids; they are never stored here). The scheduler computes
    them with the last token when the budget and the blocks allow; `update` keeps the accepted ones
    and rolls num_computed_tokens back over the rejected ones:

        | known tokens ... x_L | d1 d2 d3 |        step: computes x_L d1 d2 d3 (1 + k positions)
        | known ... x_L d1 d2 t |               2 drafts accepted, t = the target's own next token
                   computed: up to d2; t is the new last known token

    `num_cached_tokens`: prompt tokens found in the prefix cache when the request was first admitted
    (-1 until then; a recompute after preemption does not change it). `skip_reading_prefix_cache`:
    compute every prompt token (the runner needs their logits, e.g. for prompt logprobs). `lora`: the
    adapter whose low-rank updates this request's rows add (None: the base model).
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "max_tokens", "eos_token_ids", "stop_token_ids",
        "ignore_eos", "min_tokens", "priority", "arrival_time", "cache_salt",
        "num_computed_tokens", "status", "num_preemptions",
        "num_cached_tokens", "skip_reading_prefix_cache", "lora", "_all_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        max_tokens: int = 16,
        eos_token_ids: Iterable[int] = (),
        stop_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        min_tokens: int = 0,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        output_token_ids: Iterable[int] = (),
        skip_reading_prefix_cache: bool = False,
        lora: LoraRef | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids: tuple[int, ...] = tuple(map(operator.index, prompt_token_ids))
        self.max_tokens = max_tokens
        self.eos_token_ids: tuple[int, ...] = tuple(map(operator.index, eos_token_ids))
        self.stop_token_ids: tuple[int, ...] = tuple(map(operator.index, stop_token_ids))
        self.ignore_eos = ignore_eos
        self.min_tokens = min_tokens
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-cache hits at the first admission
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.lora = lora
        # prompt + output in one list: all_token_ids is on the per-step path and must be O(1).
        self._all_token_ids = [*self.prompt_token_ids, *map(operator.index, output_token_ids)]

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt then output token ids: a read-only view (append through append_output_token)."""
        return self._all_token_ids

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        """The generated token ids so far (a copy)."""
        return tuple(self._all_token_ids[len(self.prompt_token_ids) :])

    @property
    def lora_key(self) -> str | None:
        """The adapter's identity, its name and folder (None: the base model): the KV manager hashes it into
        the first block, so a name loaded again from another folder never reads the old adapter's KV."""
        return f"{self.lora.name}\0{self.lora.path}" if self.lora is not None else None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._all_token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def stop_status(self, token: int) -> RequestStatus | None:
        """The finished status once `token` (just appended) is output, or None while it goes on. A stop
        wins over length when both hold; min_tokens holds back eos and stop ids only."""
        if self.num_output_tokens >= self.min_tokens and (
            token in self.stop_token_ids or (not self.ignore_eos and token in self.eos_token_ids)
        ):
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def append_output_token(self, token_id: int) -> None:
        """Append one sampled token (the scheduler's update does this)."""
        self._all_token_ids.append(operator.index(token_id))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )

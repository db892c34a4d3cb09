"""Admission checks: a request that can never be served is rejected at submit time."""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.errors import (EmptyPromptError, InvalidParamsError, InvalidPriorityError, InvalidTokenIdError,
                              PromptTooLongError)
from scheduler.request import Request, RequestStatus


def check_admissible(request: Request, config: SchedulerConfig, kv: KVCacheManager) -> None:
    """Raise RequestRejectedError, with the numbers, if `request` can never be served."""
    rid = request.request_id
    if not isinstance(rid, str) or not rid:
        raise InvalidParamsError(f"request_id must be a non-empty str, got {rid!r}", field="request_id")
    if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
        raise InvalidParamsError(
            f"request {rid!r} was already scheduled ({request.status.name}, "
            f"{request.num_computed_tokens} computed tokens)"
        )
    if not isinstance(request.priority, int) or isinstance(request.priority, bool):
        raise InvalidPriorityError(
            f"request {rid!r}: priority must be an int, got {request.priority!r}"
        )
    if not isinstance(request.arrival_time, (int, float)):
        raise InvalidParamsError(
            f"request {rid!r}: arrival_time must be a number, got {request.arrival_time!r}", field="arrival_time"
        )
    n_prompt, max_tokens = request.num_prompt_tokens, request.max_tokens
    if n_prompt == 0:
        raise EmptyPromptError(f"request {rid!r}: prompt is empty (0 tokens)")
    if min(request.prompt_token_ids) < 0:
        raise InvalidTokenIdError(
            f"request {rid!r}: prompt has a negative token id ({min(request.prompt_token_ids)})"
        )
    _check_lengths(request)
    limit = config.max_model_len
    if limit is not None and n_prompt + max_tokens > limit:
        raise PromptTooLongError(
            f"request {rid!r}: prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = "
            f"{n_prompt + max_tokens} exceeds max_model_len ({limit})"
        )
    # The last sampled token is never fed back, so KV holds at most prompt + max_tokens - 1.
    needed = kv.num_blocks_for(n_prompt + max_tokens - 1)
    if needed > kv.num_blocks:
        raise PromptTooLongError(
            f"request {rid!r}: needs {needed} KV blocks of {kv.block_size} tokens for "
            f"{n_prompt + max_tokens - 1} tokens, but the whole pool has {kv.num_blocks}"
        )


def _check_lengths(request: Request) -> None:
    rid, max_tokens, min_tokens = request.request_id, request.max_tokens, request.min_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidParamsError(
            f"request {rid!r}: max_tokens must be an int >= 1, got {max_tokens!r}", field="max_tokens"
        )
    if request.num_output_tokens >= max_tokens:
        raise InvalidParamsError(
            f"request {rid!r}: already has {request.num_output_tokens} output tokens, "
            f"max_tokens is {max_tokens}", field="max_tokens"
        )
    if not isinstance(min_tokens, int) or isinstance(min_tokens, bool):
        raise InvalidParamsError(
            f"request {rid!r}: min_tokens must be an int, got {min_tokens!r}", field="min_tokens"
        )
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidParamsError(
            f"request {rid!r}: min_tokens must be in 0..max_tokens ({max_tokens}), got {min_tokens}",
            field="min_tokens"
        )


def check_forks(request: Request, forks: Sequence[Request], config: SchedulerConfig) -> None:
    """Raise InvalidParamsError unless `forks` can fork from `request` (parallel sampling): its prompt,
    no output yet, and every sequence of the group able to run at once."""
    if 1 + len(forks) > config.max_num_seqs:
        raise InvalidParamsError(
            f"request {request.request_id!r}: {1 + len(forks)} sequences, but at most max_num_seqs "
            f"({config.max_num_seqs}) run at once"
        )
    for fork in forks:
        if fork.prompt_token_ids != request.prompt_token_ids or fork.num_output_tokens:
            raise InvalidParamsError(
                f"request {fork.request_id!r} must have the prompt of {request.request_id!r} to fork from it"
            )

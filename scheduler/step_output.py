"""A step's plan (tokens per request) turned into the SchedulerOutput the runner computes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvcache.manager import KVCacheManager
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request, RequestStatus


def build_output(num_new: Mapping[str, int], preempted: Sequence[Request],
                 drafts: Mapping[str, tuple[int, ...] | int], requests: Mapping[str, Request],
                 kv_cache_manager: KVCacheManager, pending_copies: Mapping[str, list[tuple[int, int]]],
                 block_size: int) -> SchedulerOutput:
    """The step's output; advances num_computed_tokens of every scheduled request (past its drafts, which
    update() rolls back when rejected). `pending_copies` (child id -> block copies) ride along for the
    children still running; the caller clears them."""
    scheduled = []
    for rid, n in num_new.items():
        req = requests[rid]
        start = req.num_computed_tokens
        end = start + n
        draft = drafts.get(rid, 0)
        k = draft if isinstance(draft, int) else len(draft)
        scheduled.append(
            ScheduledRequest(
                request_id=rid,
                token_ids=tuple(req.all_token_ids[start:end]),
                start_position=start,
                block_table=kv_cache_manager.block_ids(rid),
                samples=end == req.num_tokens,
                num_draft_tokens=k,
                draft_token_ids=() if isinstance(draft, int) else draft,
                lora=req.lora,
            )
        )
        req.num_computed_tokens = end + k
    # a child preempted before its copy ran has freed the copy's block: its copy is dropped
    copies = tuple(c for rid, pairs in pending_copies.items() if requests.get(rid) is not None
                   and requests[rid].status is RequestStatus.RUNNING for c in pairs)
    return SchedulerOutput(
        scheduled=tuple(scheduled),
        num_batched_tokens=sum(s.num_tokens for s in scheduled),
        preempted_request_ids=tuple(r.request_id for r in preempted),
        block_size=block_size,
        block_copies=copies,
    )

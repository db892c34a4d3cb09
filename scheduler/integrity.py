"""The scheduler's accounting audit (tests call it after every scenario): every request is in exactly one
place with the state that place implies, and the KV manager's books agree with the requests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvcache.manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.forks import PendingForks
from scheduler.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING


def check_integrity(config: SchedulerConfig, requests: Mapping[str, Request], running: Sequence[Request],
                    waiting: Sequence[Request], forks: PendingForks, kv: KVCacheManager) -> None:
    """Raise RuntimeError with the numbers if scheduler or KV accounting is inconsistent."""
    running, waiting, children = list(running), list(waiting), list(forks)
    if len(running) > config.max_num_seqs:
        raise RuntimeError(f"{len(running)} running > max_num_seqs {config.max_num_seqs}")
    if len(running) + len(waiting) + len(children) != len(requests):
        raise RuntimeError(
            f"running {len(running)} + waiting {len(waiting)} + forking {len(children)} != {len(requests)} requests"
        )
    for child in children:
        parent = requests.get(forks.parent_of(child.request_id) or "")
        if parent is None or child.status is not RequestStatus.WAITING or child.num_computed_tokens:
            raise RuntimeError(f"request {child!r} waits to fork from {parent!r}")
    for req in running + waiting + children:
        if requests.get(req.request_id) is not req:
            raise RuntimeError(f"request {req.request_id!r} is queued twice or not registered")
        table = kv.block_table(req.request_id)
        if req.status is _RUNNING and len(table) * config.block_size < req.num_computed_tokens:
            raise RuntimeError(
                f"request {req.request_id!r}: {len(table)} blocks for {req.num_computed_tokens} computed tokens"
            )
    for req in running:
        if req.status is not _RUNNING:
            raise RuntimeError(f"request {req.request_id!r} is running with {req.status.name}")
    for req in waiting + children:
        if req.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED) or (
            req.num_computed_tokens or kv.block_table(req.request_id)
        ):
            raise RuntimeError(f"waiting request {req!r} holds state it should not")
    kv.check_integrity(requests.keys())

"""Helpers that drive a Scheduler with made-up runner outputs (no model)."""

from __future__ import annotations

import zlib
from collections.abc import Callable

from kvcache.manager import KVCacheManager
from scheduler import Request, RequestEvent, Scheduler, SchedulerConfig, SchedulerOutput


def make_scheduler(num_blocks: int = 32, block_size: int = 4, **config) -> Scheduler:
    """A scheduler over a fresh KV manager; `config` overrides SchedulerConfig fields."""
    caching = config.setdefault("enable_prefix_caching", True)
    config.setdefault("max_num_seqs", 4)
    cfg = SchedulerConfig(block_size=block_size, **config)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching))


def make_request(rid: str, prompt: int | list[int], max_tokens: int = 4, **kw) -> Request:
    """A request with `prompt` token ids, or `prompt` distinct ids derived from `rid`."""
    if isinstance(prompt, int):
        base = 1000 * (zlib.crc32(rid.encode()) % 10_000 + 1)  # deterministic, distinct
        prompt = [base + i for i in range(prompt)]
    kw.setdefault("arrival_time", 0.0)
    return Request(rid, prompt, max_tokens=max_tokens, **kw)


def sample_all(out: SchedulerOutput, token: int | Callable[[str], int] = 7) -> dict[str, int]:
    """One made-up token for every request that samples this step."""
    pick = token if callable(token) else (lambda rid: token)
    return {s.request_id: pick(s.request_id) for s in out.scheduled if s.samples}


def step(
    sched: Scheduler, token: int | Callable[[str], int] = 7
) -> tuple[SchedulerOutput, list[RequestEvent]]:
    """schedule -> made-up runner -> update, then the integrity check."""
    out = sched.schedule()
    events = sched.update(out, sample_all(out, token))
    sched.check_integrity()
    return out, events


def run_until_done(
    sched: Scheduler, token: int | Callable[[str], int] = 7, max_steps: int = 1000
) -> list[tuple[SchedulerOutput, list[RequestEvent]]]:
    """Step until nothing is unfinished; fails if that takes more than `max_steps`."""
    history = []
    while sched.has_unfinished_requests():
        if len(history) >= max_steps:
            raise AssertionError(f"not done after {max_steps} steps")
        history.append(step(sched, token))
    return history


def finish_reasons(history) -> dict[str, str]:
    """request id -> finish reason, from every step's events (asserts one finish each)."""
    reasons: dict[str, str] = {}
    for _, events in history:
        for ev in events:
            if ev.finish_reason is not None:
                assert ev.request_id not in reasons, f"two finish events for {ev.request_id}"
                reasons[ev.request_id] = ev.finish_reason
    return reasons

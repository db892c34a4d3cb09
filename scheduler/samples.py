"""A step's sampled tokens checked against the step's plan before the scheduler applies any of them.

The runner reports, per request whose ScheduledRequest samples, one token, or for a request with k
drafts its accepted drafts then the target's own token (1 to k + 1 tokens). A stale plan, a missing
request or a run of the wrong length is a broken invariant: it raises and nothing is applied.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

from scheduler.output import SchedulerOutput
from scheduler.request import Request, RequestStatus


def collect_samples(output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]],
                    requests: Mapping[str, Request]) -> list[tuple[Request, int, tuple[int, ...]]]:
    """(request, its scheduled drafts, its tokens) per sampling request still running, in schedule order.

    Requests finished since `schedule()` (or finished and re-added) are skipped, so their entries in
    `sampled` are ignored. Raises RuntimeError for a stale plan, ValueError for missing or bad tokens.
    """
    pending = []
    missing = []
    for s in output.scheduled:
        if not s.samples:
            continue
        req = requests.get(s.request_id)
        if req is None or req.status is not RequestStatus.RUNNING:
            continue
        end = s.start_position + len(s.token_ids)
        if req.num_computed_tokens != end + s.num_draft_tokens or req.num_tokens != end:
            raise RuntimeError(
                f"request {s.request_id!r}: stale output, chunk ends at {end} (+{s.num_draft_tokens} "
                f"drafts) but {req.num_computed_tokens} computed of {req.num_tokens} tokens"
            )
        if s.request_id not in sampled:
            missing.append(s.request_id)
            continue
        value = sampled[s.request_id]
        tokens = (operator.index(value),) if not isinstance(value, Sequence) else tuple(map(operator.index, value))
        if not 1 <= len(tokens) <= s.num_draft_tokens + 1:
            raise ValueError(f"request {s.request_id!r}: {len(tokens)} tokens for {s.num_draft_tokens} drafts "
                             f"(expected 1 to {s.num_draft_tokens + 1})")
        pending.append((req, s.num_draft_tokens, tokens))
    if missing:
        raise ValueError(f"no sampled token for {len(missing)} requests: {missing[:8]}")
    return pending

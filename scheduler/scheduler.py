"""Scheduler: admission, the per-step token budget, preemption and the one finish path.

A step is `schedule()` -> runner -> `update()`. There are no prefill and decode phases: each
scheduled request gets `num_new` tokens so that num_computed_tokens catches up with num_tokens:

    request tokens  | computed           | new (this step)   | (rest: later steps) |
                    0      num_computed_tokens    + num_new                num_tokens

A prompt chunk, a prefix-cache hit and a decode token are the same path. The chunk samples when
it reaches num_tokens; `schedule()` advances num_computed_tokens, `update()` appends the sampled
token and finishes the request on eos / stop token ids / max_tokens.

Parallel sampling: `add(parent, forks=children)` queues a group; the children fork from the parent
when its prompt has been computed (scheduler/forks.py), and the partial-block copies that forking
needs ride in the next SchedulerOutput's `block_copies`.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvcache.manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.admission import check_admissible, check_forks
from scheduler.errors import DuplicateRequestError, QueueFullError
from scheduler.forks import PendingForks
from scheduler.output import RequestEvent, SchedulerOutput
from scheduler.integrity import check_integrity
from scheduler.queue import WaitingQueue, make_waiting_queue
from scheduler.samples import collect_samples
from scheduler.step_budget import StepLimit, StepTimeBudget
from scheduler.step_cost import OnlineStepCost, StepCostModel, StepWork
from scheduler.step_output import build_output
from scheduler.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING


class Scheduler:
    """Owns the waiting queue and the running list; the KV manager owns the block tables.

    Running requests are served first, most urgent first (by arrival under "fcfs", by
    (priority, arrival) under "priority", where a lower value is more urgent; "fcfs" ignores
    `priority`). Then waiting ones are admitted while the token budget, max_num_seqs and free
    blocks allow; the head of the queue blocks the rest, so a large request is never overtaken
    forever. When a running request cannot get blocks, the least urgent running request (the
    lowest priority, then the latest arrival) is preempted: its blocks are freed, it keeps its
    output tokens and goes back to the front of the waiting queue to be recomputed (the prefix
    cache usually gives its blocks back). That victim is the last of the running list, so it never
    already holds a slot in the step: no blocks are cached for tokens that will not be computed.
    No request is admitted in a step that preempted. A request group (parallel sampling) is admitted
    when max_num_seqs has room for all of its sequences. At most max_loras distinct LoRA adapters run at
    once (the runner holds that many): a request for another one waits at the head of the queue.

    Decodes first: a prompt chunk leaves one token of the budget to each running decode after it, and
    a step that decodes cuts its prompt chunks to fit its time limit (`max_step_factor` x its decodes'
    own time and/or `max_step_ms`), as `cost_model` estimates it (learned from `observe_step` unless
    injected): a long prompt does not stall the streams. `last_step_estimate` / `last_step_limit` (seconds
    or None) are the last planned step's estimate (steps with a prompt chunk beside decodes only:
    StepTimeBudget.planned_s) and limit, to compare with its measured time.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 cost_model: StepCostModel | None = None) -> None:
        if kv_cache_manager.block_size != config.block_size:
            raise ValueError(
                f"block_size: config has {config.block_size}, "
                f"kv_cache_manager has {kv_cache_manager.block_size}"
            )
        if kv_cache_manager.enable_prefix_caching != config.enable_prefix_caching:
            raise ValueError(
                f"enable_prefix_caching: config has {config.enable_prefix_caching}, "
                f"kv_cache_manager has {kv_cache_manager.enable_prefix_caching}"
            )
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self._requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        # Running requests sorted by this key, most urgent first: the preemption victim is always
        # the last one, which the running pass reaches last (so it has no slot yet in the step).
        if config.policy == "priority":
            self._urgency: Callable[[Request], Any] = lambda r: (r.priority, r.arrival_time)
        else:
            self._urgency = lambda r: r.arrival_time
        self._running: list[Request] = []
        self._waiting: WaitingQueue = make_waiting_queue(config.policy)
        self._forks = PendingForks()  # children waiting for their parent's prompt
        self._pending_copies: dict[str, list[tuple[int, int]]] = {}  # child id -> its block copies, for the next step
        self._drafts: dict[str, tuple[int, ...] | int] = {}  # for the next schedule() only
        self.num_preemptions = 0  # total over the scheduler's life
        self._num_schedules = 0  # alternates the probe chunk while the cost model learns
        self.cost_model: StepCostModel = cost_model if cost_model is not None else OnlineStepCost()
        self._step_limit = StepLimit(None if config.max_step_ms is None else config.max_step_ms / 1e3,
                                     config.max_step_factor)
        self.last_step_estimate: float | None = None
        self.last_step_limit: float | None = None

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Waiting requests, preempted ones and children waiting for their parent's prompt included."""
        return len(self._waiting) + len(self._forks)

    @property
    def running(self) -> tuple[Request, ...]:
        """The running requests, most urgent first (a copy)."""
        return tuple(self._running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def add(self, request: Request, forks: Sequence[Request] = ()) -> None:
        """Queue a new request (status WAITING), with `forks`: more sequences of the same prompt
        (parallel sampling) that fork from it once its prompt is computed.

        Raises:
            DuplicateRequestError: a request with one of these ids is in flight.
            RequestRejectedError: the request can never be served (empty prompt, bad params,
                prompt + max_tokens > max_model_len, more KV blocks than the whole pool, forks with
                another prompt, more sequences than max_num_seqs).
            QueueFullError: the waiting queue holds max_waiting requests; retry later.
        A rejected request changes nothing.
        """
        group = (request, *forks)
        ids = [r.request_id for r in group]
        seen: set[str] = set()
        for rid in ids:  # one pass: n sequences cost O(n)
            if isinstance(rid, str) and (rid in self._requests or rid in seen):
                raise DuplicateRequestError(f"request {rid!r} is already in flight")
            if isinstance(rid, str):
                seen.add(rid)
        for member in group:
            check_admissible(member, self.config, self.kv_cache_manager)
        check_forks(request, forks, self.config)
        if len(self._waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"waiting queue is full ({len(self._waiting)} of {self.config.max_waiting} "
                f"requests); request {request.request_id!r} rejected"
            )
        self._requests.update((member.request_id, member) for member in group)
        self._waiting.push(request)
        self._forks.add(request.request_id, list(forks))

    def update_draft_token_ids(self, drafts: Mapping[str, Sequence[int] | int]) -> None:
        """Drafts for the next `schedule()` only (vLLM's pattern): per running request, the draft
        token ids to follow its last known token, or (an int) how many the runner's proposer makes.
        A request gets its drafts when it is a one-token decode and the budget and free blocks allow;
        otherwise it is scheduled as a plain decode and they are dropped. A later call before that
        step replaces the drafts of the requests it names."""
        self._drafts.update((rid, d if isinstance(d, int) else tuple(map(operator.index, d))) for rid, d in drafts.items())

    def schedule(self) -> SchedulerOutput:
        """Plan one step and advance num_computed_tokens of every scheduled request."""
        num_new: dict[str, int] = {}  # request id -> tokens this step; running first, then admitted
        preempted: list[Request] = []
        drafts, self._drafts = self._drafts, {}
        timing = StepTimeBudget(self.cost_model, self._step_limit, self.config.min_prefill_chunk,
                                self._decode_work() if self._step_limit.is_set else StepWork(),
                                probe=self._num_schedules % 2 == 1)
        self._num_schedules += 1
        budget = self._schedule_running(num_new, preempted, drafts, self.config.max_num_batched_tokens, timing)
        drafts = {rid: d for rid, d in drafts.items() if rid in num_new}  # scheduled with them, nobody else
        if not preempted:  # blocks are short: admitting now would only preempt again
            self._schedule_waiting(num_new, budget, timing)
        self.last_step_estimate, self.last_step_limit = timing.planned_s(), timing.limit_s
        output = build_output(num_new, preempted, drafts, self._requests, self.kv_cache_manager,
                              self._pending_copies, self.config.block_size)
        self._pending_copies = {}
        return output

    def _decode_work(self) -> StepWork:
        """The running decodes (one known token to compute) as cost-model work: one pass over the running."""
        num_decodes = num_pairs = 0
        for r in self._running:
            if r.num_tokens - r.num_computed_tokens == 1:
                num_decodes += 1
                num_pairs += r.num_computed_tokens + 1
        return StepWork.of_decodes(num_decodes, num_pairs)

    def _num_decodes_from(self, i: int) -> int:
        """Running decodes at index i and after: the tokens a prompt chunk before them leaves."""
        return sum(1 for r in self._running[i:] if r.num_tokens - r.num_computed_tokens == 1)

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """The runner computed `output` in `seconds`: teaches the cost model that the step limit uses."""
        work = StepWork.of_output(output)
        if work.num_tokens:
            self.cost_model.observe(work, seconds)

    def _schedule_running(self, num_new: dict[str, int], preempted: list[Request],
                          drafts: dict[str, tuple[int, ...] | int], budget: int, timing: StepTimeBudget) -> int:
        """Schedule running requests; `drafts` keeps only the drafts of those scheduled with them.
        A prompt chunk leaves a token to each decode after it and fits `timing`."""
        i = 0
        num_decodes: int | None = None  # decodes not reached yet: counted at the first chunk only
        while i < len(self._running) and budget > 0:
            req = self._running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            n = min(remaining, budget)
            if remaining == 1:
                if num_decodes is not None:
                    num_decodes -= 1
            elif n > 1:  # a prompt chunk (or a recomputation)
                if num_decodes is None:
                    num_decodes = self._num_decodes_from(i + 1)
                n = timing.fit_chunk(req.num_computed_tokens, min(n, budget - num_decodes))
            if n <= 0:  # nothing left to compute (update() not called for its last step), or no room
                i += 1
                continue
            k = self._schedule_drafts(req, n, budget, drafts.get(req.request_id, 0))
            if k:
                num_new[req.request_id] = n
                budget -= n + k
                i += 1
                continue
            drafts.pop(req.request_id, None)
            scheduled = True
            while self.kv_cache_manager.allocate_slots(req, n) is None:
                victim = self._preempt_last()  # index >= i: req itself or not scheduled yet
                preempted.append(victim)
                if victim is req:
                    scheduled = False
                    break
            if scheduled:
                num_new[req.request_id] = n
                if remaining > 1:
                    timing.take_chunk(req.num_computed_tokens, n)
                budget -= n
                i += 1
        return budget

    def _schedule_drafts(self, req: Request, n: int, budget: int, drafts: tuple[int, ...] | int) -> int:
        """Schedule a decode with its k drafts when the budget and free blocks allow: returns k, or 0
        (the request is then scheduled as a plain decode)."""
        k = drafts if isinstance(drafts, int) else len(drafts)
        if k and n == 1 and 1 + k <= budget and \
                self.kv_cache_manager.allocate_slots(req, 1, num_lookahead_tokens=k) is not None:
            return k
        return 0

    def _preempt_last(self) -> Request:
        """Preempt the lowest-priority, latest-arrived running request (the list's last)."""
        req = self._running.pop()
        self.kv_cache_manager.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0  # recompute prompt + output so far
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.push_preempted(req)
        return req

    def _schedule_waiting(self, num_new: dict[str, int], budget: int, timing: StepTimeBudget) -> None:
        kv = self.kv_cache_manager
        seats = len(self._running) + self._forks.num_seats(lambda rid: self._requests[rid].status is _RUNNING)
        adapters: set[Any] | None = None  # the runner's slots hold these: gathered when a LoRA request is at the head
        while self._waiting and budget > 0:
            req = self._waiting.peek()
            group = 1 + self._forks.count(req.request_id)
            if seats + group > self.config.max_num_seqs:
                break
            if req.lora is not None and adapters is None:
                adapters = {r.lora for r in self._running if r.lora is not None}
            if req.lora is not None and req.lora not in adapters and len(adapters) >= self.config.max_loras:
                break  # max_loras adapters run already: the head waits for one of them to finish
            blocks, num_hit = ([], 0) if req.skip_reading_prefix_cache else kv.get_computed_blocks(req)
            n = timing.fit_chunk(num_hit, min(req.num_tokens - num_hit, budget))  # the lookup never covers it all
            if n <= 0:
                break  # the step's time is spent; the head goes first next step
            got = kv.allocate_slots(req, n, computed_blocks=blocks, num_computed_tokens=num_hit)
            if got is None:
                break  # the head waits for blocks; nobody overtakes it
            self._waiting.pop()
            req.status = _RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            bisect.insort(self._running, req, key=self._urgency)  # after equal keys
            num_new[req.request_id] = n
            timing.take_chunk(num_hit, n)
            budget -= n
            seats += group
            if req.lora is not None and adapters is not None:
                adapters.add(req.lora)

    def _fork_children(self, parent: Request) -> None:
        """Fork the children of `parent`, whose prompt the step being applied has computed."""
        for child in self._forks.pop(parent.request_id):
            num_shared = parent.num_prompt_tokens - 1  # the child computes the last prompt token itself
            copies = self.kv_cache_manager.fork(parent.request_id, child, num_shared)
            if copies is None:  # no block for its copy: it computes its prompt itself
                self._waiting.push_preempted(child)
                continue
            child.status = _RUNNING
            child.num_computed_tokens = num_shared
            child.num_cached_tokens = parent.num_cached_tokens
            bisect.insort(self._running, child, key=self._urgency)
            if copies:
                self._pending_copies[child.request_id] = copies

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]) -> list[RequestEvent]:
        """Apply one step's sampled tokens; finish requests on eos, stop token ids or max_tokens.

        Args:
            output: what `schedule()` returned for this step.
            sampled: per request whose ScheduledRequest has samples=True, one token, or for a request
                with k drafts its accepted drafts then the target's own next token (1 to k + 1
                tokens); entries for requests finished since `schedule()` (e.g. aborted) are ignored.

        Returns:
            One event per request that got a token, in schedule order; a finish event's request
            has already been freed. Finishes made through `finish()` are not repeated here.
        """
        pending = collect_samples(output, sampled, self._requests)  # validates everything before mutating
        events = []
        any_finished = False
        for req, num_drafts, tokens in pending:
            if self._forks.count(req.request_id):  # its first token: its prompt is computed
                self._fork_children(req)
            req.num_computed_tokens -= num_drafts - (len(tokens) - 1)  # roll back over rejected drafts
            appended: list[int] = []
            status = None
            for token in tokens:  # a stop inside an accepted run ends the request there
                req.append_output_token(token)
                appended.append(token)
                status = req.stop_status(token)
                if status is not None:
                    break
            if status is None:
                events.append(RequestEvent(req.request_id, tuple(appended)))
                continue
            self._release(req, status)
            any_finished = True
            stop_id = appended[-1] if status is RequestStatus.FINISHED_STOPPED else None
            events.append(RequestEvent(req.request_id, tuple(appended), status.finish_reason, stop_id))
        if any_finished:  # one pass, not one list.remove per finished request
            self._running = [r for r in self._running if r.status is _RUNNING]
        return events

    def finish(self, request_id: str, status: RequestStatus, *, discard_cached: bool | None = None) -> RequestEvent | None:
        """End a request with a finished status and free its blocks: the one free path.

        Idempotent: unknown or already finished ids return None and change nothing. A request
        finished between `schedule()` and `update()` is skipped by that update. Children still
        waiting for this request's prompt become ordinary waiting requests. `discard_cached`
        drops the prefix-cache hashes of its blocks (their KV may be unwritten: a failed step);
        None means "when the status is FINISHED_ERROR".

        Returns:
            The request's finish event (no new tokens), or None.
        """
        if not isinstance(status, RequestStatus) or not status.is_finished:
            raise ValueError(f"finish() needs a finished RequestStatus, got {status!r}")
        req = self._requests.get(request_id)
        if req is None:
            return None
        if req.status is _RUNNING:
            self._running.remove(req)
        elif not self._forks.remove(req):
            self._waiting.remove(req)
        if discard_cached is None:
            discard_cached = status is RequestStatus.FINISHED_ERROR
        self._release(req, status, discard_cached)
        for orphan in reversed(self._forks.pop(request_id)):  # at the front, in their order
            self._waiting.push_preempted(orphan)
        return RequestEvent(request_id, (), status.finish_reason)

    def _release(self, req: Request, status: RequestStatus, discard_cached: bool = False) -> None:
        # The caller removes `req` from the running list or the waiting queue.
        req.status = status
        del self._requests[req.request_id]
        self.kv_cache_manager.free(req.request_id, discard_cached=discard_cached)

    def check_integrity(self) -> None:
        """Raise RuntimeError with the numbers if scheduler or KV accounting is inconsistent."""
        check_integrity(self.config, self._requests, self._running, list(self._waiting), self._forks,
                        self.kv_cache_manager)

"""EngineCore: the step loop. Owns the scheduler, the request states and the runner handle.

Everything here runs on the event-loop thread except `runner.execute`, which runs on the MLX thread.
One step is three calls:

    output = scheduler.schedule()                      # plain ids, counts, block tables
    rows = await executor.execute(step_input)          # the only place MLX runs; failures bisected
    self._postprocess(output, rows)                    # tokens -> EngineOutputs; finishes free blocks

`rows` holds one RowResult per request with something to report (metrale.engine.step). The core's
EngineOutputs go to `on_outputs` once per step (and when requests end outside a step): the text
front-end (metrale.engine.streams) in this process, or the pipe to it from an engine process. The
front-end ends a request through `finish` (a stop string, its own output processing failed).

Faults are contained per request: a request whose forward fails alone (metrale.engine.executor), or
whose own output processing raises (detokenize, stop strings, delivery: the front-end calls `finish`),
ends with an error and nothing else. The engine dies only on a broken invariant of its own, or when steps keep failing with
no request succeeding (FATAL_FAILED_STEPS in a row): then every open stream ends with an error at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from metrale.engine.executor import StepExecutor
from metrale.engine.metrics import EngineMetrics
from metrale.engine.mlx_thread import MLXThread
from metrale.engine.pooling import PoolingRow
from metrale.engine.request_groups import RequestGroups
from metrale.engine.request_state import RequestState
from metrale.engine.runner import ModelRunner, PromptLogprobsRow, SamplingRow, StepInput
from metrale.engine.step import EngineOutput, RowError, RowResult
from metrale.engine.step_stats import StepStats
from metrale.errors import EngineDeadError
from metrale.failpoints import NO_FAILPOINTS, Failpoints, InjectedFault
from metrale.pooling_params import PoolingParams
from metrale.sampling_params import SamplingParams
from metrale.speculative.speculator import Speculator
from scheduler import FinishReason, LoraRef, Request, RequestEvent, RequestStatus, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)
FATAL_FAILED_STEPS = 3  # steps in a row in which requests failed and none succeeded


class EngineCore:
    """Runs steps while there is work; delivers every request exactly one final delta."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, mlx_thread: MLXThread,
                 metrics: EngineMetrics, failpoints: Failpoints = NO_FAILPOINTS,
                 speculator: Speculator | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        """`clock` times each step (schedule, forward, outputs) for the scheduler's step cost model (tests inject one)."""
        self.scheduler = scheduler
        self.runner = runner
        self.metrics = metrics
        self.states: dict[str, RequestState] = {}
        self.num_steps = 0
        self.num_finished = 0
        self.dead: BaseException | None = None
        self.step_started: float | None = None  # monotonic start of the step in flight
        self.mean_step_s = 0.0  # moving average of step durations
        self._executor = StepExecutor(runner, mlx_thread)
        self._stats = StepStats(metrics, scheduler)
        self._failpoints = failpoints
        self._pending_aborts: set[str] = set()
        self._wake = asyncio.Event()
        self._failed_steps_in_a_row = 0
        self._speculator = speculator
        self._clock = clock
        self._finished_since_step: list[str] = []  # told to the runner with the next step
        self._groups = RequestGroups()  # parallel sampling's sequences
        self.on_outputs: Callable[[list[EngineOutput]], None] | None = None  # the front-end, set by the owner
        self._outbox: list[EngineOutput] = []
        self._flushing = False

    @property
    def peak_kv_usage(self) -> float:
        return self._stats.peak_kv_usage

    # ---- called by AsyncEngine (event-loop thread) ----

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
               eos_token_ids: tuple[int, ...], max_tokens: int, priority: int = 0) -> None:
        """Queue a request; raises the scheduler's typed rejections and changes nothing then.
        `max_tokens` is the effective limit (params may leave it to the engine)."""
        self.submit_group([request_id], prompt_token_ids, [params], eos_token_ids=eos_token_ids,
                          max_tokens=max_tokens, priority=priority)

    def submit_group(self, request_ids: Sequence[str], prompt_token_ids: list[int], params: Sequence[SamplingParams],
                     *, eos_token_ids: tuple[int, ...], max_tokens: int, priority: int = 0,
                     lora: LoraRef | None = None, pooling: PoolingParams | None = None) -> None:
        """Queue one sequence per id over the same prompt, each with its params: with several, a request
        group (parallel sampling) whose first sequence computes the prompt and the others fork from it
        (scheduler/forks.py). The group lives and dies together: aborting its first id aborts every
        sequence, and one sequence's error fails the others. `lora`: the adapter every sequence runs with.
        Raises the scheduler's typed rejections and changes nothing then. `pooling`: an embedding request
        (one id): its prompt is computed like any other (reading no prefix cache: every position's hidden
        state is pooled), then it ends with its vector (EngineOutput.embedding) and its blocks are freed;
        nothing is sampled."""
        if pooling is not None and len(request_ids) != 1:
            raise ValueError(f"an embedding request is one sequence, got {len(request_ids)} ids")
        requests = [Request(
            request_id=request_id, prompt_token_ids=prompt_token_ids, max_tokens=max_tokens,
            eos_token_ids=eos_token_ids, stop_token_ids=tuple(p.stop_token_ids or ()),
            ignore_eos=p.ignore_eos, min_tokens=p.min_tokens, priority=priority,
            skip_reading_prefix_cache=p.prompt_logprobs is not None or pooling is not None, lora=lora)
            for request_id, p in zip(request_ids, params)]
        self.scheduler.add(requests[0], forks=requests[1:])
        for request_id, p in zip(request_ids, params):
            state = RequestState(request_id, p, len(prompt_token_ids), pooling, max_tokens)
            if len(request_ids) > 1:
                state.group = (request_ids[0], len(request_ids))
            self.states[request_id] = state
        if len(requests) > 1:
            self._groups.add(request_ids)
        self._stats.refresh_gauges()
        self._wake.set()

    def abort(self, request_id: str) -> bool:
        """Mark a request (or every live sequence of the group whose first id it is) for abort; it ends
        at the next step boundary. False if unknown or finished."""
        live = self._groups.live_of_head(request_id)
        if live is not None:  # a group's first id: every sequence still running
            if all(member in self._pending_aborts for member in live):
                return False
            self._pending_aborts.update(live)
            self._wake.set()
            return True
        if request_id not in self.states or request_id in self._pending_aborts:
            return False
        self._pending_aborts.add(request_id)
        self._wake.set()
        return True

    def finish(self, request_id: str, reason: FinishReason, error: RowError | None = None) -> None:
        """The front-end ended a request (a stop string matched, or its output processing failed):
        free its blocks now. Idempotent."""
        self._finish(request_id, reason, error.exception(request_id) if error is not None else None)
        self._flush()

    @property
    def num_unfinished(self) -> int:
        return len(self.states)

    # ---- the loop ----

    async def run_forever(self) -> None:
        """The engine loop task. An exception here means no more progress: every request fails."""
        try:
            while True:
                if not self.states:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._apply_aborts()
                self._flush()
                if self.states:
                    await self.step()
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # the loop itself broke: fail everyone, report dead
            logger.exception("engine loop stopped")
            self.die(error)
            raise

    def die(self, error: BaseException) -> None:
        """The engine cannot continue: every open stream ends with an error now."""
        self.dead = error
        self.fail_all(EngineDeadError(f"engine loop stopped: {type(error).__name__}: {error}"))
        self._flush()

    async def step(self) -> None:
        if not self._schedule_failpoint():
            return
        timed_from = self._clock()  # the whole step, host work included, teaches max_step_ms's cost model
        if self._speculator is not None:
            decoding = [r for r in self.scheduler.running if self.states[r.request_id].pooling is None]
            self.scheduler.update_draft_token_ids(
                self._speculator.propose(decoding, lambda request_id: self.states[request_id].params))
        output = self.scheduler.schedule()
        if not output.scheduled:
            raise RuntimeError(f"scheduler made no progress with {self.scheduler.num_waiting} waiting "
                               f"and {self.scheduler.num_running} running requests")
        self._stats.begin(output, self.states)
        self.step_started = time.monotonic()
        try:
            rows = await self._executor.execute(self._step_input(output))
        finally:
            self._note_step_time(time.monotonic() - self.step_started)
            self.step_started = None
        self._contain_failures(output, rows)
        sampled = {request_id: row.token_ids for request_id, row in rows.items() if row.token_ids}
        if self._speculator is not None:
            self.metrics.record_speculation(**vars(self._speculator.record(output, sampled)))
        self._apply_aborts()  # an abort that arrived during the step wins over its last token
        for row in rows.values():
            state = self.states.get(row.request_id)
            if state is not None and row.prompt_logprobs is not None:
                state.record_prompt_logprobs(row.prompt_logprobs.first_position, row.prompt_logprobs.logprobs)
            if state is not None and row.error is not None:  # e.g. its grammar did not compile
                logger.warning("request %s failed in step %d: %s", row.request_id, self.num_steps, row.error.message)
                self._finish(row.request_id, FinishReason.ERROR, row.error.exception(row.request_id))
            elif state is not None and row.embedding is not None:
                self._finish_pooled(state, row.embedding)
        self._postprocess(output, rows, sampled)
        self.num_steps += 1
        self._flush()
        if not any(row.error is not None for row in rows.values()):  # a failed step's time says nothing
            self.scheduler.observe_step(output, self._clock() - timed_from)

    def _flush(self) -> None:
        """Hand the outputs gathered so far to `on_outputs` (which may call `finish`, adding more)."""
        if self._flushing or self.on_outputs is None:
            return
        self._flushing = True
        try:
            while self._outbox:
                batch, self._outbox = self._outbox, []
                self.on_outputs(batch)
        finally:
            self._flushing = False

    def _schedule_failpoint(self) -> bool:
        """The `schedule` failpoint: a fault for one request fails it; any other skips this step."""
        if not self._failpoints:
            return True
        try:
            self._failpoints.check_any("schedule", list(self.states))
        except InjectedFault as fault:
            logger.warning("step %d not scheduled: %s", self.num_steps, fault)
            if fault.request_id is not None:
                self._finish(fault.request_id, FinishReason.ERROR, fault)
                self._flush()
            return False
        return True

    def _step_input(self, output: SchedulerOutput) -> StepInput:
        """The runner's input: sampling rows, the contexts of drafts it proposes, who ended."""
        rows, contexts, prompt_rows, pooling_rows = [], {}, [], []
        for scheduled in output.scheduled:
            request = self.scheduler.get_request(scheduled.request_id)
            state = self.states[scheduled.request_id]
            params = state.params
            if state.pooling is not None:  # an embedding request: pooled, never sampled
                pooling_rows.append(PoolingRow(scheduled.request_id, request.num_prompt_tokens, scheduled.samples,
                                               state.pooling.normalize, state.pooling.dimensions))
                continue
            if params.prompt_logprobs is not None and scheduled.start_position < request.num_prompt_tokens - 1:
                prompt_rows.append(PromptLogprobsRow(scheduled.request_id, params.prompt_logprobs,
                                                     request.prompt_token_ids))
            if scheduled.num_draft_tokens:  # verified, not sampled
                if not scheduled.draft_token_ids:
                    contexts[scheduled.request_id] = tuple(request.all_token_ids)
            elif scheduled.samples:
                rows.append(SamplingRow(scheduled.request_id, params,
                                        request.prompt_token_ids, request.output_token_ids))
        finished, self._finished_since_step = tuple(self._finished_since_step), []
        return StepInput(output, tuple(rows), contexts, finished, tuple(prompt_rows), tuple(pooling_rows))

    def _note_step_time(self, seconds: float) -> None:
        self.mean_step_s = seconds if not self.mean_step_s else 0.9 * self.mean_step_s + 0.1 * seconds

    def _contain_failures(self, output: SchedulerOutput, rows: dict[str, RowResult]) -> None:
        """End the culprits of a failed step (their blocks' hashes discarded); die when nothing succeeds."""
        culprits = [row for row in rows.values() if row.error is not None and row.error.kv_unwritten]
        for row in culprits:
            aborted = row.request_id in self._pending_aborts
            self._finish(row.request_id, FinishReason.ABORT if aborted else FinishReason.ERROR,
                         None if aborted else row.error.exception(row.request_id), discard_cached=True)
        if len(culprits) < len(output.scheduled):  # some request (or every one) got its token
            self._failed_steps_in_a_row = 0
        else:
            self._failed_steps_in_a_row += 1
            if self._failed_steps_in_a_row >= FATAL_FAILED_STEPS:
                raise RuntimeError(f"{FATAL_FAILED_STEPS} steps in a row failed for every request; the last "
                                   f"error: {culprits[0].error.kind}: {culprits[0].error.message}")

    def _postprocess(self, output: SchedulerOutput, rows: dict[str, RowResult],
                     sampled: dict[str, tuple[int, ...]]) -> None:
        now = time.monotonic()
        for event in self.scheduler.update(output, sampled):
            state = self.states.get(event.request_id)
            if state is None:
                continue
            self._stats.tokens(state, len(event.new_token_ids), now)
            self._deliver(state, event, rows.get(event.request_id), now)
        self._stats.end(output)

    def _deliver(self, state: RequestState, event: RequestEvent, row: RowResult | None, now: float) -> None:
        """The request's output of this step; a request that ended is retired."""
        finish_reason = event.finish_reason
        if finish_reason is None and row is not None and row.stopped:  # its grammar is complete
            self.scheduler.finish(event.request_id, RequestStatus.FINISHED_STOPPED)
            finish_reason = FinishReason.STOP
        logprob = row.logprob if row is not None else None
        self._outbox.append(state.on_tokens(event.new_token_ids, finish_reason, event.stop_token_id is not None,
                                            [logprob] if logprob is not None else None))
        if finish_reason is not None:
            self._retire(state, finish_reason, now)

    # ---- finishing: one path ----

    def _finish(self, request_id: str, reason: FinishReason, error: BaseException | None = None, *,
                discard_cached: bool | None = None) -> None:
        """End a request outside a step's tokens (abort, error, or a stop the front-end found): free its
        blocks, report its final output, account for it. Idempotent; never raises for one request's sake."""
        state = self.states.get(request_id)
        if state is None:
            return
        self.scheduler.finish(request_id, RequestStatus.finished_with(reason), discard_cached=discard_cached)
        self._outbox.append(state.final_output(reason, error))
        siblings = self._groups.siblings(request_id) if reason is FinishReason.ERROR else []
        self._retire(state, reason, time.monotonic())
        for sibling in siblings:  # one sequence fails: the request fails, every sequence ends
            self._finish(sibling, FinishReason.ERROR,
                         RuntimeError(f"sequence {request_id!r} of this request failed: {error}"),
                         discard_cached=discard_cached)

    def _finish_pooled(self, state: RequestState, embedding: bytes) -> None:
        """An embedding request's prompt is computed: it ends with its vector, its blocks freed now."""
        now = time.monotonic()
        self.scheduler.finish(state.request_id, RequestStatus.FINISHED_STOPPED)
        self._stats.pooled(state, now)
        self._outbox.append(state.pooled_output(embedding))
        self._retire(state, FinishReason.STOP, now)

    def _apply_aborts(self) -> None:
        while self._pending_aborts:
            self._finish(self._pending_aborts.pop(), FinishReason.ABORT)

    def fail_all(self, error: BaseException) -> None:
        """End every unfinished request with an error (the engine cannot continue). One request's
        failure to end never keeps the others from ending."""
        for request_id in list(self.states):
            try:
                self._finish(request_id, FinishReason.ERROR, error, discard_cached=True)
            except Exception:
                logger.exception("request %s: freeing it failed; ending its stream anyway", request_id)
                state = self.states.pop(request_id, None)
                if state is not None:
                    self._outbox.append(state.final_output(FinishReason.ERROR, error))

    def abort_all(self) -> None:
        for request_id in list(self.states):
            self.abort(request_id)
        self._apply_aborts()
        self._flush()

    def _retire(self, state: RequestState, finish_reason: FinishReason, now: float) -> None:
        del self.states[state.request_id]
        self._groups.retire(state.request_id)
        self._pending_aborts.discard(state.request_id)
        self._finished_since_step.append(state.request_id)  # the runner drops what it kept for it
        if self._speculator is not None:
            self._speculator.forget(state.request_id)
        self.num_finished += 1
        self._stats.finished(state, finish_reason, now)

"""EngineCore: the step loop. Owns the scheduler, the request states and the runner handle.

Everything here runs on the event-loop thread except `runner.execute`, which runs on the MLX thread.
One step is three calls:

    output = scheduler.schedule()                      # plain ids, counts, block tables
    outcome = await executor.execute(output, rows)     # the only place MLX runs; failures bisected
    self._postprocess(output, outcome)                 # tokens -> text -> streams; finishes free blocks

Faults are contained per request: a request whose forward fails alone (metrale.engine.executor), or
whose own output processing raises (detokenize, stop strings, delivery), ends with an error and
nothing else. The engine dies only on a broken invariant of its own, or when steps keep failing with
no request succeeding (FATAL_FAILED_STEPS in a row): then every open stream ends with an error at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from metrale.engine.executor import StepExecutor, StepOutcome
from metrale.engine.metrics import EngineMetrics, FinishedRequestStats, IterationStats
from metrale.engine.mlx_thread import MLXThread
from metrale.engine.request_state import RequestState
from metrale.engine.runner import ModelRunner, PromptLogprobsRow, SamplingRow, StepInput
from metrale.engine.stream import OutputChannel
from metrale.errors import EngineDeadError
from metrale.failpoints import NO_FAILPOINTS, Failpoints, InjectedFault
from metrale.sampling_params import SamplingParams
from metrale.speculative.speculator import Speculator
from metrale.text.processor import RequestText
from scheduler import Request, RequestEvent, RequestStatus, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)
FATAL_FAILED_STEPS = 3  # steps in a row in which requests failed and none succeeded


class _Group:
    """The sequences of one request with n > 1 (parallel sampling): its first id and the ids still live."""

    __slots__ = ("head", "live")

    def __init__(self, head: str, live: list[str]) -> None:
        self.head = head
        self.live = live


class EngineCore:
    """Runs steps while there is work; delivers every request exactly one final delta."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, mlx_thread: MLXThread,
                 metrics: EngineMetrics, failpoints: Failpoints = NO_FAILPOINTS,
                 speculator: Speculator | None = None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.metrics = metrics
        self.states: dict[str, RequestState] = {}
        self.num_steps = 0
        self.num_finished = 0
        self.peak_kv_usage = 0.0
        self.dead: BaseException | None = None
        self.step_started: float | None = None  # monotonic start of the step in flight
        self.mean_step_s = 0.0  # moving average of step durations
        self._executor = StepExecutor(runner, mlx_thread)
        self._failpoints = failpoints
        self._pending_aborts: set[str] = set()
        self._wake = asyncio.Event()
        self._failed_steps_in_a_row = 0
        self._prefix_seen = (0, 0)
        self._speculator = speculator
        self._finished_since_step: list[str] = []  # told to the runner with the next step
        self._groups: dict[str, _Group] = {}  # a request group's live sequence ids -> their group
        self._groups_by_head: dict[str, _Group] = {}  # a group's first id -> the group, while any sequence lives

    # ---- called by AsyncEngine (event-loop thread) ----

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, text: RequestText, *,
               eos_token_ids: tuple[int, ...], max_tokens: int, priority: int = 0) -> OutputChannel:
        """Queue a request and return the channel its deltas go to; raises the scheduler's typed
        rejections and changes nothing then. `max_tokens` is the effective limit (params may leave it
        to the engine)."""
        (channel,) = self.submit_group([request_id], prompt_token_ids, [params], [text], eos_token_ids=eos_token_ids,
                                       max_tokens=max_tokens, priority=priority)
        return channel

    def submit_group(self, request_ids: Sequence[str], prompt_token_ids: list[int], params: Sequence[SamplingParams],
                     texts: Sequence[RequestText], *, eos_token_ids: tuple[int, ...], max_tokens: int,
                     priority: int = 0) -> list[OutputChannel]:
        """Queue one sequence per id over the same prompt, each with its params and text: with several,
        a request group (parallel sampling) whose first sequence computes the prompt and the others
        fork from it (scheduler/forks.py). The group lives and dies together: aborting its first id
        aborts every sequence, and one sequence's error fails the others. Raises the scheduler's typed
        rejections and changes nothing then."""
        requests = [Request(
            request_id=request_id, prompt_token_ids=prompt_token_ids, max_tokens=max_tokens,
            eos_token_ids=eos_token_ids, stop_token_ids=tuple(p.stop_token_ids or ()),
            ignore_eos=p.ignore_eos, min_tokens=p.min_tokens, priority=priority,
            skip_reading_prefix_cache=p.prompt_logprobs is not None) for request_id, p in zip(request_ids, params)]
        self.scheduler.add(requests[0], forks=requests[1:])
        channels = []
        for request_id, p, text in zip(request_ids, params, texts):
            state = RequestState(request_id, p, len(prompt_token_ids), text)
            self.states[request_id] = state
            channels.append(state.channel)
        if len(requests) > 1:
            group = _Group(request_ids[0], list(request_ids))
            self._groups.update((request_id, group) for request_id in request_ids)
            self._groups_by_head[group.head] = group
        self._refresh_gauges()
        self._wake.set()
        return channels

    def abort(self, request_id: str, channel: OutputChannel | None = None) -> bool:
        """Mark a request for abort; it ends at the next step boundary. False if unknown or finished,
        or when `channel` is given and is not that request's (a stale stream of a reused id)."""
        group = self._groups_by_head.get(request_id) if channel is None else None
        if group is not None:  # a group's first id: every sequence still running
            if all(member in self._pending_aborts for member in group.live):
                return False
            self._pending_aborts.update(group.live)
            self._wake.set()
            return True
        state = self.states.get(request_id)
        if state is None or request_id in self._pending_aborts or (channel is not None and state.channel is not channel):
            return False
        self._pending_aborts.add(request_id)
        self._wake.set()
        return True

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

    async def step(self) -> None:
        if not self._schedule_failpoint():
            return
        if self._speculator is not None:
            self._speculator.propose(self.scheduler.running, lambda request_id: self.states[request_id].params)
        output = self.scheduler.schedule()
        if not output.scheduled:
            raise RuntimeError(f"scheduler made no progress with {self.scheduler.num_waiting} waiting "
                               f"and {self.scheduler.num_running} running requests")
        num_prompt_tokens = self._mark_scheduled(output)
        self.step_started = time.monotonic()
        try:
            outcome = await self._executor.execute(self._step_input(output))
        finally:
            self._note_step_time(time.monotonic() - self.step_started)
            self.step_started = None
        self._contain_failures(output, outcome)
        if self._speculator is not None:
            self.metrics.record_speculation(**vars(self._speculator.record(output, outcome.sampled_token_ids)))
        self._apply_aborts()  # an abort that arrived during the step wins over its last token
        for request_id, (first_position, logprobs) in outcome.prompt_logprobs.items():
            state = self.states.get(request_id)
            if state is not None:
                state.record_prompt_logprobs(first_position, logprobs)
        for request_id, error in outcome.request_errors.items():  # e.g. its grammar did not compile
            logger.warning("request %s failed in step %d: %s", request_id, self.num_steps, error)
            self._finish(request_id, "error", error)
        self._postprocess(output, outcome, num_prompt_tokens)
        self.num_steps += 1

    def _schedule_failpoint(self) -> bool:
        """The `schedule` failpoint: a fault for one request fails it; any other skips this step."""
        if not self._failpoints:
            return True
        try:
            self._failpoints.check_any("schedule", list(self.states))
        except InjectedFault as fault:
            logger.warning("step %d not scheduled: %s", self.num_steps, fault)
            if fault.request_id is not None:
                self._finish(fault.request_id, "error", fault)
            return False
        return True

    def _step_input(self, output: SchedulerOutput) -> StepInput:
        """The runner's input: sampling rows, the contexts of drafts it proposes, who ended."""
        rows, contexts, prompt_rows = [], {}, []
        for scheduled in output.scheduled:
            request = self.scheduler.get_request(scheduled.request_id)
            params = self.states[scheduled.request_id].params
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
        return StepInput(output, tuple(rows), contexts, finished, tuple(prompt_rows))

    def _mark_scheduled(self, output: SchedulerOutput) -> int:
        """Stamp first-scheduled times; returns the prompt tokens computed this step."""
        now = time.monotonic()
        num_prompt_tokens = 0
        for scheduled in output.scheduled:
            state = self.states[scheduled.request_id]
            if state.times.first_scheduled is None:
                state.times.first_scheduled = now
                state.num_cached_tokens = max(0, self.scheduler.get_request(scheduled.request_id).num_cached_tokens)
            end = scheduled.start_position + len(scheduled.token_ids)
            num_prompt_tokens += max(0, min(end, state.num_prompt_tokens) - scheduled.start_position)
        return num_prompt_tokens

    def _note_step_time(self, seconds: float) -> None:
        self.mean_step_s = seconds if not self.mean_step_s else 0.9 * self.mean_step_s + 0.1 * seconds

    def _contain_failures(self, output: SchedulerOutput, outcome: StepOutcome) -> None:
        """End the culprits of a failed step (their blocks' hashes discarded); die when nothing succeeds."""
        for request_id, error in outcome.failed.items():
            reason = "abort" if request_id in self._pending_aborts else "error"
            self._finish(request_id, reason, error if reason == "error" else None, discard_cached=True)
        if len(outcome.failed) < len(output.scheduled):  # some request (or every one) got its token
            self._failed_steps_in_a_row = 0
        else:
            self._failed_steps_in_a_row += 1
            if self._failed_steps_in_a_row >= FATAL_FAILED_STEPS:
                raise RuntimeError(f"{FATAL_FAILED_STEPS} steps in a row failed for every request; the last "
                                   f"error: {next(iter(outcome.failed.values()))!r}")

    def _postprocess(self, output: SchedulerOutput, outcome: StepOutcome, num_prompt_tokens: int) -> None:
        now = time.monotonic()
        ttfts: list[float] = []
        itls: list[float] = []
        num_generated = 0
        for event in self.scheduler.update(output, outcome.sampled_token_ids):
            state = self.states.get(event.request_id)
            if state is None:
                continue
            if event.new_token_ids:
                num_generated += len(event.new_token_ids)
                times = state.times
                if times.first_token is None:
                    times.first_token = now
                    ttfts.append(now - times.arrival)
                else:
                    itls.append(now - times.last_token)
                times.last_token = now
            try:
                self._deliver(state, event, outcome, now)
            except Exception as error:  # this request's own output processing failed: it alone ends
                logger.exception("request %s failed while processing its output", event.request_id)
                self._finish(event.request_id, "error", error)
        self._record_iteration(output, num_prompt_tokens, num_generated, tuple(ttfts), tuple(itls))

    def _deliver(self, state: RequestState, event: RequestEvent, outcome: StepOutcome, now: float) -> None:
        """Detokenize, match stop strings and hand the delta to the request's stream."""
        finish_reason = event.finish_reason
        if finish_reason is None and event.request_id in outcome.stopped_request_ids:  # its grammar is complete
            self.scheduler.finish(event.request_id, RequestStatus.FINISHED_STOPPED)
            finish_reason = "stop"
        logprob = outcome.logprobs.get(event.request_id)
        delta = state.on_tokens(event.new_token_ids, finish_reason,
                                hide_last_token=event.stop_token_id is not None,
                                logprobs=[logprob] if logprob is not None else None)
        self._failpoints.check("deliver", state.request_id)
        if delta.stop_string_matched and finish_reason is None:
            self.scheduler.finish(event.request_id, RequestStatus.FINISHED_STOPPED)
        state.channel.put(delta.output)
        if delta.output.finish_reason is not None:
            self._retire(state, delta.output.finish_reason, now)

    # ---- finishing: one path ----

    def _finish(self, request_id: str, reason: str, error: BaseException | None = None, *,
                discard_cached: bool | None = None) -> None:
        """End a request outside a step's tokens ("abort" | "error"): free its blocks, deliver its
        final delta, account for it. Idempotent; never raises for one request's sake."""
        state = self.states.get(request_id)
        if state is None:
            return
        self.scheduler.finish(request_id, RequestStatus.from_finish_reason(reason), discard_cached=discard_cached)
        state.channel.put(state.final_output(reason), error=error)
        group = self._groups.get(request_id)
        self._retire(state, reason, time.monotonic())
        if reason == "error" and group is not None:  # one sequence fails: the request fails, every sequence ends
            for sibling in list(group.live):
                self._finish(sibling, "error", RuntimeError(f"sequence {request_id!r} of this request failed: {error}"),
                             discard_cached=discard_cached)

    def _apply_aborts(self) -> None:
        while self._pending_aborts:
            self._finish(self._pending_aborts.pop(), "abort")

    def fail_all(self, error: BaseException) -> None:
        """End every unfinished request with an error (the engine cannot continue). One request's
        failure to end never keeps the others from ending."""
        for request_id in list(self.states):
            try:
                self._finish(request_id, "error", error, discard_cached=True)
            except Exception:
                logger.exception("request %s: freeing it failed; ending its stream anyway", request_id)
                state = self.states.pop(request_id, None)
                if state is not None:
                    state.channel.put(state.final_output("error"), error=error)

    def abort_all(self) -> None:
        for request_id in list(self.states):
            self.abort(request_id)
        self._apply_aborts()

    def _retire(self, state: RequestState, finish_reason: str, now: float) -> None:
        del self.states[state.request_id]
        group = self._groups.pop(state.request_id, None)
        if group is not None:
            group.live.remove(state.request_id)
            if not group.live:
                del self._groups_by_head[group.head]
        self._pending_aborts.discard(state.request_id)
        self._finished_since_step.append(state.request_id)  # the runner drops what it kept for it
        if self._speculator is not None:
            self._speculator.forget(state.request_id)
        self.num_finished += 1
        times = state.times
        scheduled = times.first_scheduled
        first = times.first_token
        self.metrics.record_finished(FinishedRequestStats(
            finish_reason=finish_reason,
            e2e_latency_s=now - times.arrival,
            queue_time_s=(scheduled if scheduled is not None else now) - times.arrival,
            prefill_time_s=(first - scheduled) if first is not None and scheduled is not None else 0.0,
            decode_time_s=(times.last_token - first) if first is not None else 0.0,
            num_prompt_tokens=state.num_prompt_tokens,
            num_generation_tokens=state.num_output_tokens,
        ))
        self._refresh_gauges()

    # ---- metrics ----

    def _record_iteration(self, output: SchedulerOutput, num_prompt_tokens: int, num_generated: int,
                          ttfts: tuple[float, ...], itls: tuple[float, ...]) -> None:
        kv = self.scheduler.kv_cache_manager
        self.peak_kv_usage = max(self.peak_kv_usage, kv.usage)
        queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        seen_queries, seen_hits = self._prefix_seen
        self._prefix_seen = (queries, hits)
        self.metrics.record_iteration(IterationStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_generated,
            num_batched_tokens=output.num_batched_tokens,
            time_to_first_tokens_s=ttfts,
            inter_token_latencies_s=itls,
            num_preemptions=len(output.preempted_request_ids),
            prefix_cache_queries=queries - seen_queries,
            prefix_cache_hits=hits - seen_hits,
        ))

    def _refresh_gauges(self) -> None:
        kv = self.scheduler.kv_cache_manager
        self.metrics.set_gauges(self.scheduler.num_running, self.scheduler.num_waiting, kv.usage)

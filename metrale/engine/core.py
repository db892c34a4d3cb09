"""EngineCore: the step loop. Owns the scheduler, the request states and the runner handle.

Everything here runs on the event-loop thread except `runner.execute`, which runs on the MLX thread.
One step is three calls:

    output = scheduler.schedule()                      # plain ids, counts, block tables
    result = await mlx_thread.run(runner.execute, ...)  # the only place MLX runs
    self._postprocess(output, result)                  # tokens -> text -> streams; finishes free blocks
"""

from __future__ import annotations

import asyncio
import logging
import time

from metrale.errors import EngineDeadError
from metrale.engine.metrics import EngineMetrics, FinishedRequestStats, IterationStats
from metrale.engine.mlx_thread import MLXThread
from metrale.engine.request_state import RequestState
from metrale.engine.stream import OutputChannel
from metrale.engine.runner import ModelRunner, SamplingRow, StepInput, StepResult
from metrale.sampling_params import SamplingParams
from metrale.text.processor import RequestText
from scheduler import Request, RequestStatus, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)


class EngineCore:
    """Runs steps while there is work; delivers every request exactly one final delta."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, mlx_thread: MLXThread,
                 metrics: EngineMetrics) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.metrics = metrics
        self.states: dict[str, RequestState] = {}
        self.num_steps = 0
        self.num_finished = 0
        self.peak_kv_usage = 0.0
        self.dead: BaseException | None = None
        self._mlx = mlx_thread
        self._pending_aborts: set[str] = set()
        self._finished_ids: list[str] = []  # retired since the last step: the runner drops their state
        self._wake = asyncio.Event()
        self._prefix_seen = (0, 0)

    # ---- called by AsyncEngine (event-loop thread) ----

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, text: RequestText, *,
               eos_token_ids: tuple[int, ...], priority: int = 0) -> OutputChannel:
        """Queue a request and return the channel its deltas go to; raises the scheduler's typed
        rejections and changes nothing then."""
        request = Request(
            request_id=request_id, prompt_token_ids=prompt_token_ids, max_tokens=params.max_tokens,
            eos_token_ids=eos_token_ids, stop_token_ids=tuple(params.stop_token_ids or ()),
            ignore_eos=params.ignore_eos, min_tokens=params.min_tokens, priority=priority)
        state = RequestState(request_id, params, len(prompt_token_ids), text)
        self.scheduler.add(request)
        self.states[request_id] = state
        self._wake.set()
        return state.channel

    def abort(self, request_id: str) -> bool:
        """Mark a request for abort; it ends at the next step boundary. False if unknown/finished."""
        if request_id not in self.states or request_id in self._pending_aborts:
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
            self.dead = error
            self.fail_all(EngineDeadError(f"engine loop stopped: {type(error).__name__}: {error}"))
            raise

    async def step(self) -> None:
        output = self.scheduler.schedule()
        if not output.scheduled:
            raise RuntimeError(f"scheduler made no progress with {self.scheduler.num_waiting} waiting "
                               f"and {self.scheduler.num_running} running requests")
        num_prompt_tokens = self._mark_scheduled(output)
        try:
            result = await self._mlx.run(self.runner.execute, self._step_input(output))
        except Exception as error:  # a failed step fails its requests, not the engine
            logger.exception("step %d failed; failing its %d requests", self.num_steps, len(output.scheduled))
            self._apply_aborts()
            for scheduled in output.scheduled:
                self._fail(scheduled.request_id, error)
            self.num_steps += 1
            return
        self._apply_aborts()  # an abort that arrived during the step wins over its last token
        for request_id, error in (result.failed_requests or {}).items():  # e.g. its grammar did not compile
            logger.warning("request %s failed in step %d: %s", request_id, self.num_steps, error)
            self._fail(request_id, error)
        self._postprocess(output, result, num_prompt_tokens)
        self.num_steps += 1

    def _step_input(self, output: SchedulerOutput) -> StepInput:
        rows = []
        for scheduled in output.scheduled:
            if scheduled.samples:
                request = self.scheduler.get_request(scheduled.request_id)
                rows.append(SamplingRow(scheduled.request_id, self.states[scheduled.request_id].params,
                                        request.prompt_token_ids, request.output_token_ids))
        finished, self._finished_ids = tuple(self._finished_ids), []
        return StepInput(output, tuple(rows), finished)

    def _mark_scheduled(self, output: SchedulerOutput) -> int:
        """Stamp first-scheduled times; returns the prompt tokens computed this step."""
        now = time.monotonic()
        num_prompt_tokens = 0
        for scheduled in output.scheduled:
            state = self.states[scheduled.request_id]
            if state.times.first_scheduled is None:
                state.times.first_scheduled = now
            end = scheduled.start_position + len(scheduled.token_ids)
            num_prompt_tokens += max(0, min(end, state.num_prompt_tokens) - scheduled.start_position)
        return num_prompt_tokens

    def _postprocess(self, output: SchedulerOutput, result: StepResult, num_prompt_tokens: int) -> None:
        now = time.monotonic()
        ttfts: list[float] = []
        itls: list[float] = []
        num_generated = 0
        for event in self.scheduler.update(output, result.sampled_token_ids):
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
            finish_reason = event.finish_reason
            if finish_reason is None and event.request_id in result.stopped_request_ids:  # its grammar is complete
                self.scheduler.finish(event.request_id, RequestStatus.FINISHED_STOPPED)
                finish_reason = "stop"
            logprobs = result.logprobs.get(event.request_id) if result.logprobs else None
            delta = state.on_tokens(event.new_token_ids, finish_reason,
                                    hide_last_token=event.stop_token_id is not None,
                                    logprobs=[logprobs] if logprobs is not None else None)
            if delta.stop_string_matched and finish_reason is None:
                self.scheduler.finish(event.request_id, RequestStatus.FINISHED_STOPPED)
            state.channel.put(delta.output)
            if delta.output.finish_reason is not None:
                self._retire(state, delta.output.finish_reason, now)
        self._record_iteration(output, num_prompt_tokens, num_generated, tuple(ttfts), tuple(itls))

    # ---- finishing ----

    def _apply_aborts(self) -> None:
        while self._pending_aborts:
            request_id = self._pending_aborts.pop()
            state = self.states.get(request_id)
            if state is None:
                continue
            self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
            state.channel.put(state.final_output("abort"))
            self._retire(state, "abort", time.monotonic())

    def _fail(self, request_id: str, error: BaseException) -> None:
        state = self.states.get(request_id)
        if state is None:
            return
        self.scheduler.finish(request_id, RequestStatus.FINISHED_ERROR)
        state.channel.put(state.final_output("error"), error=error)
        self._retire(state, "error", time.monotonic())

    def fail_all(self, error: BaseException) -> None:
        """End every unfinished request with an error (the engine cannot continue)."""
        for request_id in list(self.states):
            self._fail(request_id, error)

    def abort_all(self) -> None:
        for request_id in list(self.states):
            self.abort(request_id)
        self._apply_aborts()

    def _retire(self, state: RequestState, finish_reason: str, now: float) -> None:
        del self.states[state.request_id]
        self._finished_ids.append(state.request_id)
        self._pending_aborts.discard(state.request_id)
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
        if not self.states:
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

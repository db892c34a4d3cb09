"""StepStats: what the engine core sees, turned into EngineMetrics samples (event-loop thread).

Per step: the prompt tokens of requests that got their first token (whole prompts, and how many of them the prefix
cache served: vLLM's prompt_tokens and prompt_tokens_cached), the tokens generated, time to first token and inter-token
latencies, KV usage and prefix-cache hits; per finished request its phases; the queue gauges. One
step is `begin(output)`, `tokens(...)` per request that got tokens, then `end(output)`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from metrale.engine.metrics import EngineMetrics, FinishedRequestStats, IterationStats
from metrale.engine.request_state import RequestState
from scheduler import FinishReason, Scheduler, SchedulerOutput


class StepStats:
    """Accounts steps and finished requests into `metrics`; keeps the peak KV usage."""

    def __init__(self, metrics: EngineMetrics, scheduler: Scheduler) -> None:
        self.metrics = metrics
        self.peak_kv_usage = 0.0
        self._scheduler = scheduler
        self._prefix_seen = (0, 0)  # the KV manager's (queries, hits) at the last step
        self._num_prompt_tokens = 0
        self._num_cached_prompt_tokens = 0
        self._num_generated = 0
        self._groups: dict[str, tuple[int, int]] = {}  # a live group's first id -> (sequences left, longest so far)
        self._ttfts: list[float] = []
        self._itls: list[float] = []

    def begin(self, output: SchedulerOutput, states: Mapping[str, RequestState]) -> None:
        """Stamp first-scheduled times and count the requests this step preempted."""
        now = time.monotonic()
        self._num_prompt_tokens = self._num_cached_prompt_tokens = self._num_generated = 0
        self._ttfts, self._itls = [], []
        for scheduled in output.scheduled:
            state = states[scheduled.request_id]
            if state.times.first_scheduled is None:
                state.times.first_scheduled = now
                state.num_cached_tokens = max(0, self._scheduler.get_request(scheduled.request_id).num_cached_tokens)
        for request_id in output.preempted_request_ids:
            preempted = states.get(request_id)
            if preempted is not None:
                preempted.num_preemptions += 1

    def tokens(self, state: RequestState, count: int, now: float) -> None:
        """`count` new tokens of one request this step."""
        if not count:
            return
        self._num_generated += count
        times = state.times
        if times.first_token is None:  # the prompt is done: counted whole, once (a recompute is not counted)
            times.first_token = now
            self._ttfts.append(now - times.arrival)
            self._prompt_done(state)
        else:
            self._itls.append(now - times.last_token)
        times.last_token = now

    def pooled(self, state: RequestState, now: float) -> None:
        """An embedding request's prompt is computed: its whole prompt counted, as a first token's would be
        (no time to first token: it has none)."""
        times = state.times
        if times.first_token is None:
            times.first_token = times.last_token = now
            self._prompt_done(state)

    def _prompt_done(self, state: RequestState) -> None:
        """A request's prompt is computed: counted whole, and how much of it the prefix cache served."""
        self._num_prompt_tokens += state.num_prompt_tokens
        self._num_cached_prompt_tokens += min(state.num_cached_tokens, state.num_prompt_tokens)

    def end(self, output: SchedulerOutput) -> None:
        kv = self._scheduler.kv_cache_manager
        self.peak_kv_usage = max(self.peak_kv_usage, kv.usage)
        queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        seen_queries, seen_hits = self._prefix_seen
        self._prefix_seen = (queries, hits)
        self.metrics.record_iteration(IterationStats(
            num_running=self._scheduler.num_running,
            num_waiting=self._scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generated,
            num_batched_tokens=output.num_batched_tokens,
            time_to_first_tokens_s=tuple(self._ttfts),
            inter_token_latencies_s=tuple(self._itls),
            num_preemptions=len(output.preempted_request_ids),
            prefix_cache_queries=queries - seen_queries,
            prefix_cache_hits=hits - seen_hits,
            num_cached_prompt_tokens=self._num_cached_prompt_tokens,
        ))

    def finished(self, state: RequestState, finish_reason: FinishReason, now: float) -> None:
        times = state.times
        scheduled = times.first_scheduled
        first = times.first_token
        params_n, longest = self._request_ended(state)
        self.metrics.record_finished(FinishedRequestStats(
            finish_reason=finish_reason,
            e2e_latency_s=now - times.arrival,
            queue_time_s=(scheduled if scheduled is not None else now) - times.arrival,
            prefill_time_s=(first - scheduled) if first is not None and scheduled is not None else 0.0,
            decode_time_s=(times.last_token - first) if first is not None else 0.0,
            num_prompt_tokens=state.num_prompt_tokens,
            num_generation_tokens=state.num_output_tokens,
            inference_time_s=(times.last_token - scheduled) if first is not None and scheduled is not None else 0.0,
            num_preemptions=state.num_preemptions,
            max_tokens_param=state.max_tokens if state.pooling is None else None,  # vLLM: sampling requests only
            params_n=params_n,
            max_num_generation_tokens=longest,
        ))
        self.refresh_gauges()

    def _request_ended(self, state: RequestState) -> tuple[int | None, int | None]:
        """(n, its longest sequence) when `state` is the last sequence of its request to end, else (None, None)."""
        if state.group is None:
            return 1, state.num_output_tokens
        head, size = state.group
        left, longest = self._groups.pop(head, (size, 0))
        left, longest = left - 1, max(longest, state.num_output_tokens)
        if left > 0:
            self._groups[head] = (left, longest)
            return None, None
        return size, longest

    def refresh_gauges(self) -> None:
        kv = self._scheduler.kv_cache_manager
        self.metrics.set_gauges(self._scheduler.num_running, self._scheduler.num_waiting, kv.usage)

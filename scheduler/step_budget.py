"""One step's time budget: decodes first, then prompt chunks cut to fit a time limit.

A step that decodes running requests is limited to the smaller of

    max_step_ms                                     (absolute; SchedulerConfig.max_step_ms)
    max_step_factor x the time of its decodes alone  (relative; SchedulerConfig.max_step_factor: the median
                                                     of recent decode-only steps, or the cost model's estimate)

The relative limit follows the machine's load and the model's size without a number in milliseconds: with a
factor k the streams' steps take about k times their decode-only time while a long prompt runs, and the prompt
gets the other (k - 1) parts of each step. Estimates come from a StepCostModel (scheduler/step_cost.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.step_cost import StepCostModel, StepWork

PROBE_TOKENS = 8  # the smaller probe chunk while the cost model learns (the other is twice it)
EXTRAPOLATION = 2  # a step holds at most this many times the tokens of the largest step the model measured


@dataclass(frozen=True, slots=True)
class StepLimit:
    """What bounds a step that decodes: seconds, a multiple of its decodes' own time, or both."""

    max_seconds: float | None = None
    decode_factor: float | None = None

    @property
    def is_set(self) -> bool:
        return self.max_seconds is not None or self.decode_factor is not None

    def seconds(self, cost_model: StepCostModel, decodes: StepWork) -> float | None:
        """The limit of a step whose decodes are `decodes`; None while the model cannot estimate them."""
        limit = self.max_seconds
        if self.decode_factor is not None:
            decode_s = cost_model.decode_step_seconds(decodes)
            if decode_s is None:
                return None
            relative = self.decode_factor * decode_s
            limit = relative if limit is None else min(limit, relative)
        return limit


class StepTimeBudget:
    """One step's time budget: decodes first, then prompt chunks sized to fit the step's limit.

    Inactive (every chunk keeps its size) when the step has no decodes to protect or no limit is set.
    While the cost model knows too little, the first chunk is max(min_chunk, 8) tokens, or twice that when
    `probe` is set (the scheduler alternates it): small steps of two sizes that teach it.
    The first chunk of a step gets at least `min_chunk` tokens even over the limit, so prompts progress.
    A step holds at most EXTRAPOLATION x the tokens of the largest step the model measured (its estimates
    of bigger ones are guesses), and when the model's decode-only steps are stale, one step runs without
    prompt chunks to measure them again (the relative limit is a multiple of them).
    """

    def __init__(self, cost_model: StepCostModel, limit: StepLimit, min_chunk: int, decodes: StepWork,
                 probe: bool = False) -> None:
        self._cost_model = cost_model
        self._limit = limit
        self._min_chunk = min_chunk
        self._probe_chunk = max(min_chunk, PROBE_TOKENS) * (2 if probe else 1)
        self._decodes = decodes
        self._work = decodes
        self._active = limit.is_set and decodes.num_tokens > 0
        self._limit_s: float | None = None  # resolved at the first chunk, once the model can estimate
        self._chunks = 0

    @property
    def limit_s(self) -> float | None:
        """This step's limit in seconds; None when inactive or while the cost model knows too little."""
        if self._active and self._limit_s is None:
            self._limit_s = self._limit.seconds(self._cost_model, self._decodes)
        return self._limit_s

    def planned_s(self) -> float | None:
        """The estimate of the step as planned so far (None when inactive or unknown): to log against the
        measured time."""
        return self._cost_model.estimate(self._work) if self._active else None

    def fit_chunk(self, start: int, num_tokens: int) -> int:
        """How many of `num_tokens` prompt tokens starting at position `start` fit (0: none this step)."""
        if not self._active or num_tokens <= 1:
            return num_tokens
        limit_s = self.limit_s
        if limit_s is None or self._cost_model.estimate(self._work) is None:
            return min(num_tokens, self._probe_chunk) if self._chunks == 0 else 0
        if self._chunks == 0 and self._cost_model.wants_decode_step():
            return 0
        floor = min(num_tokens, self._min_chunk) if self._chunks == 0 else 0
        largest = self._cost_model.largest_known_step()
        if largest is not None:
            num_tokens = min(num_tokens, max(0, EXTRAPOLATION * largest - self._work.num_tokens))
        return max(floor, self._largest_fitting(start, num_tokens, limit_s))

    def take_chunk(self, start: int, num_tokens: int) -> None:
        """Charge a scheduled prompt chunk (after fit_chunk; not a decode: those are charged already)."""
        if self._active and num_tokens > 0:
            self._work = self._work + StepWork.of_chunk(start, num_tokens)
            self._chunks += 1

    def _largest_fitting(self, start: int, num_tokens: int, limit_s: float) -> int:
        """Binary search: the cost is monotone in the chunk length."""
        lo, hi = 0, num_tokens  # lo fits (adds nothing), look for the largest fitting
        while lo < hi:
            mid = (lo + hi + 1) // 2
            estimate = self._cost_model.estimate(self._work + StepWork.of_chunk(start, mid))
            if estimate is not None and estimate <= limit_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

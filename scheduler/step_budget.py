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

import math
from dataclasses import dataclass

from scheduler.step_cost import StepCostModel, StepWork

PROBE_TOKENS = 8  # the smaller probe chunk while the cost model learns (the other is twice it)
EXTRAPOLATION = 2  # a step holds at most this many times the tokens of the largest step the model measured
MAX_KNEE = 64  # the most tokens a chunk over the limit gets (see StepTimeBudget.knee)


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
    The first chunk of a step gets at least `min_chunk` tokens even over the limit, so prompts progress;
    when fewer than that fit, the step is over its limit anyway, and the chunk gets the knee instead (the
    fewest tokens whose own cost outweighs what any chunk costs at its context: reading its KV), if larger:
    a step over the limit then moves the prompt by more than a token or two (at 4k of context on 135M a
    1-token chunk cost 38 ms, a 16-token one 114 ms: 7 ms a token, as in a 512-token chunk).
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
        """The estimate of the step as planned so far, to log against the measured time: None when inactive,
        unknown, or when the step holds no prompt chunk. A step of decodes alone decides nothing by the
        estimate, and asking for it refits the cost model (every step is observed): 0.4-0.8 ms of the
        engine's thread per decode step on the 2-core dev VM, beside the kernels' threads."""
        return self._cost_model.estimate(self._work) if self._active and self._chunks > 0 else None

    def fit_chunk(self, start: int, num_tokens: int) -> int:
        """How many of `num_tokens` prompt tokens starting at position `start` fit (0: none this step)."""
        if not self._active or num_tokens <= 1:
            return num_tokens
        limit_s = self.limit_s
        if limit_s is None or self._cost_model.estimate(self._work) is None:
            return min(num_tokens, self._probe_chunk) if self._chunks == 0 else 0
        if self._chunks == 0 and self._cost_model.wants_decode_step():
            return 0
        wanted = num_tokens
        largest = self._cost_model.largest_known_step()
        if largest is not None:
            num_tokens = min(num_tokens, max(0, EXTRAPOLATION * largest - self._work.num_tokens))
        fitting = self._largest_fitting(start, num_tokens, limit_s)
        if self._chunks > 0 or fitting >= min(wanted, self._min_chunk):
            return fitting
        return min(wanted, max(self._min_chunk, min(num_tokens, self.knee(start))))

    def knee(self, start: int) -> int:
        """The fewest tokens n (1..MAX_KNEE) of a chunk at `start` whose per-token part of the marginal cost
        is at least its per-chunk part (the context's KV reads): at n the chunk runs at half its best
        per-token rate or better. 1 when the model charges nothing per chunk."""
        base = self._cost_model.estimate(self._work)
        one, two = (self._cost_model.estimate(self._work + StepWork.of_chunk(start, n)) for n in (1, 2))
        if base is None or one is None or two is None:
            return 1
        per_token = two - one  # the cost of one more token (its matmuls, its attention over the context)
        per_chunk = (one - base) - per_token  # what the chunk costs whatever its length
        if per_token <= 0.0:
            return MAX_KNEE if per_chunk > 0.0 else 1
        return max(1, min(MAX_KNEE, math.ceil(per_chunk / per_token)))

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

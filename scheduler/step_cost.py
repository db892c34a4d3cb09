"""What a step costs in time, learned online from the steps the engine ran (pure Python, deterministic).

A step's time is modelled as

    seconds = fixed + per_token * num_tokens + per_pair * num_attention_pairs

num_tokens: positions computed (decode tokens, prompt chunk tokens, drafts): the matmuls.
num_attention_pairs: (query, key) pairs the attention scores: a chunk of n tokens starting at position
s adds n*s + n*(n+1)/2; a decode at position s adds s + 1. At 8k context this term rivals the matmuls.

`OnlineStepCost` fits the three coefficients by non-negative least squares over the most recent steps
that held a prompt chunk and, separately, the most recent decode-only steps (decodes are most steps: a
single window of them would leave the per-token cost of a chunk unidentified). Same observations in,
same estimates out: the engine measures, the scheduler only reads numbers.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


def attention_pairs(start: int, num_tokens: int) -> int:
    """(query, key) pairs of `num_tokens` causal queries at positions start..start+num_tokens-1."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True, slots=True)
class StepWork:
    """The size of a step (or of part of one), in the units the cost model charges."""

    num_tokens: int = 0
    num_attention_pairs: int = 0
    has_chunk: bool = False  # some request computes more than one known token

    def __add__(self, other: StepWork) -> StepWork:
        return StepWork(self.num_tokens + other.num_tokens, self.num_attention_pairs + other.num_attention_pairs,
                        self.has_chunk or other.has_chunk)

    @classmethod
    def of_chunk(cls, start: int, num_tokens: int) -> StepWork:
        return cls(num_tokens, attention_pairs(start, num_tokens), num_tokens > 1)


class StepCostModel(Protocol):
    """Estimates a step's time; tests inject a fixed one, the engine uses OnlineStepCost."""

    def estimate(self, work: StepWork) -> float | None:
        """Seconds the step would take, or None while the model knows too little."""

    def observe(self, work: StepWork, seconds: float) -> None:
        """A step of this size took `seconds`."""


class OnlineStepCost:
    """Non-negative least squares of (fixed, per_token, per_pair) over recent steps.

    `estimate` answers once `min_observations` steps with a prompt chunk were seen and the kept steps
    have two token counts at least (one alone cannot tell the fixed cost from the per-token one).

    Args:
        window: steps kept per kind (with a prompt chunk / decode only).
        min_observations: steps with a prompt chunk before `estimate` answers.
    """

    def __init__(self, window: int = 32, min_observations: int = 2) -> None:
        if window < 1 or min_observations < 1 or min_observations > window:
            raise ValueError(f"need 1 <= min_observations ({min_observations}) <= window ({window})")
        self._chunk_steps: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._decode_steps: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._min_observations = min_observations
        self._coefficients: tuple[float, float, float] | None = None
        self._stale = False  # steps observed since the last fit

    def observe(self, work: StepWork, seconds: float) -> None:
        if not seconds >= 0.0 or work.num_tokens <= 0:  # `not >=` also rejects NaN
            raise ValueError(f"a step of {work.num_tokens} tokens cannot take {seconds!r} s")
        window = self._chunk_steps if work.has_chunk else self._decode_steps
        window.append((float(work.num_tokens), float(work.num_attention_pairs), float(seconds)))
        self._stale = True

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(fixed s, s per token, s per pair), refitted when read after new steps: the engine observes
        every step, and the fit (~0.6 ms in pure Python over full windows) runs only when estimates are
        asked for (max_step_ms set), once per step at most."""
        if self._stale:
            self._stale = False
            steps = list(itertools.chain(self._chunk_steps, self._decode_steps))
            if len(self._chunk_steps) >= self._min_observations and len({tokens for tokens, _, _ in steps}) >= 2:
                self._coefficients = _nonnegative_fit(steps)
        return self._coefficients

    def estimate(self, work: StepWork) -> float | None:
        coefficients = self.coefficients
        if coefficients is None:
            return None
        fixed, per_token, per_pair = coefficients
        return fixed + per_token * work.num_tokens + per_pair * work.num_attention_pairs


def _nonnegative_fit(rows: Iterable[tuple[float, float, float]]) -> tuple[float, float, float]:
    """The least-squares (fixed, per_token, per_pair) >= 0: the best of the unconstrained fits on
    every subset of the three terms whose coefficients are all non-negative (7 subsets, 3x3 at most)."""
    samples = [(1.0, tokens, pairs, seconds) for tokens, pairs, seconds in rows]
    scale = [max(abs(s[j]) for s in samples) or 1.0 for j in range(3)]  # pairs reach 1e7: scale columns
    xs = [[s[j] / scale[j] for j in range(3)] for s in samples]
    ys = [s[3] for s in samples]
    best: tuple[float, tuple[float, float, float]] | None = None
    for size in (3, 2, 1):
        for terms in itertools.combinations(range(3), size):
            coef = _solve_normal_equations(xs, ys, terms)
            if coef is None or min(coef) < 0.0:
                continue
            full = [0.0, 0.0, 0.0]
            for j, c in zip(terms, coef):
                full[j] = c
            residual = sum((y - sum(f * x for f, x in zip(full, row))) ** 2 for row, y in zip(xs, ys))
            if best is None or residual < best[0] * (1 - 1e-12):
                best = (residual, (full[0] / scale[0], full[1] / scale[1], full[2] / scale[2]))
    return best[1] if best is not None else (0.0, 0.0, 0.0)


def _solve_normal_equations(xs: list[list[float]], ys: list[float], terms: tuple[int, ...]) -> list[float] | None:
    """Least squares on the columns `terms` by Gaussian elimination; None when they are degenerate."""
    k = len(terms)
    a = [[sum(row[i] * row[j] for row in xs) for j in terms] + [sum(row[i] * y for row, y in zip(xs, ys))]
         for i in terms]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12 * max(1.0, abs(a[col][col])) or a[pivot][col] == 0.0:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(k):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [v - factor * p for v, p in zip(a[r], a[col])]
    return [a[i][k] / a[i][i] for i in range(k)]


class StepTimeBudget:
    """One step's time budget: decodes first, then prompt chunks sized to fit `limit_s`.

    Inactive (every chunk keeps its size) when the step has no decodes to protect or no limit is set.
    While the cost model knows too little, the first chunk is `min_chunk` tokens, or twice that when
    `probe` is set (the scheduler alternates it): small steps of two sizes that teach it.
    The first chunk of a step gets at least `min_chunk` tokens even over the limit, so prompts progress.
    """

    def __init__(self, cost_model: StepCostModel, limit_s: float | None, min_chunk: int, decodes: StepWork,
                 probe: bool = False) -> None:
        self._cost_model = cost_model
        self._limit_s = limit_s
        self._min_chunk = min_chunk
        self._probe_chunk = min_chunk * (2 if probe else 1)
        self._work = decodes
        self._active = limit_s is not None and decodes.num_tokens > 0
        self._chunks = 0

    def fit_chunk(self, start: int, num_tokens: int) -> int:
        """How many of `num_tokens` prompt tokens starting at position `start` fit (0: none this step)."""
        if not self._active or num_tokens <= 1:
            return num_tokens
        floor = min(num_tokens, self._min_chunk) if self._chunks == 0 else 0
        if self._cost_model.estimate(self._work) is None:
            fitted = min(num_tokens, self._probe_chunk) if self._chunks == 0 else 0
        else:
            fitted = max(floor, self._largest_fitting(start, num_tokens))
        return fitted

    def take_chunk(self, start: int, num_tokens: int) -> None:
        """Charge a scheduled chunk (after fit_chunk) to the step."""
        if self._active and num_tokens > 1:
            self._work = self._work + StepWork.of_chunk(start, num_tokens)
            self._chunks += 1

    def _largest_fitting(self, start: int, num_tokens: int) -> int:
        """Binary search: the cost is monotone in the chunk length."""
        lo, hi = 0, num_tokens  # lo fits (adds nothing), look for the largest fitting
        while lo < hi:
            mid = (lo + hi + 1) // 2
            estimate = self._cost_model.estimate(self._work + StepWork.of_chunk(start, mid))
            if estimate is not None and estimate <= self._limit_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

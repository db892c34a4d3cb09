"""What a step costs in time, learned online from the steps the engine ran (pure Python, deterministic).

A step's time is modelled as

    seconds = fixed + per_token * num_tokens + per_pair * num_attention_pairs

num_tokens: positions computed (decode tokens, prompt chunk tokens, drafts): the matmuls.
num_attention_pairs: (query, key) pairs the attention scores: a chunk of n tokens starting at position
s adds n*s + n*(n+1)/2; a decode at position s adds s + 1. At 8k context this term rivals the matmuls.

`OnlineStepCost` fits the three coefficients by non-negative least squares over the most recent steps
that held a prompt chunk and, separately, the most recent decode-only steps (decodes are most steps: a
single window of them would leave the per-token cost of a chunk unidentified; a decode-only step older
than the chunk window is left out: it is from another load). Same observations in,
same estimates out: the engine measures, the scheduler only reads numbers.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from scheduler.output import SchedulerOutput

RECENT_DECODE_STEPS = 3  # decode-only steps whose median is the streams' step time now (one runs per 16 chunk steps)


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

    @classmethod
    def of_output(cls, output: SchedulerOutput) -> StepWork:
        """The work of a planned step: its tokens (drafts included) and their attention pairs; it has a chunk
        when a request computes several known tokens or one that does not sample (a 1-token prompt chunk)."""
        num_tokens = num_pairs = 0
        has_chunk = False
        for s in output.scheduled:
            num_tokens += s.num_tokens
            num_pairs += attention_pairs(s.start_position, s.num_tokens)
            has_chunk = has_chunk or len(s.token_ids) > 1 or not s.samples  # a decode always samples
        return cls(num_tokens, num_pairs, has_chunk)


class StepCostModel(Protocol):
    """Estimates a step's time; tests inject a fixed one, the engine uses OnlineStepCost."""

    def estimate(self, work: StepWork) -> float | None:
        """Seconds the step would take, or None while the model knows too little."""

    def observe(self, work: StepWork, seconds: float) -> None:
        """A step of this size took `seconds`."""

    def largest_known_step(self) -> int | None:
        """The most tokens of a recent step with a prompt chunk (None: no bound). A step of many more tokens
        than were measured is an extrapolation: big chunks are compute-bound where small ones ride the
        decodes' weight reads, which a linear fit of small steps does not know."""

    def decode_step_seconds(self, decodes: StepWork) -> float | None:
        """What a step of these decodes alone takes now (None while unknown): the base of a relative limit."""

    def wants_decode_step(self) -> bool:
        """Its decode-only steps are stale (a long prompt has run beside the streams): one step without
        prompt chunks would tell it what the streams' step costs under today's load."""


class OnlineStepCost:
    """Non-negative least squares of (fixed, per_token, per_pair) over recent steps.

    `estimate` answers once `min_observations` steps with a prompt chunk were seen and the kept steps
    have two token counts at least (one alone cannot tell the fixed cost from the per-token one). When
    later the kept steps have one token count only (a long prompt whose chunks settled at one size beside
    the same streams), the last fit is scaled by one factor to match them: it still follows the load.

    Args:
        window: steps kept per kind (with a prompt chunk / decode only).
        min_observations: steps with a prompt chunk before `estimate` answers.
    """

    def __init__(self, window: int = 32, min_observations: int = 2) -> None:
        if window < 1 or min_observations < 1 or min_observations > window:
            raise ValueError(f"need 1 <= min_observations ({min_observations}) <= window ({window})")
        self._chunk_steps: deque[tuple[float, float, float]] = deque(maxlen=window)
        # decode-only steps, each with the number of chunk steps seen before it: one older than the chunk
        # window (`window` chunk steps since) is from another load and is left out of the fit
        self._decode_steps: deque[tuple[float, float, float, int]] = deque(maxlen=window)
        self._num_chunk_steps = 0
        self._min_observations = min_observations
        self._coefficients: tuple[float, float, float] | None = None
        self._stale = False  # steps observed since the last fit

    def observe(self, work: StepWork, seconds: float) -> None:
        if not seconds >= 0.0 or work.num_tokens <= 0:  # `not >=` also rejects NaN
            raise ValueError(f"a step of {work.num_tokens} tokens cannot take {seconds!r} s")
        row = (float(work.num_tokens), float(work.num_attention_pairs), float(seconds))
        if work.has_chunk:
            self._chunk_steps.append(row)
            self._num_chunk_steps += 1
        else:
            self._decode_steps.append((*row, self._num_chunk_steps))
        self._stale = True

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(fixed s, s per token, s per pair), refitted when read after new steps: the engine observes
        every step, and the fit (~0.6 ms in pure Python over full windows) runs only when estimates are
        asked for (max_step_ms set), once per step at most."""
        if self._stale:
            self._stale = False
            oldest = self._num_chunk_steps - (self._chunk_steps.maxlen or 0)
            steps = list(itertools.chain(self._chunk_steps, (row[:3] for row in self._decode_steps if row[3] > oldest)))
            if len(self._chunk_steps) >= self._min_observations and len({tokens for tokens, _, _ in steps}) >= 2:
                self._coefficients = _nonnegative_fit(steps)
            elif self._coefficients is not None:  # e.g. a prompt's chunks settled at one size: keep the shape
                self._coefficients = _rescaled(self._coefficients, steps)
        return self._coefficients

    def largest_known_step(self) -> int | None:
        return int(max(tokens for tokens, _, _ in self._chunk_steps)) if self._chunk_steps else None

    def decode_step_seconds(self, decodes: StepWork) -> float | None:
        """The median measured time of the last RECENT_DECODE_STEPS decode-only steps when they had as many
        decodes (the fit extrapolates to small steps poorly: its fixed term drifts with the chunk steps'
        noise), else the estimate."""
        recent = [seconds for tokens, _, seconds, _ in itertools.islice(reversed(self._decode_steps), RECENT_DECODE_STEPS)
                  if tokens == decodes.num_tokens]
        return statistics.median(recent) if recent else self.estimate(decodes)

    def wants_decode_step(self) -> bool:
        """True once half the chunk window was observed after the newest decode-only step."""
        newest = self._decode_steps[-1][3] if self._decode_steps else 0
        return self._num_chunk_steps - newest >= max(1, (self._chunk_steps.maxlen or 0) // 2)

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


def _rescaled(coefficients: tuple[float, float, float],
              rows: Iterable[tuple[float, float, float]]) -> tuple[float, float, float]:
    """`coefficients` times the least-squares factor that fits `rows` (unchanged when they predict 0)."""
    fixed, per_token, per_pair = coefficients
    predicted = [(fixed + per_token * tokens + per_pair * pairs, seconds) for tokens, pairs, seconds in rows]
    norm = sum(p * p for p, _ in predicted)
    if norm <= 0.0:
        return coefficients
    factor = sum(p * y for p, y in predicted) / norm
    return fixed * factor, per_token * factor, per_pair * factor


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

"""What a step costs in time, learned online from the steps the engine ran (pure Python, deterministic).

A step's time is modelled as

    seconds = fixed + per_token * num_tokens + per_pair * num_attention_pairs + per_context * num_context_tokens

num_tokens: positions computed (decode tokens, prompt chunk tokens, drafts): the matmuls.
num_attention_pairs: (query, key) pairs the attention scores: a chunk of n tokens starting at position
s adds n*s + n*(n+1)/2; a decode at position s adds s + 1. At 8k context this term rivals the matmuls.
num_context_tokens: KV positions each scheduled request's attention reads, s + n per request: what a chunk
costs whatever its length. Measured on 135M (benchmarks/chunk_efficiency_bench.py): beside 4 decodes, a
1-token chunk at 8k of context cost ~56 ms and a 4-token one ~64 ms; a fit in pairs alone prices the
1-token chunk at a quarter of the 4-token one, so a step with a small chunk at a long context overshot its
limit 2-3x. For a decode the term equals its pairs; chunks of several sizes tell them apart.

`OnlineStepCost` fits the four coefficients by non-negative least squares over the most recent steps
that held a prompt chunk and, separately, the most recent decode-only steps (decodes are most steps: a
single window of them would leave the per-token cost of a chunk unidentified; a decode-only step older
than the chunk window is left out: it is from another load). Same observations in,
same estimates out: the engine measures, the scheduler only reads numbers.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

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
    num_context_tokens: int = 0  # KV positions read: per scheduled request, its context after the step

    def __add__(self, other: StepWork) -> StepWork:
        return StepWork(self.num_tokens + other.num_tokens, self.num_attention_pairs + other.num_attention_pairs,
                        self.has_chunk or other.has_chunk, self.num_context_tokens + other.num_context_tokens)

    @classmethod
    def of_chunk(cls, start: int, num_tokens: int) -> StepWork:
        return cls(num_tokens, attention_pairs(start, num_tokens), num_tokens > 1, start + num_tokens)

    @classmethod
    def of_decodes(cls, num_decodes: int, num_context_tokens: int) -> StepWork:
        """`num_decodes` one-token decodes reading `num_context_tokens` KV positions in all (= their pairs)."""
        return cls(num_decodes, num_context_tokens, False, num_context_tokens)

    @classmethod
    def of_output(cls, output: SchedulerOutput) -> StepWork:
        """The work of a planned step: its tokens (drafts included) and their attention pairs; it has a chunk
        when a request computes several known tokens or one that does not sample (a 1-token prompt chunk)."""
        num_tokens = num_pairs = num_context = 0
        has_chunk = False
        for s in output.scheduled:
            num_tokens += s.num_tokens
            num_pairs += attention_pairs(s.start_position, s.num_tokens)
            num_context += s.start_position + s.num_tokens
            has_chunk = has_chunk or len(s.token_ids) > 1 or not s.samples  # a decode always samples
        return cls(num_tokens, num_pairs, has_chunk, num_context)


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
    """Non-negative least squares of (fixed, per_token, per_pair, per_context) over recent steps.

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
        self._chunk_steps: deque[_Row] = deque(maxlen=window)
        # decode-only steps, each with the number of chunk steps seen before it: one older than the chunk
        # window (`window` chunk steps since) is from another load and is left out of the fit
        self._decode_steps: deque[tuple[_Row, int]] = deque(maxlen=window)
        self._num_chunk_steps = 0
        self._min_observations = min_observations
        self._coefficients: Coefficients | None = None
        self._stale = False  # steps observed since the last fit

    def observe(self, work: StepWork, seconds: float) -> None:
        if not seconds >= 0.0 or work.num_tokens <= 0:  # `not >=` also rejects NaN
            raise ValueError(f"a step of {work.num_tokens} tokens cannot take {seconds!r} s")
        row = _Row(work.num_tokens, work.num_attention_pairs, work.num_context_tokens, float(seconds))
        if work.has_chunk:
            self._chunk_steps.append(row)
            self._num_chunk_steps += 1
        else:
            self._decode_steps.append((row, self._num_chunk_steps))
        self._stale = True

    @property
    def coefficients(self) -> Coefficients | None:
        """(fixed s, s per token, s per pair, s per context token), refitted when read after new steps: the
        engine observes every step, and the fit (one pass over the kept steps, then 15 systems of 4x4 at
        most) runs only when estimates are asked for (a step limit set), once per step at most."""
        if self._stale:
            self._stale = False
            oldest = self._num_chunk_steps - (self._chunk_steps.maxlen or 0)
            steps = [*self._chunk_steps, *(row for row, seen in self._decode_steps if seen > oldest)]
            if len(self._chunk_steps) >= self._min_observations and len({row.tokens for row in steps}) >= 2:
                self._coefficients = _nonnegative_fit(steps)
            elif self._coefficients is not None:  # e.g. a prompt's chunks settled at one size: keep the shape
                self._coefficients = _rescaled(self._coefficients, steps)
        return self._coefficients

    def largest_known_step(self) -> int | None:
        return max(row.tokens for row in self._chunk_steps) if self._chunk_steps else None

    def decode_step_seconds(self, decodes: StepWork) -> float | None:
        """The median measured time of the last RECENT_DECODE_STEPS decode-only steps when they had as many
        decodes (the fit extrapolates to small steps poorly: its fixed term drifts with the chunk steps'
        noise), else the estimate."""
        recent = [row.seconds for row, _ in itertools.islice(reversed(self._decode_steps), RECENT_DECODE_STEPS)
                  if row.tokens == decodes.num_tokens]
        return statistics.median(recent) if recent else self.estimate(decodes)

    def wants_decode_step(self) -> bool:
        """True once half the chunk window was observed after the newest decode-only step."""
        newest = self._decode_steps[-1][1] if self._decode_steps else 0
        return self._num_chunk_steps - newest >= max(1, (self._chunk_steps.maxlen or 0) // 2)

    def estimate(self, work: StepWork) -> float | None:
        coefficients = self.coefficients
        if coefficients is None:
            return None
        return _predict(coefficients, (work.num_tokens, work.num_attention_pairs, work.num_context_tokens))


Coefficients = tuple[float, float, float, float]  # fixed s, s per token, s per attention pair, s per context token


class _Row(NamedTuple):
    """One observed step: its work and seconds."""

    tokens: int
    pairs: int
    context: int
    seconds: float


def _predict(coefficients: Coefficients, features: tuple[int, int, int]) -> float:
    fixed, *per = coefficients
    return fixed + sum(c * x for c, x in zip(per, features))


def _nonnegative_fit(rows: list[_Row]) -> Coefficients:
    """The least-squares coefficients >= 0: the best of the unconstrained fits on every subset of the four
    terms whose coefficients are all non-negative (15 subsets). The normal equations are summed once."""
    columns = [(1.0, row.tokens, row.pairs, row.context) for row in rows]
    scale = [max(abs(c[j]) for c in columns) or 1.0 for j in range(4)]  # pairs reach 1e7: scale columns
    xs = [[c[j] / scale[j] for j in range(4)] for c in columns]
    ys = [row.seconds for row in rows]
    gram = [[sum(x[i] * x[j] for x in xs) for j in range(4)] for i in range(4)]
    rhs = [sum(x[i] * y for x, y in zip(xs, ys)) for i in range(4)]
    best: tuple[float, list[float]] | None = None
    for size in (4, 3, 2, 1):
        for terms in itertools.combinations(range(4), size):
            coef = _solve([[gram[i][j] for j in terms] + [rhs[i]] for i in terms])
            if coef is None or min(coef) < 0.0:
                continue
            full = [0.0] * 4
            for j, c in zip(terms, coef):
                full[j] = c
            residual = sum((y - sum(f * v for f, v in zip(full, x))) ** 2 for x, y in zip(xs, ys))
            if best is None or residual < best[0] * (1 - 1e-12):
                best = (residual, full)
    if best is None:
        return (0.0, 0.0, 0.0, 0.0)
    fixed, per_token, per_pair, per_context = (c / s for c, s in zip(best[1], scale))
    return fixed, per_token, per_pair, per_context


def _rescaled(coefficients: Coefficients, rows: list[_Row]) -> Coefficients:
    """`coefficients` times the least-squares factor that fits `rows` (unchanged when they predict 0)."""
    predicted = [(_predict(coefficients, (row.tokens, row.pairs, row.context)), row.seconds) for row in rows]
    norm = sum(p * p for p, _ in predicted)
    if norm <= 0.0:
        return coefficients
    factor = sum(p * y for p, y in predicted) / norm
    fixed, per_token, per_pair, per_context = (c * factor for c in coefficients)
    return fixed, per_token, per_pair, per_context


def _solve(a: list[list[float]]) -> list[float] | None:
    """Gaussian elimination on the augmented k x (k + 1) system `a` (changed in place); None when degenerate."""
    k = len(a)
    size = max(abs(a[i][i]) for i in range(k)) or 1.0
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * size:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(k):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [v - factor * p for v, p in zip(a[r], a[col])]
    return [a[i][k] / a[i][i] for i in range(k)]

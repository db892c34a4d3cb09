"""Pooling: an embedding request's vector from the model's final hidden states (after the final norm, before
the LM head), on the MLX thread.

An embedding request runs through the scheduler like a prompt (chunked, batched with other work); each step
its rows of the step's hidden states (T, D) are pooled:

    hidden   [ a a a | b b | c c c c ]     a: its last chunk (final)   b: a middle chunk   c: another request
    last     the final chunk's last row                     (Qwen3-Embedding and most decoder embedders)
    mean     running sum of every chunk's rows / prompt tokens    (kept between steps in float32)
    cls      the first chunk's first row                    (kept between steps)

then, after its last chunk: the first `dimensions` values (Matryoshka), L2-normalised unless asked not to,
as float32 little-endian bytes (RowResult.embedding). A chunk that starts at position 0 starts over (a
recompute after preemption). What is kept between steps is updated only after the step's evaluation
succeeded (`PooledStep.commit`), so a failed step that is retried never counts a chunk twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kernels.runtime import mx
from metrale.engine.step import RowResult
from metrale.pooling_params import POOLING_TYPES
from scheduler import ScheduledRequest

_NORM_EPS = 1e-12


@dataclass(frozen=True, slots=True)
class PoolingRow:
    """An embedding request scheduled this step. final: this chunk ends its prompt (its vector is reported)."""

    request_id: str
    num_prompt_tokens: int
    final: bool
    normalize: bool = True
    dimensions: int | None = None


class PooledStep:
    """One step's pooling: lazy arrays to evaluate with the step, then `commit` for the vectors."""

    def __init__(self, kept: dict[str, tuple[mx.array, int]], updates: dict[str, tuple[mx.array, int]],
                 finals: list[tuple[str, mx.array]]) -> None:
        self._kept = kept
        self._updates = updates  # request id -> (its new partial (D,), positions it covers)
        self._finals = finals  # (request id, its vector (k,)) in scheduled order

    @property
    def arrays(self) -> list[mx.array]:
        return [partial for partial, _ in self._updates.values()] + [vector for _, vector in self._finals]

    def commit(self) -> list[RowResult]:
        """Keep the partials of unfinished requests; the final vectors as RowResults (float32 LE bytes)."""
        self._kept.update(self._updates)
        rows = []
        for request_id, vector in self._finals:
            self._kept.pop(request_id, None)
            rows.append(RowResult(request_id, embedding=bytes(memoryview(vector))))
        return rows


class Pooler:
    """Pools embedding requests' rows; keeps the mean / cls partials of requests still in their prompt."""

    def __init__(self, pooling: str) -> None:
        if pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {POOLING_TYPES}, got {pooling!r}")
        self.pooling = pooling
        self._kept: dict[str, tuple[mx.array, int]] = {}  # request id -> (partial (D,) float32, positions covered)

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._kept.pop(request_id, None)

    def plan(self, hidden: mx.array, scheduled: Sequence[ScheduledRequest], rows: Sequence[PoolingRow]) -> PooledStep:
        """hidden (T, D): the step's final hidden states, rows in scheduled order (drafts included)."""
        if not rows:  # most steps: no embedding request scheduled
            return PooledStep(self._kept, {}, [])
        by_id = {row.request_id: row for row in rows}
        updates: dict[str, tuple[mx.array, int]] = {}
        finals: list[tuple[str, mx.array]] = []
        offset = 0
        for s in scheduled:
            row = by_id.get(s.request_id)
            if row is not None:
                chunk = hidden[offset:offset + len(s.token_ids)]  # (n, D)
                partial = self._partial(row, s, chunk)
                if row.final:
                    finals.append((row.request_id, _finish(self._vector(row, partial, chunk), row)))
                elif partial is not None:
                    updates[row.request_id] = partial
            offset += s.num_tokens
        return PooledStep(self._kept, updates, finals)

    def _partial(self, row: PoolingRow, s: ScheduledRequest, chunk: mx.array) -> tuple[mx.array, int] | None:
        """The request's partial after this chunk (mean: sum of rows; cls: the first row), or None for last."""
        if self.pooling == "last":
            return None
        kept = None if s.start_position == 0 else self._kept.get(row.request_id)
        if s.start_position != (kept[1] if kept is not None else 0):
            raise RuntimeError(f"request {row.request_id!r}: chunk starts at {s.start_position} but "
                               f"{kept[1] if kept is not None else 0} positions were pooled")
        covered = s.start_position + len(s.token_ids)
        if self.pooling == "cls":
            return (kept[0] if kept is not None else chunk[0].astype(mx.float32)), covered  # (D,)
        chunk_sum = chunk.astype(mx.float32).sum(axis=0)  # (D,)
        return (kept[0] + chunk_sum if kept is not None else chunk_sum), covered

    def _vector(self, row: PoolingRow, partial: tuple[mx.array, int] | None, chunk: mx.array) -> mx.array:
        if self.pooling == "last":
            return chunk[-1].astype(mx.float32)  # (D,)
        total, covered = partial
        if covered != row.num_prompt_tokens:
            raise RuntimeError(f"request {row.request_id!r}: pooled {covered} of {row.num_prompt_tokens} positions")
        return total / row.num_prompt_tokens if self.pooling == "mean" else total  # (D,)


def _finish(vector: mx.array, row: PoolingRow) -> mx.array:
    """The first `dimensions` values (D,) -> (k,), L2-normalised unless the request asked not to."""
    if row.dimensions is not None:
        vector = vector[:row.dimensions]
    if row.normalize:
        vector = vector / mx.maximum(mx.linalg.norm(vector), _NORM_EPS)
    return vector

"""Per-request token restrictions that outlive a step: grammar matchers and allowed-id masks (MLX thread).

The runner owns one `TokenConstraints`. Each step, for the rows that sample:

    forget(finished ids)              drop the state of requests that ended (StepInput.finished_request_ids)
    masks = prepare(rows)             host: an (S, W) int32 bitmask, filled while the forward runs
                                      (grammar rows from their matcher, allowed_token_ids rows from a
                                      mask made once per request, AND-ed; other rows all ones), or
                                      None when no row is constrained
    ... the sampler applies masks.bitmask ...
    outcome = accept(rows, tokens, masks)   each grammar row's matcher takes its sampled token

A request's matcher is created the first time one of its rows is seen (waiting here for its grammar if
the compile is still running) and has then accepted exactly the request's output tokens. Recompute after
preemption resamples nothing, so the count still matches; should it ever not, the matcher is rebuilt
from the output (resync). Unconstrained rows cost nothing here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from metrale.sampling.guided import GrammarCompiler, GrammarMatcher
from metrale.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ConstrainedRowLike(Protocol):
    """One row that samples this step (metrale.engine.runner.SamplingRow fits)."""

    request_id: str
    params: SamplingParams
    output_token_ids: Sequence[int]


@dataclass(slots=True)
class StepMasks:
    """One step's bitmask rows, and the requests whose constraint failed before sampling."""

    rows: list[int] = field(default_factory=list)  # the constrained batch rows, ascending
    bitmask: np.ndarray | None = None  # (S, W) int32: bit t % 32 of word t // 32 allows token t; None: no row
    grammar_rows: list[tuple[int, GrammarMatcher]] = field(default_factory=list)  # (batch row, matcher)
    errors: dict[str, BaseException] = field(default_factory=dict)  # request id -> why it must fail


@dataclass(frozen=True, slots=True)
class ConstraintOutcome:
    """What the sampled tokens did to the grammars."""

    finished: frozenset[str] = frozenset()  # grammar complete: the request ends now with "stop"
    errors: dict[str, BaseException] = field(default_factory=dict)  # request id -> failure


class StructuredOutputError(RuntimeError):
    """A constrained request could not continue (its grammar refused the sampled token)."""


class TokenConstraints:
    """Grammar matchers and allowed-token masks by request id; lives on the MLX thread."""

    def __init__(self, vocab_size: int, compiler: GrammarCompiler | None = None) -> None:
        """`vocab_size`: the logits' width; `compiler`: None when grammars are unavailable (rows that
        need one fail with its reason)."""
        self.vocab_size = vocab_size
        self.compiler = compiler
        self.mask_words = compiler.mask_words if compiler is not None else (vocab_size + 31) // 32
        self._matchers: dict[str, GrammarMatcher] = {}
        self._allowed: dict[str, np.ndarray] = {}  # request id -> (W,) int32

    @property
    def num_tracked(self) -> int:
        """Requests with state here (tests: everything is forgotten once requests end)."""
        return len(self._matchers.keys() | self._allowed.keys())

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the state of requests that ended."""
        for request_id in request_ids:
            self._matchers.pop(request_id, None)
            self._allowed.pop(request_id, None)

    def prepare(self, rows: Sequence[ConstrainedRowLike]) -> StepMasks:
        """Fill this step's bitmask rows on the host (call it while the forward runs)."""
        masks = StepMasks()
        allowed_rows = []
        for index, row in enumerate(rows):
            params = row.params
            if params.structured_outputs is None and params.allowed_token_ids is None:
                continue
            if params.structured_outputs is not None:
                matcher = self._matcher(row, masks.errors)
                if matcher is None:
                    continue
                masks.grammar_rows.append((index, matcher))
            if params.allowed_token_ids is not None:
                allowed_rows.append((index, self._allowed_mask(row)))
            masks.rows.append(index)
        if not masks.rows:
            return masks
        masks.bitmask = np.full((len(rows), self.mask_words), -1, dtype=np.int32)  # all allowed
        if masks.grammar_rows:
            pairs = [(matcher, index) for index, matcher in masks.grammar_rows]
            self.compiler.fill_bitmasks(pairs, masks.bitmask)  # type: ignore[union-attr]
        for index, allowed in allowed_rows:
            masks.bitmask[index] &= allowed
        return masks

    def accept(self, rows: Sequence[ConstrainedRowLike], token_ids: Sequence[int],
               masks: StepMasks) -> ConstraintOutcome:
        """Feed each grammar row its sampled token; report finished grammars and failures."""
        if not masks.grammar_rows and not masks.errors:
            return ConstraintOutcome()
        finished = set()
        errors = dict(masks.errors)
        for index, matcher in masks.grammar_rows:
            row, token = rows[index], token_ids[index]
            if not matcher.accept(token):
                errors[row.request_id] = StructuredOutputError(
                    f"structured output: token {token} is not allowed by the constraint"
                    f" (no token satisfied it together with allowed_token_ids / bad_words?): {matcher.error}")
                self._matchers.pop(row.request_id, None)
            elif matcher.is_finished:
                finished.add(row.request_id)
        return ConstraintOutcome(frozenset(finished), errors)

    # ---- per-request state ----

    def _matcher(self, row: ConstrainedRowLike, errors: dict[str, BaseException]) -> GrammarMatcher | None:
        matcher = self._matchers.get(row.request_id)
        if matcher is None:
            try:
                if self.compiler is None:
                    raise StructuredOutputError("structured outputs are not available in this engine")
                compiled = self.compiler.submit(row.params.structured_outputs).result()  # type: ignore[arg-type]
            except Exception as error:  # delivered to this request only
                errors[row.request_id] = error
                return None
            matcher = self._matchers[row.request_id] = compiled.new_matcher()
        output = row.output_token_ids
        if matcher.num_tokens != len(output):  # never expected; a wrong mask would be worse than the cost
            logger.warning("request %s: grammar saw %d tokens, output has %d; resyncing",
                           row.request_id, matcher.num_tokens, len(output))
            if not matcher.resync(output):
                errors[row.request_id] = StructuredOutputError(f"structured output: resync failed: {matcher.error}")
                self._matchers.pop(row.request_id, None)
                return None
        return matcher

    def _allowed_mask(self, row: ConstrainedRowLike) -> np.ndarray:
        mask = self._allowed.get(row.request_id)
        if mask is None:
            ids = np.asarray([t for t in row.params.allowed_token_ids or () if t < self.vocab_size], dtype=np.int64)
            bits = np.zeros(self.mask_words * 32, dtype=np.uint8)
            bits[ids] = 1
            mask = np.packbits(bits, bitorder="little").view(np.int32).copy()  # (W,)
            self._allowed[row.request_id] = mask
        return mask

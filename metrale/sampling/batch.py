"""Host side of sampling: per-request parameters -> the step's SamplingBatch, built once per step.

Rows are split on the host by the work they need (greedy | full-vocabulary | candidate rows, see
metrale.sampling.sampler); the few small arrays each group needs are made here, on the MLX thread,
from plain Python. Randomness is ONE uniform number per sampled row, drawn here: a seeded row's
uniform depends only on (seed, output position), so its token never depends on the batch around it;
unseeded rows draw from the sampler's own generator.

Token restrictions ride along: a bitmask (grammars and allowed_token_ids, filled on the host by
metrale.sampling.constraints; all-ones rows for the other rows of a step that has any), banned
(row, token) pairs (min_tokens, bad words) and logit_bias entries; a step without any pays nothing.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kernels.runtime import mx
from kernels.sampling import LOG2E
from metrale.sampling_params import SamplingParams

TOP_P_CANDIDATES = 256  # MLX ops: candidates a top_p row without top_k starts from (x8 while too few)
_MASK64 = (1 << 64) - 1


class SamplingRowLike(Protocol):
    """One row to sample: the runner's per-request view (metrale.engine.runner.SamplingRow fits)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # its length is the output position of the token sampled now


@dataclass(frozen=True, slots=True)
class RandomGroup:
    """Rows sampled at a temperature; one entry per row of the group."""

    rows: mx.array | None  # (R,) int32 row indices into the logits; None: every row, in order
    scale: mx.array  # (R, 1) float32 log2(e) / temperature: log2 q = (x - max x) * scale
    log2_min_p: mx.array  # (R, 1) float32, -inf where min_p is off
    uniforms: mx.array  # (R,) float32 in (0, 1)
    any_min_p: bool
    top_k: mx.array | None = None  # (R,) int32, 0 where off (candidate group)
    top_p: mx.array | None = None  # (R, 1) float32, inf where off (candidate group)
    num_candidates: int = 0  # K (candidate group)
    needs_full_mass: tuple[int, ...] = ()  # group rows with top_p but no top_k


@dataclass(frozen=True, slots=True)
class Penalties:
    """The (row, token) pairs that penalties touch, unique per row, with what each pair needs."""

    rows: mx.array  # (N,) int32
    token_ids: mx.array  # (N,) int32
    output_counts: mx.array  # (N,) float32, occurrences in the output (0: prompt only)
    repetition: mx.array  # (N,) float32, the pair's row's repetition_penalty
    presence: mx.array  # (N,) float32
    frequency: mx.array  # (N,) float32


@dataclass(frozen=True, slots=True)
class LogitBias:
    """logit_bias entries of the step: logits[rows[i], token_ids[i]] += values[i]."""

    rows: mx.array  # (N,) int32
    token_ids: mx.array  # (N,) int32
    values: mx.array  # (N,) float32


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Everything one step's sampling needs, built once per step by `Sampler.prepare`."""

    num_rows: int
    num_greedy: int
    greedy_rows: mx.array | None  # (G,) int32; None: none, or every row in order
    full: RandomGroup | None
    candidates: RandomGroup | None
    inverse_order: mx.array | None  # (S,) int32 position of each row in concat(groups); None: identity
    penalties: Penalties | None
    banned: tuple[mx.array, mx.array] | None  # (B,) rows, (B,) token ids that must not be sampled
    bitmask: mx.array | None = None  # (S, W) int32, W * 32 >= V: bit t % 32 of word t // 32 allows token t
    logit_bias: LogitBias | None = None
    logprob_rows: tuple[int, ...] = ()  # rows that want logprobs
    num_logprobs: tuple[int, ...] = ()  # top alternatives per logprob row

    @property
    def is_plain_greedy(self) -> bool:
        """Every row is the argmax of untouched logits: the fast path."""
        return (self.full is None and self.candidates is None and self.penalties is None
                and self.banned is None and self.bitmask is None and self.logit_bias is None
                and not self.logprob_rows)


class BatchBuilder:
    """Builds each step's SamplingBatch; owns the generator of the unseeded rows."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], seed: int | None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._rng = random.Random(seed)

    def build(self, rows: Sequence[SamplingRowLike], bitmask: np.ndarray | None = None) -> SamplingBatch:
        """Per-row Python params -> the step's arrays and host-side row groups. `bitmask` (S, W) int32
        holds each row's allowed tokens (metrale.sampling.constraints fills it)."""
        groups: tuple[list[int], list[int], list[int]] = ([], [], [])
        for index, row in enumerate(rows):
            params = row.params
            if params.is_greedy:
                groups[0].append(index)
            else:
                groups[2 if params.top_p < 1.0 or 0 < params.top_k < self.vocab_size else 1].append(index)
        order = groups[0] + groups[1] + groups[2]
        logprob_rows = tuple(i for i, row in enumerate(rows) if row.params.logprobs is not None)
        return SamplingBatch(
            num_rows=len(rows),
            num_greedy=len(groups[0]),
            greedy_rows=row_index(groups[0], len(rows)) if groups[0] else None,
            full=self._random_group(rows, groups[1], candidates=False) if groups[1] else None,
            candidates=self._random_group(rows, groups[2], candidates=True) if groups[2] else None,
            inverse_order=None if order == sorted(order) else index_array(np.argsort(order)),
            penalties=penalties_of(rows, self.vocab_size),
            banned=self._banned(rows),
            bitmask=mx.array(bitmask) if bitmask is not None else None,
            logit_bias=logit_bias_of(rows, self.vocab_size),
            logprob_rows=logprob_rows,
            num_logprobs=tuple(rows[i].params.logprobs or 0 for i in logprob_rows))

    def _random_group(self, rows: Sequence[SamplingRowLike], indices: list[int], candidates: bool) -> RandomGroup:
        params = [rows[i].params for i in indices]
        group = RandomGroup(
            rows=row_index(indices, len(rows)),
            scale=mx.array([[LOG2E / p.temperature] for p in params], dtype=mx.float32),
            log2_min_p=mx.array([[math.log2(p.min_p) if p.min_p > 0 else -math.inf] for p in params],
                                dtype=mx.float32),
            uniforms=mx.array([self._uniform(rows[i]) for i in indices], dtype=mx.float32),
            any_min_p=any(p.min_p > 0 for p in params))
        if not candidates:
            return group
        top_k = [p.top_k if 0 < p.top_k < self.vocab_size else 0 for p in params]
        return dataclasses.replace(
            group, num_candidates=min(self.vocab_size, max(k or TOP_P_CANDIDATES for k in top_k)),
            top_k=mx.array(top_k, dtype=mx.int32),
            top_p=mx.array([[p.top_p if p.top_p < 1.0 else math.inf] for p in params], dtype=mx.float32),
            needs_full_mass=tuple(j for j, (k, p) in enumerate(zip(top_k, params)) if k == 0 and p.top_p < 1.0))

    def _uniform(self, row: SamplingRowLike) -> float:
        seed = row.params.seed
        bits = self._rng.getrandbits(24) if seed is None else seeded_bits(seed, len(row.output_token_ids))
        return (bits + 0.5) / (1 << 24)  # in (0, 1), exact in float32

    def _banned(self, rows: Sequence[SamplingRowLike]) -> tuple[mx.array, mx.array] | None:
        pairs = []
        for index, row in enumerate(rows):
            params = row.params
            if len(row.output_token_ids) < params.min_tokens:
                ids = params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids)
                pairs.extend((index, t) for t in ids if 0 <= t < self.vocab_size)
            if params.bad_words_token_ids:
                pairs.extend((index, t) for t in bad_word_bans(params.bad_words_token_ids, row.output_token_ids)
                             if 0 <= t < self.vocab_size)
        if not pairs:
            return None
        return index_array([r for r, _ in pairs]), index_array([t for _, t in pairs])


def bad_word_bans(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The last token of each bad word whose other tokens end the output (vLLM's rule): sampling it
    would complete the word. A one-token word is always banned."""
    banned = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[len(output) - prefix:]) == list(word[:prefix]):
            banned.append(word[-1])
    return banned


def logit_bias_of(rows: Sequence[SamplingRowLike], vocab_size: int) -> LogitBias | None:
    """The step's logit_bias entries (ids outside the vocabulary were refused at submit)."""
    row_ids, token_ids, values = [], [], []
    for index, row in enumerate(rows):
        for token_id, value in (row.params.logit_bias or {}).items():
            if token_id < vocab_size:
                row_ids.append(index)
                token_ids.append(token_id)
                values.append(value)
    if not row_ids:
        return None
    return LogitBias(index_array(row_ids), index_array(token_ids), mx.array(np.asarray(values, dtype=np.float32)))


def seeded_bits(seed: int, position: int) -> int:
    """24 random bits that depend only on (seed, output position): splitmix64 of the pair."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 40


def index_array(indices: Sequence[int] | np.ndarray) -> mx.array:
    """Indices as an int32 array."""
    return mx.array(np.asarray(indices, dtype=np.int32))


def row_index(indices: list[int], num_rows: int) -> mx.array | None:
    """Row indices as an array; None when they are every row in order (no gather needed)."""
    return None if indices == list(range(num_rows)) else index_array(indices)


def penalties_of(rows: Sequence[SamplingRowLike], vocab_size: int) -> Penalties | None:
    """The unique (row, token) pairs of every penalized row's history."""
    parts = []  # (row index, unique ids, output counts, params)
    for index, row in enumerate(rows):
        if row.params.has_penalties:
            ids, counts = _history(row, vocab_size)
            if len(ids):
                parts.append((index, ids, counts, row.params))
    if not parts:
        return None
    sizes = [len(ids) for _, ids, _, _ in parts]

    def per_pair(values: list[float]) -> mx.array:
        return mx.array(np.repeat(np.asarray(values, dtype=np.float32), sizes))  # (N,)

    return Penalties(
        rows=mx.array(np.repeat(np.asarray([index for index, *_ in parts], dtype=np.int32), sizes)),
        token_ids=mx.array(np.concatenate([ids for _, ids, _, _ in parts]).astype(np.int32)),
        output_counts=mx.array(np.concatenate([counts for _, _, counts, _ in parts]).astype(np.float32)),
        repetition=per_pair([p.repetition_penalty for *_, p in parts]),
        presence=per_pair([p.presence_penalty for *_, p in parts]),
        frequency=per_pair([p.frequency_penalty for *_, p in parts]))


def _history(row: SamplingRowLike, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Unique token ids a row's penalties touch (the prompt's too when repetition_penalty is on) and
    their output counts: (n,) int64 each. One numpy sort of the history."""
    output = np.asarray(row.output_token_ids, dtype=np.int64)
    with_prompt = row.params.repetition_penalty != 1.0 and len(row.prompt_token_ids) > 0
    prompt = np.asarray(row.prompt_token_ids if with_prompt else (), dtype=np.int64)
    history = np.concatenate([prompt, output])  # (n_prompt + n_output,)
    ids, inverse = np.unique(history, return_inverse=True)
    counts = np.bincount(inverse[len(prompt):], minlength=len(ids))  # output occurrences per id
    keep = (ids >= 0) & (ids < vocab_size)
    return ids[keep], counts[keep]

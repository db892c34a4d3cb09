"""Batched sampling on device, with per-request parameters mixed in one batch.

The runner builds a `SamplingBatch` from the step's rows once (`Sampler.prepare`, plain Python in,
arrays out), then calls `Sampler.sample(logits, batch)`; both run on the MLX thread and the result
comes back as Python ints after one evaluation. Rows are split on the host by the work they need:

    logits (S, V) -> penalties and min_tokens bans, on the rows that have them
      greedy rows      argmax                                          temperature 0
      full rows        x/T, min_p floor, inverse CDF over all V        no top_k, no top_p
      candidate rows   the K largest x; top_k, min_p, then top_p on    top_k or top_p
                       the renormalized survivors; inverse CDF over K
    tokens (S,) = concat(greedy, full, candidate)[inverse_order]

Order of processing as in vLLM: penalties -> temperature -> min_p and top_k -> top_p -> sample.
Values tied with the k-th survive top_k. A top_p row without top_k starts from TOP_P_CANDIDATES
candidates; a row whose nucleus is larger (rare) is re-run with 8x as many, up to the whole vocabulary
(checking costs one small host sync in steps that have such rows).

Randomness is ONE uniform number per sampled row, drawn on the host: a seeded row's uniform depends
only on (seed, output position), so its token never depends on the batch around it; unseeded rows
draw from the sampler's own generator. The token is the inverse CDF of the row's (unsorted)
distribution at that uniform: exact, with no (S, V) noise to generate.

Penalties: repetition_penalty over prompt + output tokens (HF/vLLM: positive logits divided,
negative multiplied); presence / frequency over output tokens (OpenAI: minus presence once, minus
frequency per occurrence). Logprobs are those of the RAW model distribution: log_softmax of the
logits before penalties, temperature and truncation (vLLM's default, "raw_logprobs").
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from metrale.outputs import TokenLogprob
from metrale.sampling_params import SamplingParams

TOP_P_CANDIDATES = 256  # candidates a top_p row without top_k starts from (x8 while too few)
_LOG2E = 1.4426950408889634  # exp(z) as 2**(z*log2 e): same float32 accuracy, ~3x faster on MLX CPU
_MASK64 = (1 << 64) - 1


class SamplingRowLike(Protocol):
    """One row to sample: the runner's per-request view (metrale.runner.SamplingRow fits)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # its length is the output position of the token sampled now


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One step's samples as Python values, in row order."""

    token_ids: list[int]  # (S,)
    logprobs: list[TokenLogprob | None]  # (S,); None where the row asked for no logprobs


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
    logprob_rows: tuple[int, ...] = ()  # rows that want logprobs
    num_logprobs: tuple[int, ...] = ()  # top alternatives per logprob row

    @property
    def is_plain_greedy(self) -> bool:
        """Every row is the argmax of untouched logits: the fast path."""
        return (self.full is None and self.candidates is None and self.penalties is None
                and self.banned is None and not self.logprob_rows)


class Sampler:
    """Samples one token per row from (S, V) logits. Lives on the MLX thread with the runner."""

    def __init__(self, vocab_size: int, *, eos_token_ids: Sequence[int] = (), seed: int | None = None) -> None:
        """`eos_token_ids` (with each row's stop_token_ids) are banned until the row has min_tokens
        output tokens, unless it ignores eos; `seed` seeds the unseeded rows' generator."""
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._rng = random.Random(seed)

    def prepare(self, rows: Sequence[SamplingRowLike]) -> SamplingBatch:
        """Per-row Python params -> the step's arrays and host-side row groups."""
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
            greedy_rows=_row_index(groups[0], len(rows)) if groups[0] else None,
            full=self._random_group(rows, groups[1], candidates=False) if groups[1] else None,
            candidates=self._random_group(rows, groups[2], candidates=True) if groups[2] else None,
            inverse_order=None if order == sorted(order) else _index_array(np.argsort(order)),
            penalties=_penalties(rows, self.vocab_size),
            banned=self._banned(rows),
            logprob_rows=logprob_rows,
            num_logprobs=tuple(rows[i].params.logprobs or 0 for i in logprob_rows))

    def sample(self, logits: mx.array, batch: SamplingBatch) -> SamplerOutput:
        """logits (S, V) float32 -> one token per row (and logprobs where asked), as Python values."""
        if logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows, the batch has {batch.num_rows}")
        if batch.is_plain_greedy:
            return SamplerOutput(mx.argmax(logits, axis=-1).tolist(), [None] * batch.num_rows)
        x = logits  # (S, V), never modified in place: raw logprobs read `logits`
        if batch.penalties is not None:
            x = _apply_penalties(x, batch.penalties)
        if batch.banned is not None:
            x = x.at[batch.banned[0], batch.banned[1]].add(-math.inf)
        parts = []
        if batch.num_greedy:
            parts.append(mx.argmax(_select(x, batch.greedy_rows), axis=-1).astype(mx.int32))  # (G,)
        if batch.full is not None:
            parts.append(_sample_full(x, batch.full))  # (F,)
        if batch.candidates is not None:
            parts.append(_sample_candidates(x, batch.candidates, self.vocab_size))  # (C,)
        tokens = mx.concatenate(parts) if len(parts) > 1 else parts[0]  # (S,) in group order
        if batch.inverse_order is not None:
            tokens = tokens[batch.inverse_order]  # (S,) in row order
        if not batch.logprob_rows:
            return SamplerOutput(tokens.tolist(), [None] * batch.num_rows)
        arrays = _logprob_arrays(logits, tokens, batch)
        mx.eval(tokens, *arrays)
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, _logprob_lists(batch, token_ids, *arrays))

    def __call__(self, logits: mx.array, rows: Sequence[SamplingRowLike]) -> SamplerOutput:
        """`prepare` then `sample`."""
        return self.sample(logits, self.prepare(rows))

    # ---- host side ----

    def _random_group(self, rows: Sequence[SamplingRowLike], indices: list[int], candidates: bool) -> RandomGroup:
        params = [rows[i].params for i in indices]
        group = RandomGroup(
            rows=_row_index(indices, len(rows)),
            scale=mx.array([[_LOG2E / p.temperature] for p in params], dtype=mx.float32),
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
        if not pairs:
            return None
        return _index_array([r for r, _ in pairs]), _index_array([t for _, t in pairs])


def seeded_bits(seed: int, position: int) -> int:
    """24 random bits that depend only on (seed, output position): splitmix64 of the pair."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 40


def _index_array(indices: Sequence[int] | np.ndarray) -> mx.array:
    return mx.array(np.asarray(indices, dtype=np.int32))


def _row_index(indices: list[int], num_rows: int) -> mx.array | None:
    """Row indices as an array; None when they are every row in order (no gather needed)."""
    return None if indices == list(range(num_rows)) else _index_array(indices)


def _select(x: mx.array, rows: mx.array | None) -> mx.array:
    return x if rows is None else x[rows]


def _penalties(rows: Sequence[SamplingRowLike], vocab_size: int) -> Penalties | None:
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


# ---- device side ----

def _apply_penalties(x: mx.array, pen: Penalties) -> mx.array:
    """Rewrite the logits of the penalized (row, token) pairs; (S, V) -> a new (S, V) array."""
    value = x[pen.rows, pen.token_ids]  # (N,)
    value = mx.where(value > 0, value / pen.repetition, value * pen.repetition)
    value = value - pen.frequency * pen.output_counts - pen.presence * (pen.output_counts > 0)
    out = mx.array(x)  # a new array object: the caller's logits stay untouched
    out[pen.rows, pen.token_ids] = value
    return out


def _sample_full(x: mx.array, group: RandomGroup) -> mx.array:
    """Temperature (+ min_p) rows: inverse CDF over the whole vocabulary. Returns (R,) int32."""
    logits = _select(x, group.rows)  # (R, V); temperature folds into `scale`: no (R, V) division
    mode = mx.argmax(logits, axis=-1)  # (R,)
    log2_q = (logits - mx.take_along_axis(logits, mode[:, None], axis=-1)) * group.scale  # (R, V), <= 0
    if group.any_min_p:
        log2_q = mx.where(log2_q >= group.log2_min_p, log2_q, -math.inf)
    return _inverse_cdf(mx.power(2.0, log2_q), group.uniforms, mode)


def _sample_candidates(x: mx.array, group: RandomGroup, vocab_size: int) -> mx.array:
    """top_k / top_p rows: thresholds and sampling over the K largest logits. Returns (R,) int32."""
    logits = _select(x, group.rows)  # (R, V)
    values, ids = _largest(logits, group.num_candidates)  # (R, K) descending, (R, K)
    top = values[:, :1]  # (R, 1)
    log2_q = (values - top) * group.scale  # (R, K), <= 0
    k = mx.where(group.top_k > 0, group.top_k, group.num_candidates)  # (R,)
    floor = mx.maximum(group.log2_min_p, mx.take_along_axis(log2_q, (k - 1)[:, None], axis=-1))  # (R, 1)
    q = mx.power(2.0, mx.where(log2_q >= floor, log2_q, -math.inf))  # (R, K) min_p and top_k applied
    mass = q.sum(axis=-1, keepdims=True)  # (R, 1); with top_k every survivor is a candidate
    uncovered: list[int] = []
    if group.needs_full_mass:  # top_p without top_k: normalize by the whole vocabulary's mass
        full = _index_array(group.needs_full_mass)
        whole = _vocab_mass(logits[full], top[full], group.scale[full], group.log2_min_p[full])  # (Rp, 1)
        if group.num_candidates < vocab_size:  # a nucleus may reach past the K candidates
            short = mx.logical_and(mass[full] < group.top_p[full] * whole, log2_q[full, -1:] >= floor[full])
            uncovered = [group.needs_full_mass[j] for j, s in enumerate(short[:, 0].tolist()) if s]
        mass = mx.array(mass)
        mass[full] = whole
    tokens = _pick(group, q, mass, ids)  # (R,)
    if uncovered:  # rare: those rows again with 8x the candidates (finally the whole sorted vocabulary)
        wider = _subgroup(group, uncovered, min(vocab_size, group.num_candidates * 8))
        tokens = mx.array(tokens)
        tokens[_index_array(uncovered)] = _sample_candidates(x, wider, vocab_size)
    return tokens


def _vocab_mass(logits: mx.array, top: mx.array, scale: mx.array, log2_min_p: mx.array) -> mx.array:
    """Unnormalized probability mass of whole rows above the min_p floor: (Rp, V) -> (Rp, 1)."""
    log2_q = (logits - top) * scale  # (Rp, V)
    return mx.power(2.0, mx.where(log2_q >= log2_min_p, log2_q, -math.inf)).sum(axis=-1, keepdims=True)


def _subgroup(group: RandomGroup, positions: list[int], num_candidates: int) -> RandomGroup:
    """The rows of a candidate group at `positions` (all of them top_p rows without top_k)."""
    index = _index_array(positions)
    return RandomGroup(
        rows=index if group.rows is None else group.rows[index], scale=group.scale[index],
        log2_min_p=group.log2_min_p[index], uniforms=group.uniforms[index], any_min_p=group.any_min_p,
        top_k=group.top_k[index], top_p=group.top_p[index],  # type: ignore[index]
        num_candidates=num_candidates, needs_full_mass=tuple(range(len(positions))))


def _pick(group: RandomGroup, q: mx.array, mass: mx.array, ids: mx.array) -> mx.array:
    """top_p over the candidates (descending), then the inverse CDF. q (R, K) -> (R,) token ids."""
    probs = q / mass  # (R, K)
    keep = (mx.cumsum(probs, axis=-1) - probs) < group.top_p  # (R, K) the smallest set reaching top_p
    top = mx.zeros(group.uniforms.shape, dtype=mx.int32)  # (R,) the most likely candidate
    chosen = _inverse_cdf(mx.where(keep, q, 0.0), group.uniforms, top)
    return mx.take_along_axis(ids, chosen[:, None], axis=-1)[:, 0].astype(mx.int32)


def _largest(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k largest values of each row, descending, and their ids: (R, k), (R, k).

    Two levels, exact: the k blocks with the largest maxima hold the k largest values, so only
    nb + k*B values are partitioned instead of V (B ~ sqrt(V / k); ~5x faster for k <= 1024).
    """
    num_rows, vocab = logits.shape
    if k > vocab // 2:
        ids = mx.argsort(-logits, axis=-1)[:, :k]
    elif k >= vocab // 4:
        ids = mx.argpartition(-logits, k - 1, axis=-1)[:, :k]
    else:
        block = max(1, math.isqrt(vocab // k))
        num_blocks = -(-vocab // block)
        padded = logits if num_blocks * block == vocab else mx.concatenate(
            [logits, mx.full((num_rows, num_blocks * block - vocab), -math.inf)], axis=-1)
        blocks = padded.reshape(num_rows, num_blocks, block)  # (R, nb, B)
        chosen = mx.argpartition(-blocks.max(axis=-1), k - 1, axis=-1)[:, :k]  # (R, k) block ids
        values = mx.take_along_axis(blocks, chosen[:, :, None], axis=1).reshape(num_rows, k * block)  # (R, kB)
        block_ids = (chosen[:, :, None] * block + mx.arange(block)[None, None, :]).reshape(num_rows, k * block)
        best = mx.argpartition(-values, k - 1, axis=-1)[:, :k]  # (R, k)
        ids = mx.take_along_axis(block_ids, best, axis=-1)
    values = mx.take_along_axis(logits, ids, axis=-1)  # (R, k)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(values, order, axis=-1), mx.take_along_axis(ids, order, axis=-1)


def _inverse_cdf(q: mx.array, uniforms: mx.array, fallback: mx.array) -> mx.array:
    """Index where the running mass of q (R, N) (unnormalized, >= 0) first reaches u * total.

    A zero-mass pick can only come from rounding in a parallel scan; `fallback` (R,) replaces it.
    """
    cdf = mx.cumsum(q, axis=-1)  # (R, N)
    target = uniforms[:, None] * cdf[:, -1:]  # (R, 1)
    index = mx.minimum((cdf < target).sum(axis=-1), q.shape[-1] - 1).astype(mx.int32)  # (R,)
    picked = mx.take_along_axis(q, index[:, None], axis=-1)[:, 0]  # (R,)
    return mx.where(picked > 0, index, fallback.astype(mx.int32))


def _logprob_arrays(logits: mx.array, tokens: mx.array, batch: SamplingBatch) -> tuple[mx.array, ...]:
    """Raw log_softmax at the sampled token, plus the top-n ids and logprobs, for logprob rows."""
    rows = _index_array(batch.logprob_rows)
    raw = _select(logits, _row_index(list(batch.logprob_rows), batch.num_rows))  # (L, V)
    top = raw.max(axis=-1, keepdims=True)  # (L, 1)
    lse = top + mx.log(mx.power(2.0, (raw - top) * _LOG2E).sum(axis=-1, keepdims=True))  # (L, 1)
    sampled = mx.take_along_axis(raw, tokens[rows][:, None], axis=-1) - lse  # (L, 1)
    n = max(batch.num_logprobs)
    if n == 0:
        return (sampled,)
    values, ids = _largest(raw, n)  # (L, n)
    return sampled, ids, values - lse


def _logprob_lists(batch: SamplingBatch, token_ids: list[int], sampled: mx.array,
                   ids: mx.array | None = None, top: mx.array | None = None) -> list[TokenLogprob | None]:
    out: list[TokenLogprob | None] = [None] * batch.num_rows
    sampled_list = sampled[:, 0].tolist()
    ids_list = ids.tolist() if ids is not None else None
    top_list = top.tolist() if top is not None else None
    for j, (row, n) in enumerate(zip(batch.logprob_rows, batch.num_logprobs)):
        alternatives = tuple(zip(ids_list[j][:n], top_list[j][:n])) if ids_list and top_list and n else ()
        out[row] = TokenLogprob(token_id=token_ids[row], logprob=sampled_list[j], top=alternatives)
    return out

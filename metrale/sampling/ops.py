"""Device side of sampling: plain MLX ops over (S, V) float32 logits, on the MLX thread.

Order of processing as in vLLM: penalties -> temperature -> min_p and top_k -> top_p -> sample.
Values tied with the k-th survive top_k. The token is the inverse CDF of the row's (unsorted)
distribution at the row's uniform: exact, with no (S, V) noise to generate.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kernels.runtime import mx
from kernels.sampling import SampleCandidates, SampleFull, TopIds
from metrale.sampling.batch import LogitBias, Penalties, RandomGroup, index_array


def select(x: mx.array, rows: mx.array | None) -> mx.array:
    """x's rows at `rows` (None: all of them, no gather)."""
    return x if rows is None else x[rows]


def _masked(logits: mx.array, mask: mx.array) -> mx.array:
    """(R, V) logits, (R, W) int32 bitmask -> the logits with every disallowed token at -inf."""
    num_rows, vocab = logits.shape
    bits = mx.right_shift(mask[:, :, None], mx.arange(32, dtype=mx.int32)) & 1  # (R, W, 32)
    allowed = bits.reshape(num_rows, -1)[:, :vocab].astype(mx.bool_)  # (R, V)
    return mx.where(allowed, logits, mx.array(-math.inf, dtype=logits.dtype))


# One fused pass (shift, and, where) per shape: about the cost of an argmax over the rows. Compiled per
# shape, not shapeless (the reshape and the slice depend on it). A step with some constrained rows
# masks every row (all-ones rows for the others): on MLX's CPU a row scatter back into (S, V) cost
# 3-8x more than masking the whole batch.
_masked_compiled = mx.compile(_masked)


def apply_bitmask(x: mx.array, bitmask: mx.array) -> mx.array:
    """x (S, V), bitmask (S, W) int32 -> a new (S, V) array with every disallowed token at -inf."""
    return _masked_compiled(x, bitmask)


def apply_logit_bias(x: mx.array, bias: LogitBias) -> mx.array:
    """logits[row, token] += bias for every logit_bias entry; (S, V) -> a new (S, V) array."""
    return x.at[bias.rows, bias.token_ids].add(bias.values)


def apply_penalties(x: mx.array, pen: Penalties) -> mx.array:
    """Rewrite the logits of the penalized (row, token) pairs; (S, V) -> a new (S, V) array."""
    value = x[pen.rows, pen.token_ids]  # (N,)
    value = mx.where(value > 0, value / pen.repetition, value * pen.repetition)
    value = value - pen.frequency * pen.output_counts - pen.presence * (pen.output_counts > 0)
    out = mx.array(x)  # a new array object: the caller's logits stay untouched
    out[pen.rows, pen.token_ids] = value
    return out


def _argmax_last(x: mx.array) -> mx.array:
    return mx.argmax(x, axis=-1)


def sample_full(x: mx.array, group: RandomGroup, argmax: Callable[[mx.array], mx.array] = _argmax_last,
                kernel: SampleFull | None = None) -> mx.array:
    """Temperature (+ min_p) rows: inverse CDF over the whole vocabulary. Returns (R,) int32.
    `argmax`: (R, V) -> (R,), as mx.argmax(x, axis=-1); `kernel`: kernels.sampling's one-node version of
    the same arithmetic (float32 logits), where the sampler has it."""
    logits = select(x, group.rows)  # (R, V); temperature folds into `scale`: no (R, V) division
    if kernel is not None and logits.dtype == mx.float32:
        return kernel(logits, group.scale.reshape(-1), group.log2_min_p.reshape(-1), group.uniforms)  # (R,)
    mode = argmax(logits)  # (R,)
    log2_q = (logits - mx.take_along_axis(logits, mode[:, None], axis=-1)) * group.scale  # (R, V), <= 0
    if group.any_min_p:
        log2_q = mx.where(log2_q >= group.log2_min_p, log2_q, -math.inf)
    return inverse_cdf(mx.power(2.0, log2_q), group.uniforms, mode)


def sample_candidates(x: mx.array, group: RandomGroup, vocab_size: int,
                      kernel: SampleCandidates | None = None) -> mx.array:
    """top_k / top_p rows: thresholds and sampling over the K largest logits. Returns (R,) int32.
    `kernel`: kernels.sampling's one-node selection version (float32 logits; no K, no retry), where the
    sampler has it."""
    logits = select(x, group.rows)  # (R, V)
    if kernel is not None and logits.dtype == mx.float32:
        assert group.top_k is not None and group.top_p is not None  # a candidate group has both
        return kernel(logits, group.scale.reshape(-1), group.log2_min_p.reshape(-1), group.top_k,
                      group.top_p.reshape(-1), group.uniforms)  # (R,)
    values, ids = largest(logits, group.num_candidates)  # (R, K) descending, (R, K)
    top = values[:, :1]  # (R, 1)
    log2_q = (values - top) * group.scale  # (R, K), <= 0
    k = mx.where(group.top_k > 0, group.top_k, group.num_candidates)  # (R,)
    floor = mx.maximum(group.log2_min_p, mx.take_along_axis(log2_q, (k - 1)[:, None], axis=-1))  # (R, 1)
    q = mx.power(2.0, mx.where(log2_q >= floor, log2_q, -math.inf))  # (R, K) min_p and top_k applied
    mass = q.sum(axis=-1, keepdims=True)  # (R, 1); with top_k every survivor is a candidate
    uncovered: list[int] = []
    if group.needs_full_mass:  # top_p without top_k: normalize by the whole vocabulary's mass
        full = index_array(group.needs_full_mass)
        whole = vocab_mass(logits[full], top[full], group.scale[full], group.log2_min_p[full])  # (Rp, 1)
        if group.num_candidates < vocab_size:  # a nucleus may reach past the K candidates
            short = mx.logical_and(mass[full] < group.top_p[full] * whole, log2_q[full, -1:] >= floor[full])
            uncovered = [group.needs_full_mass[j] for j, s in enumerate(short[:, 0].tolist()) if s]
        mass = mx.array(mass)
        mass[full] = whole
    tokens = pick(group, q, mass, ids)  # (R,)
    if uncovered:  # rare: those rows again with 8x the candidates (finally the whole sorted vocabulary)
        wider = subgroup(group, uncovered, min(vocab_size, group.num_candidates * 8))
        tokens = mx.array(tokens)
        tokens[index_array(uncovered)] = sample_candidates(x, wider, vocab_size)  # the MLX ops again
    return tokens


def vocab_mass(logits: mx.array, top: mx.array, scale: mx.array, log2_min_p: mx.array) -> mx.array:
    """Unnormalized probability mass of whole rows above the min_p floor: (Rp, V) -> (Rp, 1)."""
    log2_q = (logits - top) * scale  # (Rp, V)
    return mx.power(2.0, mx.where(log2_q >= log2_min_p, log2_q, -math.inf)).sum(axis=-1, keepdims=True)


def subgroup(group: RandomGroup, positions: list[int], num_candidates: int) -> RandomGroup:
    """The rows of a candidate group at `positions` (all of them top_p rows without top_k)."""
    index = index_array(positions)
    return RandomGroup(
        rows=index if group.rows is None else group.rows[index], scale=group.scale[index],
        log2_min_p=group.log2_min_p[index], uniforms=group.uniforms[index], any_min_p=group.any_min_p,
        top_k=group.top_k[index], top_p=group.top_p[index],  # type: ignore[index]
        num_candidates=num_candidates, needs_full_mass=tuple(range(len(positions))))


def pick(group: RandomGroup, q: mx.array, mass: mx.array, ids: mx.array) -> mx.array:
    """top_p over the candidates (descending), then the inverse CDF. q (R, K) -> (R,) token ids."""
    probs = q / mass  # (R, K)
    keep = (mx.cumsum(probs, axis=-1) - probs) < group.top_p  # (R, K) the smallest set reaching top_p
    top = mx.zeros(group.uniforms.shape, dtype=mx.int32)  # (R,) the most likely candidate
    chosen = inverse_cdf(mx.where(keep, q, 0.0), group.uniforms, top)
    return mx.take_along_axis(ids, chosen[:, None], axis=-1)[:, 0].astype(mx.int32)


def largest(logits: mx.array, k: int, top_ids: TopIds | None = None) -> tuple[mx.array, mx.array]:
    """The k largest values of each row, descending, and their ids: (R, k), (R, k). `top_ids`: kernels.sampling's
    selection of the ids (float32 logits, k <= V), where the caller has it.

    Two levels, exact: the k blocks with the largest maxima hold the k largest values, so only
    nb + k*B values are partitioned instead of V (B ~ sqrt(V / k); ~5x faster for k <= 1024).
    """
    num_rows, vocab = logits.shape
    if top_ids is not None and logits.dtype == mx.float32 and 1 <= k <= vocab:
        ids = top_ids(logits, k)  # (R, k) int32, already descending
        return mx.take_along_axis(logits, ids, axis=-1), ids
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


def inverse_cdf(q: mx.array, uniforms: mx.array, fallback: mx.array) -> mx.array:
    """Index where the running mass of q (R, N) (unnormalized, >= 0) first reaches u * total.

    A zero-mass pick can only come from rounding in a parallel scan; `fallback` (R,) replaces it.
    """
    cdf = mx.cumsum(q, axis=-1)  # (R, N)
    target = uniforms[:, None] * cdf[:, -1:]  # (R, 1)
    index = mx.minimum((cdf < target).sum(axis=-1), q.shape[-1] - 1).astype(mx.int32)  # (R,)
    picked = mx.take_along_axis(q, index[:, None], axis=-1)[:, 0]  # (R,)
    return mx.where(picked > 0, index, fallback.astype(mx.int32))

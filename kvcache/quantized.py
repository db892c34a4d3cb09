"""The q8 KV row format (EngineConfig.kv_cache_dtype="int8"), and its plain-MLX quantize / dequantize.

An int8 pool is (num_blocks, n_kv_heads, block_size, row_width(head_dim)) int8: each (kv head, slot) row holds the
head vector's head_dim values as int8, then one float16 scale per group of group_size(head_dim) values
(its two bytes, little-endian), llama.cpp's q8_0 laid out per head vector:

    row = [q_0 .. q_{hd-1} | d_0 lo, d_0 hi | d_1 lo, d_1 hi | ...]        value_i = q_i * d_{i // group}
    d = float16(max|x| / 127) over the group,  q = round_half_even(clamp(x * (1 / d), -127, 127))  (0 when d == 0)

The C++ kernels quantize as they write (kernels/csrc/kv_write.cpp) and dequantize in registers as they
read; the functions here are the same arithmetic in MLX, for the reference backend (any device) and the
models' own attention paths (gemma2's soft-capped one).
"""

from __future__ import annotations

from kernels.runtime import mx

__all__ = ["GROUP", "dequantize", "group_size", "quantize", "row_width"]

# Values per float16 scale where the head dim allows it. Measured on SmolLM2-135M (head_dim 64; see
# tests/metrale/engine/test_kv_cache_int8.py): one scale per 32 values halves the logit error of one scale
# per head vector, for 2 bytes more per row (68 instead of 66 bytes: 1.88x float16's tokens, not 1.94x).
GROUP = 32


def group_size(head_dim: int) -> int:
    """Values per scale for `head_dim`: GROUP when it divides head_dim, else the whole head vector.
    ValueError when head_dim is not a positive multiple of 8 (the kernels read 8 values at a time)."""
    if not isinstance(head_dim, int) or head_dim < 8 or head_dim % 8:
        raise ValueError(f"int8 KV needs head_dim a positive multiple of 8, got {head_dim!r}")
    return GROUP if head_dim % GROUP == 0 else head_dim


def row_width(head_dim: int) -> int:
    """Bytes of one (slot, kv head) row: head_dim int8 values and 2 bytes per scale."""
    return head_dim + 2 * (head_dim // group_size(head_dim))


def quantize(x: mx.array) -> mx.array:
    """x (..., head_dim) float -> (..., row_width(head_dim)) int8 rows, as kv_write.cpp writes them."""
    head_dim = x.shape[-1]
    group = group_size(head_dim)
    groups = x.astype(mx.float32).reshape(*x.shape[:-1], head_dim // group, group)  # (..., n_groups, group)
    scales = (mx.abs(groups).max(axis=-1, keepdims=True) / 127.0).astype(mx.float16)  # (..., n_groups, 1)
    d = scales.astype(mx.float32)
    safe = mx.where(d > 0, d, mx.array(1.0, dtype=mx.float32))
    inv = mx.where(d > 0, 1.0 / safe, 0.0)  # float32 reciprocal, as kv_write.cpp multiplies by it
    q = mx.round(mx.clip(groups * inv, -127, 127)).astype(mx.int8)  # (..., n_groups, group)
    scale_bytes = mx.view(mx.contiguous(scales.reshape(*x.shape[:-1], -1)), mx.int8)  # (..., 2 * n_groups)
    return mx.concatenate([q.reshape(*x.shape[:-1], head_dim), scale_bytes], axis=-1)


def dequantize(rows: mx.array, head_dim: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    """rows (..., row_width(head_dim)) int8 -> (..., head_dim) values in `dtype`."""
    group = group_size(head_dim)
    if rows.shape[-1] != row_width(head_dim):
        raise ValueError(f"q8 rows of {rows.shape[-1]} bytes do not hold head_dim {head_dim} "
                         f"(expected {row_width(head_dim)})")
    lead = rows.shape[:-1]
    q = rows[..., :head_dim].astype(mx.float32).reshape(*lead, head_dim // group, group)  # (..., n_groups, group)
    scales = mx.view(mx.contiguous(rows[..., head_dim:]), mx.float16).astype(mx.float32)  # (..., n_groups)
    return (q * scales[..., None]).reshape(*lead, head_dim).astype(dtype)

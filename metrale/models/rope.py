"""Rotary position embedding for flat batches: one position per token.

`mx.fast.rope` takes an array offset with one entry per batch row (checked for mlx 0.32:
row b of an input shaped (B, ..., L, D) is rotated as positions offset[b] .. offset[b] + L - 1).
A flat batch puts each token in its own row with L = 1, so offset = positions gives every
token its own position, whatever sequence it belongs to.

On CPU with float32 activations `rotate_qk` takes the fused path instead (kernels/norm_rope.py):
one node rotates q and k with cos / sin tables that every layer of the step shares (built once per
step from the positions and cached in the step's metadata); mx.fast.rope on CPU is ~25 nodes per call.
"""

from __future__ import annotations

import math

from kernels.backend import activation_backend
from kernels.norm_rope import rope_inv_frequencies, rope_qk, rope_tables
from kernels.runtime import mx

from metrale.models.config import ModelConfig, RopeScaling


def llama3_frequencies(head_dim: int, base: float, scaling: RopeScaling) -> mx.array:
    """Llama 3.1 frequency schedule: long wavelengths slowed by `factor`, a smooth ramp between.

    Returns the per-pair wavelength divisors in the form `mx.fast.rope(freqs=...)` expects
    (the inverse of the angular frequency), shape (head_dim // 2,).
    """
    freqs = base ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)  # (head_dim // 2,)
    wavelens = 2 * math.pi * freqs  # (head_dim // 2,)
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    freqs = mx.where(wavelens > low_freq_wavelen, freqs * scaling.factor, freqs)
    is_medium = (wavelens > high_freq_wavelen) & (wavelens < low_freq_wavelen)
    smooth = (scaling.original_max_position_embeddings / wavelens - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smooth_freqs = freqs / ((1 - smooth) / scaling.factor + smooth)
    return mx.where(is_medium, smooth_freqs, freqs)  # (head_dim // 2,)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 or mscale == 0 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(head_dim: int, base: float, scaling: RopeScaling) -> tuple[mx.array, float]:
    """YaRN's frequency schedule and magnitude scale (as mlx-lm's YarnRoPE and Hugging Face's
    _compute_yarn_parameters): (wavelength divisors (head_dim // 2,) for mx.fast.rope(freqs=...),
    the factor q and k are multiplied by)."""
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # as the references: no zero-width ramp
    ramp = mx.clip((mx.arange(head_dim // 2, dtype=mx.float32) - low) / (high - low), 0, 1)  # (head_dim // 2,)
    extrapolated = base ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)  # (head_dim // 2,)
    interpolated = scaling.factor * extrapolated
    keep = 1.0 - ramp  # 1: the original frequency (high-frequency dims), 0: the interpolated one
    freqs = interpolated * extrapolated / (interpolated * keep + extrapolated * (1 - keep))
    mscale = _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return freqs, mscale


class FlatRope:
    """RoPE over (T, n_heads, head_dim) with a position per token. Holds no trainable weights.

    `local=True` is for a sliding-window layer: when the config has `rope_local_theta` (gemma3),
    such a layer rotates with that base and without scaling."""

    def __init__(self, config: ModelConfig, *, local: bool = False) -> None:
        self.dims = config.head_dim
        self.traditional = config.rope_traditional
        self.scale = 1.0
        self.base: float | None = config.rope_theta
        self.freqs: mx.array | None = None  # (head_dim // 2,) when set
        self.mscale = 1.0  # yarn's magnitude scale of q and k
        scaling = config.rope_scaling
        if local and config.rope_local_theta is not None:
            self.base = config.rope_local_theta
        elif scaling is not None and scaling.rope_type == "linear":
            self.scale = 1.0 / scaling.factor
        elif scaling is not None and scaling.rope_type == "llama3":
            self.freqs = llama3_frequencies(config.head_dim, config.rope_theta, scaling)
            self.base = None
        elif scaling is not None and scaling.rope_type == "yarn":
            self.freqs, self.mscale = yarn_frequencies(config.head_dim, config.rope_theta, scaling)
            self.base = None
        elif config.rope_freq_factors is not None:
            exponents = mx.arange(0, config.head_dim, 2, dtype=mx.float32) / config.head_dim  # (head_dim // 2,)
            factors = mx.array(config.rope_freq_factors, dtype=mx.float32)  # (head_dim // 2,)
            self.freqs = (config.rope_theta**exponents) * factors  # (head_dim // 2,)
            self.base = None
        self._fused = activation_backend() == "kernel"
        self._inv_frequencies = None  # (head_dim // 2,) float32, evaluated once
        if self._fused:
            self._inv_frequencies = rope_inv_frequencies(self.dims, self.base, self.freqs)
            mx.eval(self._inv_frequencies)
        # layers of one step with the same rotation share its tables (a local and a global kind at most)
        self._table_key = ("rope", self.dims, self.base, self.scale, None if self.freqs is None else local)

    def __call__(self, x: mx.array, positions: mx.array) -> mx.array:
        """x (T, n_heads, head_dim), positions (T,) int32 -> (T, n_heads, head_dim)."""
        num_tokens, num_heads, head_dim = x.shape
        rows = x.reshape(num_tokens, num_heads, 1, head_dim)  # (T, n_heads, 1, head_dim): one row per token
        out = mx.fast.rope(
            rows,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=positions,
            freqs=self.freqs,
        )  # (T, n_heads, 1, head_dim)
        return out.reshape(num_tokens, num_heads, head_dim)

    def rotate_qk(self, q: mx.array, k: mx.array, positions: mx.array, metadata=None) -> tuple[mx.array, mx.array]:
        """q (T, n_heads, head_dim), k (T, n_kv_heads, head_dim), positions (T,) -> rotated (q, k).

        `metadata` (the step's AttentionMetadata) caches the fused path's cos / sin tables for all layers."""
        if self.mscale != 1.0:
            q, k = q * self.mscale, k * self.mscale
        if not (self._fused and q.dtype == mx.float32 and k.dtype == mx.float32):
            return self(q, positions), self(k, positions)

        def tables():
            return rope_tables(positions, self._inv_frequencies, self.scale)  # each (T, head_dim // 2)

        cos, sin = tables() if metadata is None else metadata.cached(self._table_key, tables)
        return rope_qk(q, k, cos, sin, self.traditional)

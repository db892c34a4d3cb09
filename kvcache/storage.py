"""Paged KV storage: one preallocated K pool and one V pool per layer, with a fixed footprint.

A pool is `(num_blocks, n_kv_heads, block_size, head_dim)`: each kv head's rows of a block are one
contiguous run, so attention reads a head's keys of a block in one stream (a layout of (slot, kv head)
rows put them a slot apart: decode attention from memory took 1.3-1.55x the cycles, docs/attention.md;
the kernels' side of the layout is kv_row_offset in kernels/csrc/kernel_table.h). Token slots number the
blocks' rows: block `b` owns slots `b * block_size .. (b + 1) * block_size - 1`; which blocks a sequence
owns is the KV manager's business (kvcache/manager.py), this module only stores and returns arrays.

    slot = block_table[pos // block_size] * block_size + pos % block_size
    the slot's row of kv head g: pool[slot // block_size, g, slot % block_size]

Writing in place. MLX arrays are functional, yet `flat[rows] = keys` (flat: the pool viewed as rows) does not
copy the pool: the scatter donates its input buffer to its output when nothing else holds the old array,
so the write costs O(T) and the footprint stays fixed. Measured on this CPU (mlx 0.32, a 96 MiB
pool, 32 new tokens): ~0.05 ms per write and 0 bytes of new memory, against 78 ms and a second
96 MiB pool when another array still references the old pool at eval time (for instance an
unevaluated op of an earlier step that reads it). Evaluate each step before the next, and read
the pools through `layer()` / what `write` returns in the same step.
With the CPU kernels (METRALE_ATTENTION, decided at construction) each pool is written by one node
(kernels' kv_write, the same donation rule) instead of MLX's reshape / scatter / reshape. Either way the
cache holds a new pool object per write, so an array kept from an earlier `layer()` call keeps the old
contents and makes that write copy the pool.
"""

from __future__ import annotations

import numpy as np

from kernels import ext
from kernels.backend import attention_backend
from kernels.runtime import mx
from kvcache import quantized

__all__ = ["PagedKVCache", "pool_rows"]


def pool_rows(slots: np.ndarray, n_kv_heads: int, block_size: int) -> np.ndarray:
    """Row indices (..., n_kv_heads, ...) of `slots` (...) into a pool viewed as (num_blocks * n_kv_heads *
    block_size, row_width): [..., g] is kv head g's row of each slot, the kv head axis inserted last."""
    blocks, offsets = np.divmod(slots.astype(np.int64), block_size)
    return (blocks[..., None] * n_kv_heads + np.arange(n_kv_heads)) * block_size + offsets[..., None]


class PagedKVCache:
    """Per-layer K and V pools of shape `(num_blocks, n_kv_heads, block_size, row_width)`.

    row_width is head_dim for float32 / float16 / bfloat16 pools; an mx.int8 pool is q8 (kvcache/quantized.py:
    head_dim int8 values then float16 scales per row, row_width = quantized.row_width(head_dim)), quantized as
    it is written. Allocated and materialized at construction; writes never grow them. Slot 0 of block 0 is
    an ordinary slot (the runner pads block tables with 0, attention masks those positions out).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype = mx.float32,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("n_kv_heads", n_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.row_width = self.row_width_of(head_dim, dtype)
        shape = (num_blocks, n_kv_heads, block_size, self.row_width)
        # one K and one V pool per layer, each (num_blocks, n_kv_heads, block_size, row_width)
        self._keys = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self._values = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        mx.eval(self._keys, self._values)  # allocate now: the footprint is fixed from the start
        # the C++ K/V write (one node per pool), resolved once; None: MLX's scatter
        self._kv_write = getattr(ext.load(), "kv_write", None) if attention_backend() == "kernel" else None
        self._rows_of: tuple[mx.array, mx.array] | None = None  # (slot_mapping, its rows): _flat_rows

    @staticmethod
    def row_width_of(head_dim: int, dtype: mx.Dtype) -> int:
        """Elements of one (kv head, slot) row: head_dim, or for int8 (q8) the values and their scales' bytes.
        ValueError for a dtype the pools cannot hold."""
        if dtype == mx.int8:
            return quantized.row_width(head_dim)
        if dtype not in (mx.float32, mx.float16, mx.bfloat16):
            raise ValueError(f"KV pools hold float32, float16, bfloat16 or int8, got {dtype}")
        return head_dim

    @classmethod
    def bytes_per_block(
        cls, num_layers: int, block_size: int, n_kv_heads: int, head_dim: int, dtype: mx.Dtype = mx.float32
    ) -> int:
        """Bytes one block costs across all layers, K and V together (an int8 pool's scales included)."""
        return 2 * num_layers * block_size * n_kv_heads * cls.row_width_of(head_dim, dtype) * dtype.size

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype = mx.float32,
        *,
        shared_bytes_per_block: int = 0,
    ) -> PagedKVCache:
        """The largest cache whose pools fit in `budget_bytes`; ValueError if not even one block fits.

        `shared_bytes_per_block`: what each block costs in other pools that hold as many blocks and share
        the budget (a draft model's), so that all of them together fit.
        """
        own = cls.bytes_per_block(num_layers, block_size, n_kv_heads, head_dim, dtype)
        per_block = own + shared_bytes_per_block
        num_blocks = int(budget_bytes) // per_block
        if num_blocks < 1:
            shared = f" + {shared_bytes_per_block} bytes in pools sharing the budget" if shared_bytes_per_block else ""
            raise ValueError(
                f"KV budget of {budget_bytes} bytes holds no block: one block of {block_size} tokens "
                f"costs {own} bytes ({num_layers} layers x K,V x {n_kv_heads} heads x "
                f"{cls.row_width_of(head_dim, dtype)} x {dtype}){shared}"
            )
        return cls(num_layers, num_blocks, block_size, n_kv_heads, head_dim, dtype)

    @property
    def num_slots(self) -> int:
        """Token slots per pool: num_blocks * block_size."""
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        """Total bytes of all pools (K and V, every layer); constant for the cache's lifetime."""
        return sum(a.nbytes for a in self._keys) + sum(a.nbytes for a in self._values)

    def layer(self, layer: int) -> tuple[mx.array, mx.array]:
        """The (k_pool, v_pool) of `layer`, each (num_blocks, n_kv_heads, block_size, row_width)."""
        return self._keys[layer], self._values[layer]

    def write(
        self, layer: int, keys: mx.array, values: mx.array, slot_mapping: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Write this step's K/V of `layer` into their slots; returns the layer's updated pools.

        keys, values: (T, n_kv_heads, head_dim), cast to the pool dtype (int8 pools: quantized per row and
        group, kvcache/quantized.py); slot_mapping: (T,) int32. Lazy like any MLX op; the returned pools are
        what attention must read this step.
        """
        expected = (self.n_kv_heads, self.head_dim)
        if keys.shape != values.shape or tuple(keys.shape[1:]) != expected or keys.ndim != 3:
            raise ValueError(
                f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must both be "
                f"(T, {expected[0]}, {expected[1]})"
            )
        if slot_mapping.shape != (keys.shape[0],):
            raise ValueError(
                f"slot_mapping {tuple(slot_mapping.shape)} must be ({keys.shape[0]},), one slot per token"
            )
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        # Rebinding the list's arrays to the write's outputs leaves the old pools held only by the
        # graph, so the write reuses their buffers (no pool copy, see module docstring).
        kernel_writes = self._kv_write is not None and slot_mapping.dtype == mx.int32
        if self.dtype == mx.int8:
            keys, values = keys.astype(mx.float32), values.astype(mx.float32)  # the kernel quantizes float32 rows
            if not kernel_writes:
                keys, values = quantized.quantize(keys), quantized.quantize(values)  # (T, n_kv_heads, row_width)
        elif not (kernel_writes and keys.dtype == values.dtype == mx.float32):
            keys, values = keys.astype(self.dtype), values.astype(self.dtype)
        # (float32 rows the kernel writes are rounded into a 16-bit pool as it writes, bit for bit astype's
        # result, without an AsType node per pool and layer: 60 of the default model's 492 per step)
        if kernel_writes:
            self._keys[layer] = self._kv_write(self._keys[layer], keys, slot_mapping)
            self._values[layer] = self._kv_write(self._values[layer], values, slot_mapping)
        else:  # MLX's scatter into the pool's rows, (T, n_kv_heads) of them, in place when nothing else holds it
            rows = self._flat_rows(slot_mapping)
            for pools, new in ((self._keys, keys), (self._values, values)):
                flat = pools[layer].reshape(-1, self.row_width)  # (num_blocks * n_kv_heads * block_size, row_width)
                flat[rows] = new
                pools[layer] = flat.reshape(pools[layer].shape)
        return self._keys[layer], self._values[layer]

    def _flat_rows(self, slot_mapping: mx.array) -> mx.array:
        """The rows (T, n_kv_heads) of `slot_mapping`'s slots in a pool viewed as (rows, row_width), built once
        per step: every layer writes the step metadata's one slot_mapping object."""
        if self._rows_of is None or self._rows_of[0] is not slot_mapping:
            rows = pool_rows(np.array(slot_mapping), self.n_kv_heads, self.block_size)  # the step's host array
            self._rows_of = (slot_mapping, mx.array(rows.astype(np.int32)))
        return self._rows_of[1]

    def copy_blocks(self, copies: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> None:
        """Copy whole blocks, `[(src block id, dst block id)]`, in every layer's K and V pools (a forked
        request's copy of its parent's partial block). Lazy; the sources are read before any
        destination is written, so a chain of copies sees the old contents."""
        if not copies:
            return
        for src, dst in copies:
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks) or src == dst:
                raise ValueError(f"block copy {src} -> {dst} is out of range for {self.num_blocks} blocks")
        src = mx.array([s for s, _ in copies], dtype=mx.int32)  # (C,)
        dst = mx.array([d for _, d in copies], dtype=mx.int32)  # (C,)
        # gathered first and evaluated (C blocks per pool), so the scatters below can reuse their pools'
        # buffers: nothing else still reads the old pools (see the module docstring)
        keys = [pool[src] for pool in self._keys]  # each (C, n_kv_heads, block_size, row_width)
        values = [pool[src] for pool in self._values]
        mx.eval(keys, values)
        for layer in range(self.num_layers):
            self._keys[layer][dst] = keys[layer]
            self._values[layer][dst] = values[layer]

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, bytes={self.bytes})"
        )

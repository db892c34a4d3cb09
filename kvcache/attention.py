"""Paged attention over the flat varlen batch of one step.

The flat batch concatenates each sequence's new tokens. Sequence s owns rows
query_start[s] .. query_start[s] + query_len[s] of the queries; its new tokens sit at positions
context_len[s] - query_len[s] .. context_len[s] - 1, and their K/V are written to the pool
(PagedKVCache.write) BEFORE attention runs, so a sequence's context is all of its positions:

    positions   0 ............................ ctx-qlen-1 | ctx-qlen ...... ctx-1
                cached prefix (earlier steps)              | this step's tokens (queries)
    a query at position p sees keys at positions k with  p - window < k <= p   (window = inf if None)

AttentionMetadata.build runs once per step on plain Python and splits the sequences in two groups
that are never padded to each other: decode rows (query_len == 1, one batched call padded only in
context length) and prefill chunks (query_len > 1, one call each). Every layer reuses it.

Two paths behind `paged_attention`, chosen once per model load (kernels.backend, METRALE_ATTENTION)
and carried to every layer by the step's metadata:
  reference  plain MLX: gather the context rows, then mx.fast.scaled_dot_product_attention with a
             boolean mask; runs on every backend.
  kernel     kernels/ (C++, CPU, optional build): decode rows and prefill chunks read K/V straight
             from the pools through the block tables (float32, float16 or bfloat16 pools widened, int8
             q8 pools dequantized, in registers); chunks in key tiles with an online softmax, so no
             (q_len, context) scores. The reference dequantizes the gathered q8 rows with MLX ops.
Both are tested against dense attention (tests/kvcache/test_attention.py, test_ext.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels import ext
from kernels.backend import attention_backend
from kernels.runtime import mx
from kvcache import quantized
from kvcache.storage import pool_rows

__all__ = ["AttentionMetadata", "DecodeRun", "PrefillChunk", "gathered_values", "paged_attention"]


@dataclass(frozen=True, slots=True, eq=False)
class PrefillChunk:
    """One sequence with query_len > 1: its rows in the flat batch and its whole context.

    rows row_start .. row_start + query_len - 1 hold the queries of positions
    context_len - query_len .. context_len - 1; `table` (num_blocks_s,) is the sequence's block table.
    """

    index: int  # among the step's chunks, in batch order
    row_start: int
    query_len: int
    context_len: int
    table: np.ndarray
    block_size: int

    @property
    def first_position(self) -> int:
        """Position of the chunk's first query."""
        return self.context_len - self.query_len

    def slots(self, start: int = 0) -> np.ndarray:
        """(context_len - start,) the pool slot of every context position from `start` on, in order."""
        pos = np.arange(start, self.context_len, dtype=np.int64)
        return self.table[pos // self.block_size] * self.block_size + pos % self.block_size


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """Consecutive decode sequences of the batch: rows start .. end - 1 of the decode output."""

    start: int
    end: int


class AttentionMetadata:
    """Everything paged attention needs for one step, as MLX arrays built once and shared by all layers.

    Arrays: positions (T,) int32 and slot_mapping (T,) int32 of every row; for the B decode rows
    (query_len == 1, in batch order) decode_block_tables (B, max_blocks) int32 and
    decode_context_lens (B,) int32. `chunks` are the prefill chunks; `output_order` lists the
    pieces of the output in batch order (DecodeRun or PrefillChunk). Gather indices and masks per
    window are made on first use and cached (gemma-style models use two windows). `backend` is the
    attention implementation the runner chose at load ("kernel" | "reference"); None decides on
    every call from METRALE_ATTENTION (tests).
    """

    def __init__(self, query_lens, context_lens, block_tables, block_size, backend=None) -> None:
        """Use `AttentionMetadata.build`; this constructor expects already validated inputs."""
        self.block_size = block_size
        self.backend = backend
        self.query_lens = tuple(query_lens)
        self.context_lens = tuple(context_lens)
        self.num_seqs = len(self.query_lens)
        starts = np.concatenate([[0], np.cumsum(self.query_lens)]).astype(np.int64)  # (S + 1,)
        self.query_starts = tuple(int(x) for x in starts[:-1])
        self.num_tokens = int(starts[-1])
        tables = [np.asarray(bt, dtype=np.int64) for bt in block_tables]  # each (num_blocks_s,)
        self.max_block_id = max(int(t[: -(-ctx // block_size)].max()) for t, ctx in zip(tables, self.context_lens))

        positions, slots, decode, chunks = [], [], [], []
        for s, (qlen, ctx, table) in enumerate(zip(self.query_lens, self.context_lens, tables)):
            pos = np.arange(ctx - qlen, ctx, dtype=np.int64)  # (qlen,)
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            if qlen == 1:
                decode.append(s)
            else:
                chunks.append(PrefillChunk(len(chunks), self.query_starts[s], qlen, ctx, table, block_size))
        self.chunks: tuple[PrefillChunk, ...] = tuple(chunks)
        self.positions = mx.array(np.concatenate(positions).astype(np.int32))  # (T,)
        self.slot_mapping = mx.array(np.concatenate(slots).astype(np.int32))  # (T,)
        self._init_decode(decode, tables)
        self.output_order = self._output_order()
        self._cache: dict[tuple, Any] = {}

    def _init_decode(self, decode: list[int], tables: list[np.ndarray]) -> None:
        """The decode group (query_len == 1), in batch order; rows are sliced when contiguous."""
        self.num_decode = len(decode)
        rows = [self.query_starts[s] for s in decode]
        contiguous = bool(rows) and rows[-1] - rows[0] == len(rows) - 1
        # the decode rows of the flat batch: a slice (first, end) when contiguous, else an index array
        self.decode_slice = (rows[0], rows[-1] + 1) if contiguous else None
        self.decode_rows = None if contiguous or not rows else mx.array(np.asarray(rows, dtype=np.int32))  # (B,)
        self.decode_context_lens_np = np.asarray([self.context_lens[s] for s in decode], dtype=np.int64)  # (B,)
        width = max((len(tables[s]) for s in decode), default=0)
        padded = np.zeros((len(decode), max(width, 1)), dtype=np.int32)  # (B, max_blocks), 0-padded
        for i, s in enumerate(decode):
            padded[i, : len(tables[s])] = tables[s]
        self.decode_block_tables_np = padded
        self.decode_block_tables = mx.array(padded)  # (B, max_blocks)
        self.decode_context_lens = mx.array(self.decode_context_lens_np.astype(np.int32))  # (B,)

    def _output_order(self) -> tuple[DecodeRun | PrefillChunk, ...]:
        """Runs of consecutive decode sequences become slices of the decode output."""
        order: list[DecodeRun | PrefillChunk] = []
        chunks = iter(self.chunks)
        decode_index = 0
        for qlen in self.query_lens:
            if qlen > 1:
                order.append(next(chunks))
            elif order and isinstance(order[-1], DecodeRun):
                order[-1] = DecodeRun(order[-1].start, decode_index + 1)
                decode_index += 1
            else:
                order.append(DecodeRun(decode_index, decode_index + 1))
                decode_index += 1
        return tuple(order)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        backend: str | None = None,
    ) -> AttentionMetadata:
        """Metadata for one step from plain Python sequences, one entry per scheduled sequence.

        query_lens[s] >= 1 new tokens, context_lens[s] >= query_lens[s] (cached prefix + new),
        block_tables[s]: pool block ids covering context_lens[s] tokens. Rows of the flat batch are
        the sequences' new tokens concatenated in this order. backend: "kernel" | "reference" | None
        (see the class). ValueError on inconsistent input.
        """
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if backend not in (None, "kernel", "reference"):
            raise ValueError(f"backend must be 'kernel', 'reference' or None, got {backend!r}")
        if not (len(query_lens) == len(context_lens) == len(block_tables)) or not query_lens:
            raise ValueError(
                f"need one query_len, context_len and block table per sequence (at least one), got "
                f"{len(query_lens)}, {len(context_lens)}, {len(block_tables)}"
            )
        for s, (qlen, ctx, table) in enumerate(zip(query_lens, context_lens, block_tables)):
            if qlen < 1 or ctx < qlen:
                raise ValueError(f"sequence {s}: need 1 <= query_len <= context_len, got {qlen} and {ctx}")
            if any(block < 0 for block in table):
                raise ValueError(f"sequence {s}: negative block id in block table {list(table)}")
            if len(table) * block_size < ctx:
                raise ValueError(
                    f"sequence {s}: block table of {len(table)} blocks x {block_size} covers fewer "
                    f"than its context_len {ctx} tokens"
                )
        return cls(query_lens, context_lens, block_tables, block_size, backend)

    def cached(self, key: tuple, make: Callable[[], Any]) -> Any:
        """`make()` the first time `key` is asked for in this step, the same object afterwards."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def num_cached(self) -> int:
        """How many gather indices / masks this step has built so far."""
        return len(self._cache)

    def decode_gather(self, window: int | None, n_kv: int) -> tuple[mx.array, mx.array | None]:
        """Flat K/V row indices (B, n_kv, L) into a pool's rows (`flat_rows`), and a mask (B, 1, 1, L) bool
        (None when every row uses all L keys)."""
        ctx = self.decode_context_lens_np  # (B,)
        n_keys = ctx if window is None else np.minimum(ctx, window)  # (B,)
        length = int(n_keys.max())
        j = np.arange(length, dtype=np.int64)  # (L,)
        pos = (ctx - n_keys)[:, None] + j[None, :]  # (B, L) key positions, last min(ctx, window) of each
        valid = j[None, :] < n_keys[:, None]  # (B, L)
        pos = np.where(valid, pos, 0)
        table = self.decode_block_tables_np
        slots = np.take_along_axis(table, pos // self.block_size, axis=1) * self.block_size + pos % self.block_size
        rows = pool_rows(slots, n_kv, self.block_size).transpose(0, 2, 1)  # (B, n_kv, L)
        mask = None if valid.all() else mx.array(valid[:, None, None, :])  # (B, 1, 1, L) bool
        return mx.array(rows.astype(np.int32)), mask

    def chunk_gather(self, chunk: PrefillChunk, window: int | None, n_kv: int) -> tuple[mx.array, int]:
        """Flat K/V row indices (1, n_kv, L) of `chunk`'s visible keys and the position of the first."""
        start = 0 if window is None else max(0, chunk.first_position - window + 1)
        rows = pool_rows(chunk.slots(start), n_kv, self.block_size).T[None]  # (1, n_kv, L)
        return mx.array(rows.astype(np.int32)), start

    def chunk_mask(self, chunk: PrefillChunk, window: int | None, start: int) -> mx.array:
        """Boolean mask (q_len, L) of `chunk`: causal, and within the window if any.

        An explicit mask built once per step beats sdpa's "causal" (rebuilt by every layer on CPU).
        """
        q_pos = np.arange(chunk.first_position, chunk.context_len)[:, None]  # (q_len, 1)
        k_pos = np.arange(start, chunk.context_len)[None, :]  # (1, L)
        allowed = k_pos <= q_pos  # (q_len, L)
        if window is not None:
            allowed &= k_pos > q_pos - window
        return mx.array(allowed)


def flat_rows(pool: mx.array) -> mx.array:
    """A pool's rows (num_blocks * n_kv_heads * block_size, row_width), indexed by kvcache.storage.pool_rows."""
    return pool.reshape(-1, pool.shape[-1])


def gathered_values(rows: mx.array, head_dim: int, dtype: mx.Dtype) -> mx.array:
    """Rows gathered from a pool (..., row_width) as (..., head_dim) values in `dtype` (q8 rows dequantized)."""
    if rows.dtype == mx.int8:
        return quantized.dequantize(rows, head_dim, dtype)
    return rows.astype(dtype)


def _decode_reference(queries, k_pool, v_pool, md, scale, window):
    """queries (B, n_heads, hd) -> (B, n_heads, hd), one sdpa padded to the longest context."""
    n_kv, hd = k_pool.shape[1], queries.shape[2]
    rows, mask = md.cached(("decode", window, n_kv), lambda: md.decode_gather(window, n_kv))
    keys = gathered_values(flat_rows(k_pool)[rows], hd, queries.dtype)  # (B, n_kv, L, hd)
    values = gathered_values(flat_rows(v_pool)[rows], hd, queries.dtype)  # (B, n_kv, L, hd)
    out = mx.fast.scaled_dot_product_attention(queries[:, :, None, :], keys, values, scale=scale, mask=mask)
    return out.reshape(queries.shape)  # (B, n_heads, hd)


def _decode_attention(queries, k_pool, v_pool, md, scale, window, use_kernel):
    """The decode rows of queries (T, n_heads, hd) -> (B, n_heads, hd), kernel or reference."""
    if md.decode_slice is not None:
        decode_q = queries[md.decode_slice[0] : md.decode_slice[1]]  # (B, n_heads, hd)
    else:
        decode_q = queries[md.decode_rows]  # (B, n_heads, hd)
    if use_kernel:
        return ext.paged_decode(
            decode_q, k_pool, v_pool, md.decode_block_tables, md.decode_context_lens,
            scale=scale, block_size=md.block_size, window=window or 0,
        )  # (B, n_heads, hd) float32
    return _decode_reference(decode_q, k_pool, v_pool, md, scale, window)


def _chunk_attention(queries, k_pool, v_pool, md, chunk, scale, window, use_kernel):
    """queries (q_len, n_heads, hd) of one prefill chunk -> (q_len, n_heads, hd).

    Kernel: the extension's paged prefill reads the pools (any of the three dtypes) through the block
    table in key tiles with an online softmax: no gather, no (q_len, L) scores, memory independent of
    the context. A build without it: two float32 matmuls around the fused causal softmax over the
    gathered (and widened) visible rows. Reference: one sdpa with a boolean mask.
    """
    if use_kernel and ext.has_paged_prefill():
        table = md.cached(("chunk_table", chunk.index), lambda: mx.array(chunk.table.astype(np.int32)))  # (n_blocks,)
        return ext.paged_prefill(queries, k_pool, v_pool, table, first_position=chunk.first_position, scale=scale,
                                 block_size=md.block_size, window=window or 0)  # (q_len, n_heads, hd) float32
    return _chunk_gathered(queries, k_pool, v_pool, md, chunk, scale, window, use_kernel)


def _chunk_gathered(queries, k_pool, v_pool, md, chunk, scale, window, use_kernel):
    """_chunk_attention over the chunk's visible rows gathered from the pools (see there)."""
    n_kv = k_pool.shape[1]
    rows, start = md.cached(("chunk", chunk.index, window, n_kv), lambda: md.chunk_gather(chunk, window, n_kv))
    q_len, n_heads, head_dim = queries.shape
    q = queries.transpose(1, 0, 2)  # (n_heads, q_len, hd)
    wide = mx.float32 if use_kernel else queries.dtype
    keys = gathered_values(flat_rows(k_pool)[rows], head_dim, wide)  # (1, n_kv, L, hd)
    values = gathered_values(flat_rows(v_pool)[rows], head_dim, wide)  # (1, n_kv, L, hd)
    if use_kernel:
        grouped = (q.astype(mx.float32) * scale).reshape(n_kv, -1, head_dim)  # (n_kv, rep * q_len, hd)
        scores = (grouped @ keys[0].swapaxes(1, 2)).reshape(n_heads, q_len, -1)  # (n_heads, q_len, L)
        offset = chunk.first_position - start  # query i sits at key index i + offset
        probs = ext.causal_softmax(scores, offset=offset, window=window or 0)  # (n_heads, q_len, L)
        out = probs.reshape(n_kv, -1, probs.shape[2]) @ values[0]  # (n_kv, rep * q_len, hd)
        return out.reshape(n_heads, q_len, head_dim).transpose(1, 0, 2)  # (q_len, n_heads, hd)
    mask = md.cached(("chunk_mask", chunk.index, window), lambda: md.chunk_mask(chunk, window, start))
    out = mx.fast.scaled_dot_product_attention(q[None], keys, values, scale=scale, mask=mask)
    return out[0].transpose(1, 0, 2)  # (q_len, n_heads, hd)


def paged_attention(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> mx.array:
    """Attention of this step's queries over each sequence's paged context.

    queries: (T, n_heads, head_dim); k_pool, v_pool: (num_blocks, n_kv_heads, block_size, row_width) already
    holding this step's K/V (kvcache/storage.py; row_width: head_dim, or an int8 q8 pool's quantized.row_width);
    n_heads a multiple of n_kv_heads (GQA). A query at position p sees
    positions p - sliding_window < k <= p. Returns (T, n_heads, head_dim) in the queries' dtype.
    With the C++ kernels (metadata.backend "kernel"; head_dim a multiple of 8, at most 256) decode
    rows and prefill chunks read the pools directly (float32 out); else the reference.
    """
    md = metadata
    if queries.ndim != 3 or queries.shape[0] != md.num_tokens:
        raise ValueError(f"queries {tuple(queries.shape)} must be (T={md.num_tokens}, n_heads, head_dim)")
    width = quantized.row_width(queries.shape[2]) if k_pool.dtype == mx.int8 else queries.shape[2]
    if (k_pool.shape != v_pool.shape or k_pool.ndim != 4 or k_pool.shape[3] != width or k_pool.dtype != v_pool.dtype
            or k_pool.shape[2] != md.block_size):
        raise ValueError(
            f"pools {tuple(k_pool.shape)}, {tuple(v_pool.shape)} do not fit queries {tuple(queries.shape)} "
            f"in blocks of {md.block_size}"
        )
    if queries.shape[1] % k_pool.shape[1]:
        raise ValueError(f"n_heads {queries.shape[1]} is not a multiple of n_kv_heads {k_pool.shape[1]}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if md.max_block_id >= k_pool.shape[0]:
        raise ValueError(
            f"block id {md.max_block_id} is outside the pool of {k_pool.shape[0]} blocks of {md.block_size}"
        )

    head_dim = queries.shape[2]
    backend = md.backend or md.cached(("backend",), attention_backend)  # METRALE_ATTENTION, read once per step
    use_kernel = backend == "kernel" and head_dim % 8 == 0 and head_dim <= 256
    decode_out = None
    if md.num_decode:
        decode_out = _decode_attention(queries, k_pool, v_pool, md, scale, sliding_window, use_kernel)
    pieces = []
    for piece in md.output_order:
        if isinstance(piece, DecodeRun):
            whole = piece.end - piece.start == md.num_decode
            pieces.append(decode_out if whole else decode_out[piece.start : piece.end])
        else:
            chunk_q = queries[piece.row_start : piece.row_start + piece.query_len]  # (q_len, n_heads, hd)
            pieces.append(_chunk_attention(chunk_q, k_pool, v_pool, md, piece, scale, sliding_window, use_kernel))
    out = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)  # (T, n_heads, hd)
    return out.astype(queries.dtype)

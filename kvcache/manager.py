"""KVCacheManager: every request's block table, slot allocation and prefix caching (pure Python).

A request's tokens and its block table, for block_size 4 (C: computed, N: new this step):

    tokens   | C C C C | C C C C | C C N N | N . . . |
    blocks   | 7       | 2       | 9       | 4       |      table = [7, 2, 9, 4]
              <- prefix hit ->    <- partial, owned -> <- fresh this step
                 (cached, may be shared)

Positions [num_computed_tokens, num_computed_tokens + num_new_tokens) are written this step; they
always fall in blocks the request owns alone (ref_cnt 1). A block is hashed and registered in the
cache when it becomes full of known tokens, once; later requests with the same prefix share it.

Forking (parallel sampling, n > 1): a child takes references on its parent's full blocks and a
fresh block for the partial one, whose K/V the runner copies before the next forward:

    parent   | 7 | 2 | 9 (partial: p p p .) |
    child    | 7 | 2 | 5 (copy of 9)        |     fork(...) -> [(9, 5)]  (src block, dst block)

Every block held by several tables is full in each of them: nobody writes a shared block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from kvcache.blocks import BlockPool, KVCacheBlock
from kvcache.hashing import BlockHash, extend_block_hashes


class KVSequence(Protocol):
    """What the manager reads from a request (scheduler.Request satisfies it)."""

    request_id: str
    num_computed_tokens: int
    cache_salt: str | None
    lora_key: str | None  # the LoRA adapter's identity; None for the base model

    @property
    def all_token_ids(self) -> Sequence[int]: ...


class _RequestBlocks:
    """The manager's record of one request: its table, block ids and full-block hashes."""

    __slots__ = ("blocks", "block_ids", "hashes", "num_cached_blocks", "num_full_blocks")

    def __init__(self) -> None:
        self.blocks: list[KVCacheBlock] = []  # the block table, in token order
        self.block_ids: tuple[int, ...] = ()  # ids of `blocks`, rebuilt when blocks are added
        self.hashes: list[BlockHash] = []  # hashes of the request's first len(hashes) full blocks
        self.num_cached_blocks = 0  # leading blocks already registered in the cache (or tried)
        self.num_full_blocks = 0  # leading blocks full of known tokens (read-only from then on)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns every request's block table on top of a BlockPool.

    Running out of blocks is normal: `allocate_slots` returns None and the caller waits or
    preempts. Misuse raises ValueError; a broken invariant raises RuntimeError with the numbers.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._records: dict[str, _RequestBlocks] = {}
        # Token counters, counted once per admission (first allocation of a request).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (free cached blocks count as free)."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in 0..1."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return _cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, seq: KVSequence) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `seq`, in full blocks; changes no ref counts.

        Never covers the whole sequence: at least its last token is left to compute, so that the
        step that computes it can sample. The request's block hashes are computed once and kept
        (for retries while it waits) until `free(request_id)`, which every looked-up request needs.

        Returns:
            (blocks, num_hit_tokens) with num_hit_tokens == len(blocks) * block_size; pass both
            to `allocate_slots` in the same step (a later allocation may evict them).
        """
        if not self.enable_prefix_caching:
            return [], 0
        tokens = seq.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        rec = self._records.get(seq.request_id)
        if rec is None:
            rec = self._records[seq.request_id] = _RequestBlocks()
        hashes = extend_block_hashes(
            rec.hashes, tokens, self.block_size, max_blocks, seq.cache_salt, seq.lora_key
        )
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        seq: KVSequence,
        num_new_tokens: int,
        computed_blocks: Sequence[KVCacheBlock] | None = None,
        num_computed_tokens: int | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for num_computed_tokens + num_new_tokens (+ num_lookahead_tokens) tokens of `seq`;
        all or nothing.

        Args:
            seq: the request; its table grows by prefix-hit blocks, then fresh ones.
            num_new_tokens: tokens to compute this step (known tokens of `seq`).
            computed_blocks: prefix hits from `get_computed_blocks`, only for a request that holds
                no blocks yet.
            num_computed_tokens: tokens already computed; defaults to seq.num_computed_tokens
                (pass the hit count for a new request, whose counter is still 0).
            num_lookahead_tokens: slots after the known tokens for draft tokens to verify; they
                are never hashed (a block is cached only once full of known, verified tokens).

        Returns:
            The ids of the fresh blocks (possibly []), or None when there is no room; None changes
            nothing, so test it with `is None`.
        """
        rid = seq.request_id
        computed = computed_blocks or ()
        num_computed = (
            seq.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        )
        rec = self._records.get(rid)
        self._check_allocation(seq, num_new_tokens, computed, num_computed, rec)
        if num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")
        num_held = len(rec.blocks) if rec is not None else 0
        total = num_computed + num_new_tokens
        num_fresh = max(0, _cdiv(total + num_lookahead_tokens, self.block_size) - num_held - len(computed))
        num_revived = sum(1 for b in computed if b.ref_cnt == 0)  # free now, leave the queue
        if num_fresh + num_revived > self.pool.num_free_blocks:
            return None
        if rec is None:
            rec = self._records[rid] = _RequestBlocks()
        if num_held == 0 and self.enable_prefix_caching:
            self.prefix_cache_queries += len(seq.all_token_ids)
            self.prefix_cache_hits += num_computed
        fresh = []
        if computed or num_fresh:  # decode steps inside a block skip all of this
            self.pool.touch(computed)
            fresh = self.pool.allocate(num_fresh)
            rec.blocks.extend(computed)
            rec.blocks.extend(fresh)
            rec.block_ids = tuple(b.block_id for b in rec.blocks)
        rec.num_full_blocks = max(rec.num_full_blocks, total // self.block_size)
        if self.enable_prefix_caching and total // self.block_size > rec.num_cached_blocks:
            self._cache_full_blocks(seq, rec, total // self.block_size)
        return [b.block_id for b in fresh]

    def _check_allocation(
        self,
        seq: KVSequence,
        num_new: int,
        computed: Sequence[KVCacheBlock],
        num_computed: int,
        rec: _RequestBlocks | None,
    ) -> None:
        num_held = len(rec.blocks) if rec is not None else 0
        num_tokens = len(seq.all_token_ids)
        if num_new < 0 or num_computed < 0 or num_computed + num_new > num_tokens:
            raise ValueError(
                f"request {seq.request_id!r}: cannot compute {num_new} new tokens after "
                f"{num_computed} of {num_tokens} known tokens"
            )
        if computed and num_held:
            raise ValueError(
                f"request {seq.request_id!r} already holds {num_held} blocks; "
                "computed_blocks are only for a request's first allocation"
            )
        if computed and len(computed) * self.block_size != num_computed:
            raise ValueError(
                f"{len(computed)} computed blocks of {self.block_size} tokens != "
                f"num_computed_tokens {num_computed}"
            )
        if computed and (
            rec is None or any(b.block_hash != h for b, h in zip(computed, rec.hashes))
            or len(rec.hashes) < len(computed)
        ):
            raise ValueError(
                f"request {seq.request_id!r}: computed_blocks are stale (evicted since "
                "get_computed_blocks); look them up again in the same step"
            )
        if num_held * self.block_size < num_computed - len(computed) * self.block_size:
            raise RuntimeError(
                f"request {seq.request_id!r} holds {num_held} blocks but claims "
                f"{num_computed} computed tokens"
            )
        first = num_computed // self.block_size  # the block receiving the first new token
        if rec is not None and num_new and first < num_held:
            self._check_writable(seq.request_id, rec.blocks[first], num_computed)

    @staticmethod
    def _check_writable(rid: str, block: KVCacheBlock, position: int) -> None:
        # Shared and cached blocks are full of computed tokens: writing one is a bookkeeping bug.
        if block.ref_cnt != 1 or block.block_hash is not None:
            raise RuntimeError(
                f"request {rid!r} would write position {position} into block {block.block_id} "
                f"(ref_cnt {block.ref_cnt}, cached {block.block_hash is not None})"
            )

    def _cache_full_blocks(self, seq: KVSequence, rec: _RequestBlocks, num_full: int) -> None:
        """Register blocks [rec.num_cached_blocks, num_full) of `seq`; each block is hashed once."""
        hashes = extend_block_hashes(
            rec.hashes, seq.all_token_ids, self.block_size, num_full, seq.cache_salt, seq.lora_key
        )
        for i in range(rec.num_cached_blocks, num_full):
            block = rec.blocks[i]
            if block.block_hash is None:
                self.pool.cache_block(block, hashes[i])
        rec.num_cached_blocks = num_full

    def fork(self, parent_id: str, child: KVSequence, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give `child` (holding no blocks) the parent's K/V of its first `num_tokens` tokens.

        The child takes a reference on each of the parent's full blocks among them, and a fresh
        block for a partial last one, to be filled by copying the parent's block (copy on write:
        the child writes its own tokens there next). The parent's tokens [0, num_tokens) must have
        been computed (by a step that has run), and the child's first num_tokens tokens must be
        the same; the caller sets the child's num_computed_tokens to num_tokens.

        Returns:
            The block copies to run before the next forward, [(src block id, dst block id)] or [],
            or None when no block is free for the partial block (nothing changed then).
        """
        parent = self._records.get(parent_id)
        num_held = len(parent.blocks) if parent is not None else 0
        if num_tokens < 0 or num_held * self.block_size < num_tokens:
            raise ValueError(f"cannot fork {num_tokens} tokens of request {parent_id!r}, which holds "
                             f"{num_held} blocks of {self.block_size}")
        rec = self._records.get(child.request_id)
        if rec is not None and rec.blocks:
            raise ValueError(f"request {child.request_id!r} already holds {len(rec.blocks)} blocks; cannot fork into it")
        num_shared, partial = divmod(num_tokens, self.block_size)
        if partial and self.pool.num_free_blocks < 1:
            return None
        if rec is None:
            rec = self._records[child.request_id] = _RequestBlocks()
        shared = parent.blocks[:num_shared]
        self.pool.touch(shared)
        rec.blocks.extend(shared)
        copies = []
        if partial:
            (fresh,) = self.pool.allocate(1)
            rec.blocks.append(fresh)
            copies.append((parent.blocks[num_shared].block_id, fresh.block_id))
        rec.block_ids = tuple(b.block_id for b in rec.blocks)
        rec.num_full_blocks = num_shared
        rec.num_cached_blocks = num_shared  # the parent registered (or tried) them when they filled
        return copies

    def block_table(self, request_id: str) -> list[int]:
        """The request's physical block ids in token order ([] for a request holding none)."""
        rec = self._records.get(request_id)
        return list(rec.block_ids) if rec is not None else []

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """`block_table` as an immutable tuple, without a copy (for the per-step output)."""
        rec = self._records.get(request_id)
        return rec.block_ids if rec is not None else ()

    def free(self, request_id: str, *, discard_cached: bool = False) -> None:
        """Release every block of the request, last block first, and forget the request.

        Freed blocks keep their hash (the LRU evicts them later) unless `discard_cached`, which is
        for KV that may not have been written (a failed step). Unknown ids are a no-op.
        """
        rec = self._records.pop(request_id, None)
        if rec is not None:
            self.pool.release(reversed(rec.blocks), discard_cached)

    def check_integrity(self, live_request_ids: Iterable[str]) -> None:
        """Raise RuntimeError with the numbers if any accounting invariant is broken.

        Checks: free + used == total; the free queue holds exactly the ref_cnt-0 blocks; every
        ref count equals the number of tables holding the block; a block held by several tables
        is full (read-only) in every one of them (a prefix-cache hit or a fork); no table repeats
        a block; no request outside `live_request_ids` holds anything.
        """
        self.pool.check_integrity()
        live = set(live_request_ids)
        owners = [0] * self.pool.num_blocks
        writable: dict[int, str] = {}  # block id -> a request that may still write it
        for rid, rec in self._records.items():
            if rid not in live:
                raise RuntimeError(
                    f"request {rid!r} is not live but holds {len(rec.blocks)} blocks"
                )
            if rec.block_ids != tuple(b.block_id for b in rec.blocks):
                raise RuntimeError(f"request {rid!r}: block id list disagrees with its table")
            if len(set(rec.block_ids)) != len(rec.block_ids):
                raise RuntimeError(f"request {rid!r} holds a block twice: {rec.block_ids}")
            for index, block in enumerate(rec.blocks):
                owners[block.block_id] += 1
                if index >= rec.num_full_blocks:
                    writable[block.block_id] = rid
        for block in self.pool.blocks:
            n = owners[block.block_id]
            if block.ref_cnt != n:
                raise RuntimeError(f"block {block.block_id} ref_cnt {block.ref_cnt} != {n} owners")
            if n > 1 and block.block_id in writable:
                raise RuntimeError(f"block {block.block_id} is held by {n} requests but request "
                                   f"{writable[block.block_id]!r} may still write it (not full)")

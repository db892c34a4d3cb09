"""Physical KV blocks, the free queue (which is also the LRU), and the block pool (pure Python).

Every block is preallocated; a block is either free (ref_cnt == 0, linked into the free queue) or
used (ref_cnt == number of block tables holding it). A free block may still carry a hash: its KV is
valid and a later request with the same prefix can take it back out of the queue ("touch"). New
blocks are taken from the queue's head, so the head is the eviction end:

    head -> [uncached blocks] [cached, least recently freed ... most recently freed] <- tail

Uncached blocks are freed to the head (nothing is lost by reusing them first); cached blocks to
the tail, so eviction order is LRU over the time a block was last freed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice

from kvcache.hashing import BlockHash


class KVCacheBlock:
    """One physical block of `block_size` token slots in the KV pool.

    Attributes:
        block_id: index of the block in the pool (slot = block_id * block_size + offset).
        ref_cnt: number of block tables holding the block; 0 means free.
        block_hash: the hash of the full block's content once it is cached, else None.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Intrusive links of the free queue: both None exactly when the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, {cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append, appendleft and remove.

    The links live in the blocks themselves (no per-node allocation), between two sentinels, so
    removing a cached block from the middle when a request takes it back is O(1).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: never handed out
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Free blocks from head (next to be reused) to tail."""
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def checked_walk(self, max_blocks: int) -> list[KVCacheBlock]:
        """The free blocks, head to tail, after checking the links and the counter.

        Stops after `max_blocks` + 1 nodes so that a corrupted (cyclic) list cannot hang.
        """
        free = list(islice(self, max_blocks + 1))
        if len(free) != self.num_free_blocks or len(free) > max_blocks:
            raise RuntimeError(
                f"free queue walk found {len(free)} blocks, counter says {self.num_free_blocks}, "
                f"pool has {max_blocks}"
            )
        prev = self._head
        for block in free:
            if block.prev_free is not prev:
                raise RuntimeError(f"free block {block.block_id} has a broken back link")
            prev = block
        if self._tail.prev_free is not prev:
            raise RuntimeError("free queue tail link is broken")
        return free

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block at the head (the next one to evict)."""
        block = self._head.next_free
        if block is None or block is self._tail:
            raise ValueError("popleft from an empty free block queue")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Link `block` at the tail (evicted last)."""
        self._link_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Link `block` at the head (reused first)."""
        self._link_after(self._head, block)

    def _link_after(self, prev: KVCacheBlock | None, block: KVCacheBlock) -> None:
        if prev is None or block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"block {block.block_id} is already in the free queue")
        nxt = prev.next_free
        if nxt is None:
            raise RuntimeError("free queue links are broken")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1


class BlockPool:
    """All `num_blocks` blocks, their ref counts, the free queue and the hash -> block map.

    The pool does mechanics only; the KVCacheManager decides what to allocate and checks room first.
    Asking for more blocks than are free is misuse and raises ValueError.
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # One block per hash. A second block filled with the same content (two requests computed
        # the same prefix at once) is simply left uncached; block tables are append-only.
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached or not."""
        return self.free_queue.num_free_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding `block_hash`'s content, used or free, or None."""
        return self.cached_blocks.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue, evicting their hashes.

        Returns:
            The blocks, each with ref_cnt 1 and no hash.
        """
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: {self.free_queue.num_free_blocks} free"
            )
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block, pulling free (cached) ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVCacheBlock], discard_cached: bool = False) -> None:
        """Drop one reference on each block, in the order given (pass a table reversed).

        A block reaching ref_cnt 0 is freed: cached blocks go to the tail of the queue (evicted
        last), uncached ones to the head. With `discard_cached`, freed blocks also lose their hash
        (for KV that may never have been written, e.g. after a failed step).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} released with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            if discard_cached:
                self._uncache(block)
            if block.block_hash is None:
                self.free_queue.appendleft(block)
            else:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full, used block under `block_hash`.

        Returns:
            False (and leaves the block uncached) when another block already holds that hash.
        """
        if block.block_hash is not None:
            raise RuntimeError(f"block {block.block_id} is already cached")
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def _uncache(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def check_integrity(self) -> None:
        """Raise RuntimeError with numbers if the queue, the ref counts or the hash map disagree."""
        free = self.free_queue.checked_walk(self.num_blocks)
        for block in free:
            if block.ref_cnt != 0:
                raise RuntimeError(f"free block {block.block_id} has ref_cnt {block.ref_cnt}")
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        if len(free) + in_use != self.num_blocks:
            raise RuntimeError(f"free {len(free)} + used {in_use} != total {self.num_blocks}")
        for block_hash, block in self.cached_blocks.items():
            if block.block_hash != block_hash:
                raise RuntimeError(f"hash map entry for block {block.block_id} has a stale hash")
        num_hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        if num_hashed != len(self.cached_blocks):
            raise RuntimeError(
                f"{num_hashed} blocks carry a hash but the map has {len(self.cached_blocks)}"
            )

"""FreeBlockQueue and BlockPool: O(1) linked free queue, ref counts, hash map, eviction order."""

import pytest

from kvcache.blocks import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def make_queue(n):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeBlockQueue(blocks)


def test_queue_keeps_insertion_order_and_count():
    blocks, q = make_queue(4)
    assert ids(q) == [0, 1, 2, 3]
    assert len(q) == q.num_free_blocks == 4
    assert q.checked_walk(4) == blocks


def test_queue_popleft_append_appendleft_remove():
    blocks, q = make_queue(5)
    assert q.popleft() is blocks[0]
    q.remove(blocks[2])  # from the middle, O(1)
    assert ids(q) == [1, 3, 4]
    q.append(blocks[2])
    q.appendleft(blocks[0])
    assert ids(q) == [0, 1, 3, 4, 2]
    assert len(q) == 5
    q.checked_walk(5)


def test_removed_block_has_no_links():
    blocks, q = make_queue(3)
    q.remove(blocks[1])
    assert blocks[1].prev_free is None and blocks[1].next_free is None


def test_queue_empty_popleft_raises():
    _, q = make_queue(1)
    q.popleft()
    with pytest.raises(ValueError, match="empty"):
        q.popleft()
    assert len(q) == 0 and list(q) == []


def test_queue_rejects_double_insert_and_foreign_remove():
    blocks, q = make_queue(2)
    with pytest.raises(RuntimeError, match="already in the free queue"):
        q.append(blocks[0])
    with pytest.raises(RuntimeError, match="already in the free queue"):
        q.appendleft(blocks[1])
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(KVCacheBlock(7))


def test_checked_walk_detects_corruption():
    blocks, q = make_queue(3)
    blocks[2].prev_free = blocks[0]  # broken back link
    with pytest.raises(RuntimeError, match="back link"):
        q.checked_walk(3)
    blocks, q = make_queue(3)
    q.num_free_blocks = 2
    with pytest.raises(RuntimeError, match="counter says 2"):
        q.checked_walk(3)
    blocks, q = make_queue(3)
    blocks[2].next_free = blocks[0]  # a cycle: the bounded walk still ends
    with pytest.raises(RuntimeError, match="walk found"):
        q.checked_walk(3)


def test_pool_allocate_sets_ref_and_takes_from_head():
    pool = BlockPool(4)
    got = pool.allocate(3)
    assert ids(got) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_pool_allocate_too_many_is_misuse():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="cannot allocate 3 blocks: 2 free"):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_pool_rejects_bad_size(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)


def test_release_cached_to_tail_uncached_to_head():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    assert pool.cache_block(a, b"ha") and pool.cache_block(b, b"hb")
    pool.release(reversed([a, b, c]))  # a request's table, freed last block first
    # c is uncached -> head; b then a are cached -> tail in that order (b evicted before a).
    assert ids(pool.free_queue) == [2, 1, 0]
    assert pool.get_cached_block(b"ha") is a  # free blocks keep their hash
    pool.check_integrity()


def test_allocate_evicts_hash_in_lru_order():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for blk, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache_block(blk, h)
    pool.release([b])
    pool.release([a])
    pool.release([c])  # freed order: b, a, c
    (first,) = pool.allocate(1)
    assert first is b and first.block_hash is None
    assert pool.get_cached_block(b"b") is None
    assert pool.get_cached_block(b"a") is a
    pool.check_integrity()


def test_touch_revives_free_cached_block_and_shares_used_one():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"a")
    pool.touch([a])  # a second table shares it
    assert a.ref_cnt == 2
    pool.release([a])
    pool.release([a])
    assert a.ref_cnt == 0 and pool.num_free_blocks == 3
    pool.touch([a])  # revived from the middle of the free queue
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    assert a not in list(pool.free_queue)
    pool.check_integrity()


def test_release_below_zero_raises():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.release([a])
    with pytest.raises(RuntimeError, match="ref_cnt 0"):
        pool.release([a])


def test_cache_block_duplicate_hash_is_left_uncached():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, b"same")
    assert not pool.cache_block(b, b"same")
    assert b.block_hash is None and pool.get_cached_block(b"same") is a
    with pytest.raises(RuntimeError, match="already cached"):
        pool.cache_block(a, b"other")


def test_release_discard_cached_drops_hash():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"a")
    pool.release([a, b], discard_cached=True)
    assert a.block_hash is None and pool.cached_blocks == {}
    pool.check_integrity()


def test_pool_integrity_reports_numbers():
    pool = BlockPool(3)
    a, _ = pool.allocate(2)
    a.ref_cnt = 0  # used but claims to be free
    with pytest.raises(RuntimeError, match=r"free 1 \+ used 1 != total 3"):
        pool.check_integrity()
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    a.block_hash = b"x"  # hash set behind the map's back
    with pytest.raises(RuntimeError, match="1 blocks carry a hash but the map has 0"):
        pool.check_integrity()

"""KVCacheManager: allocation all-or-nothing, prefix caching, LRU eviction, counters, integrity."""

from dataclasses import dataclass, field

import pytest

from kvcache.manager import KVCacheManager

BS = 4


@dataclass
class Seq:
    """The minimal sequence the manager reads (scheduler.Request has the same fields)."""

    request_id: str
    all_token_ids: list = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_key: str | None = None


def admit(mgr, seq, num_new=None):
    """What the scheduler does for a new request: look up the prefix, allocate, advance."""
    blocks, hit = mgr.get_computed_blocks(seq)
    n = len(seq.all_token_ids) - hit if num_new is None else num_new
    got = mgr.allocate_slots(seq, n, computed_blocks=blocks, num_computed_tokens=hit)
    if got is not None:
        seq.num_computed_tokens = hit + n
    return got, hit


def test_allocate_grows_table_and_reports_usage():
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    s = Seq("a", list(range(10)))
    got, hit = admit(mgr, s)
    assert hit == 0 and got == [0, 1, 2] and mgr.block_table("a") == [0, 1, 2]
    assert mgr.num_free_blocks == 5 and mgr.usage == pytest.approx(3 / 8)
    s.all_token_ids.append(99)  # decode: the 11th token fits in block 2
    assert mgr.allocate_slots(s, 1) == []  # [] is "nothing new needed", not "no room"
    s.num_computed_tokens = 11
    s.all_token_ids.append(98)
    s.all_token_ids.append(97)
    assert mgr.allocate_slots(s, 2) == [3]  # position 12 opens a new block
    mgr.check_integrity(["a"])


def test_no_room_returns_none_and_changes_nothing():
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    a = Seq("a", list(range(8)))
    admit(mgr, a)
    b = Seq("b", list(range(100, 112)))
    before = (mgr.num_free_blocks, mgr.prefix_cache_queries, mgr.prefix_cache_hits)
    got, _ = admit(mgr, b)
    assert got is None
    assert mgr.block_table("b") == []
    assert (mgr.num_free_blocks, mgr.prefix_cache_queries, mgr.prefix_cache_hits) == before
    mgr.check_integrity(["a", "b"])  # b has cached hashes for its retry, no blocks


def test_two_requests_share_a_three_block_prefix_computed_once():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    prefix = list(range(1000, 1012))  # 3 full blocks
    a = Seq("a", prefix + [1, 2])
    b = Seq("b", prefix + [7, 8, 9])
    got_a, hit_a = admit(mgr, a)
    got_b, hit_b = admit(mgr, b)
    assert hit_a == 0 and len(got_a) == 4
    assert hit_b == 12 and len(got_b) == 1  # only b's own tail is computed
    computed = (a.num_computed_tokens - hit_a) + (b.num_computed_tokens - hit_b)
    assert computed == 14 + 3  # the 12 shared tokens once, not twice
    ta, tb = mgr.block_table("a"), mgr.block_table("b")
    assert ta[:3] == tb[:3] and ta[3] != tb[3]
    assert [mgr.pool.blocks[i].ref_cnt for i in ta] == [2, 2, 2, 1]
    assert mgr.prefix_cache_queries == 14 + 15 and mgr.prefix_cache_hits == 12
    mgr.check_integrity(["a", "b"])


def test_shared_blocks_are_never_written():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    prefix = list(range(12))
    a, b = Seq("a", prefix + [1]), Seq("b", prefix + [2, 3])
    admit(mgr, a)
    admit(mgr, b, num_new=2)
    table = mgr.block_table("b")
    written = {table[p // BS] for p in range(12, 14)}  # b's positions this step
    assert all(mgr.pool.blocks[i].ref_cnt == 1 for i in written)
    # Claiming position 4 (inside a shared block) is a bookkeeping bug, caught before any change.
    free = mgr.num_free_blocks
    with pytest.raises(RuntimeError, match="would write position 4 into block"):
        mgr.allocate_slots(b, 1, num_computed_tokens=4)
    assert mgr.num_free_blocks == free
    mgr.check_integrity(["a", "b"])


@pytest.mark.parametrize(("n_tokens", "expect_hit"), [(8, 4), (9, 8), (12, 8), (13, 12), (1, 0)])
def test_hit_never_covers_the_whole_sequence(n_tokens, expect_hit):
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = list(range(n_tokens))
    admit(mgr, Seq("a", list(tokens)))
    mgr.free("a")
    got, hit = admit(mgr, Seq("b", list(tokens)))
    assert hit == expect_hit and got is not None
    assert mgr.block_table("b")  # at least one token computed, in b's own block


def probe(mgr, tokens):
    """Tokens of `tokens` a new request would get from the cache (the lookup is forgotten)."""
    hit = mgr.get_computed_blocks(Seq("probe", list(tokens)))[1]
    mgr.free("probe")
    return hit


def test_lru_evicts_least_recently_freed_and_tail_blocks_first():
    mgr = KVCacheManager(num_blocks=9, block_size=2)
    seqs = {rid: [base + i for i in range(5)] for rid, base in (("a", 10), ("b", 20), ("c", 30))}
    for rid, tokens in seqs.items():
        admit(mgr, Seq(rid, list(tokens)))  # 5 tokens: 2 full cached blocks + 1 partial each
    for rid in "abc":
        mgr.free(rid)
    # Free queue: the 3 uncached partials at the head, then a1 a0 b1 b0 c1 c0 (LRU first).
    assert [mgr.pool.blocks[i].block_hash is None for i in range(9)].count(True) == 3
    admit(mgr, Seq("d", list(range(500, 509))))  # 5 blocks: the 3 partials, a1, then a0
    assert probe(mgr, seqs["a"] + [0]) == 0
    assert probe(mgr, seqs["a"][:2] + [0]) == 0  # a's first block went last of a's
    assert probe(mgr, seqs["b"] + [0]) == 4 and probe(mgr, seqs["c"] + [0]) == 4
    mgr.free("d")
    # Using b again makes it the most recently freed: c (and d) are evicted before b now.
    admit(mgr, Seq("b2", seqs["b"] + [0]))
    mgr.free("b2")
    got, _ = admit(mgr, Seq("e", list(range(700, 721))))  # 11 blocks > 9: no room
    assert got is None
    mgr.free("e")
    got, _ = admit(mgr, Seq("e2", list(range(700, 711))))  # 6 blocks: c's and d's go
    assert got is not None and len(got) == 6
    assert probe(mgr, seqs["c"] + [0]) == 0 and probe(mgr, seqs["b"] + [0]) == 4
    mgr.check_integrity(["e2"])


def test_eviction_order_between_two_freed_requests():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a, b = Seq("a", [1, 2, 3, 4]), Seq("b", [5, 6, 7, 8])
    admit(mgr, a, num_new=3)  # position 3 is left for the sampling step: blocks [a0, a1]
    admit(mgr, b, num_new=3)
    mgr.free("a")  # a first: a is the least recently used
    mgr.free("b")
    # Queue: b1 a1 (uncached, head), a0, b0 (cached, LRU order).
    admit(mgr, Seq("x", [90, 91, 92, 93, 94]))  # 3 blocks: b1, a1, then a0
    assert probe(mgr, [1, 2, 3]) == 0
    assert probe(mgr, [5, 6, 7]) == 2
    mgr.check_integrity(["x"])


def test_hits_and_queries_counted_once_per_admission():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    admit(mgr, Seq("a", list(range(9))))
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (9, 0)
    mgr.free("a")
    b = Seq("b", list(range(9)) + [5])
    for _ in range(3):  # lookups alone (e.g. a blocked queue head) do not count
        mgr.get_computed_blocks(b)
    admit(mgr, b)
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (19, 8)
    b.all_token_ids.append(1)
    mgr.allocate_slots(b, 1)  # a later step of a running request does not count again
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (19, 8)


def test_salt_separates_caches():
    mgr = KVCacheManager(num_blocks=12, block_size=BS)
    tokens = list(range(9))
    admit(mgr, Seq("x1", list(tokens), cache_salt="tenant-x"))
    assert admit(mgr, Seq("y1", list(tokens), cache_salt="tenant-y"))[1] == 0
    assert admit(mgr, Seq("none", list(tokens)))[1] == 0
    assert admit(mgr, Seq("x2", list(tokens), cache_salt="tenant-x"))[1] == 8
    mgr.check_integrity(["x1", "y1", "none", "x2"])


def test_blocks_filled_by_decode_are_cached():
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    s = Seq("a", [1, 2, 3])
    admit(mgr, s)
    for tok in (4, 5, 6):  # decode: position 3..5; the block [1,2,3,4] fills at position 3
        s.all_token_ids.append(tok)
        assert mgr.allocate_slots(s, 1) is not None
        s.num_computed_tokens += 1
    hit = mgr.get_computed_blocks(Seq("b", [1, 2, 3, 4, 5]))[1]
    assert hit == 4


def test_same_prefix_admitted_together_keeps_one_cached_copy():
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    a, b = Seq("a", list(range(9))), Seq("b", list(range(9)))
    ha, hb = mgr.get_computed_blocks(a), mgr.get_computed_blocks(b)  # both miss
    assert mgr.allocate_slots(a, 9, *ha) is not None
    assert mgr.allocate_slots(b, 9, *hb) is not None  # duplicates stay uncached
    assert len(mgr.pool.cached_blocks) == 2
    mgr.check_integrity(["a", "b"])
    mgr.free("a")
    mgr.free("b")
    assert mgr.num_free_blocks == 8 and len(mgr.pool.cached_blocks) == 2
    mgr.check_integrity([])


def test_free_is_reverse_idempotent_and_keeps_hashes():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    admit(mgr, Seq("a", list(range(9))))
    mgr.free("a")
    mgr.free("a")
    mgr.free("never-seen")
    assert mgr.num_free_blocks == 4 and all(b.ref_cnt == 0 for b in mgr.pool.blocks)
    # Block 2 (partial, uncached) went to the head; 1 then 0 (cached) to the tail, 0 last.
    assert [b.block_id for b in mgr.pool.free_queue] == [2, 3, 1, 0]
    assert admit(mgr, Seq("b", list(range(9))))[1] == 8


def test_free_discard_cached_forgets_the_prefix():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    admit(mgr, Seq("a", list(range(9))))
    mgr.free("a", discard_cached=True)
    assert mgr.pool.cached_blocks == {}
    assert admit(mgr, Seq("b", list(range(9))))[1] == 0


def test_prefix_caching_disabled():
    mgr = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    admit(mgr, Seq("a", list(range(9))))
    assert mgr.get_computed_blocks(Seq("b", list(range(9)))) == ([], 0)
    assert mgr.pool.cached_blocks == {} and mgr.prefix_cache_queries == 0


def test_allocate_misuse_raises_value_error():
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    s = Seq("a", list(range(5)))
    with pytest.raises(ValueError, match="cannot compute 6 new tokens after 0 of 5"):
        mgr.allocate_slots(s, 6)
    admit(mgr, s)
    blocks, _ = mgr.get_computed_blocks(Seq("b", list(range(5))))
    with pytest.raises(ValueError, match="already holds 2 blocks"):
        mgr.allocate_slots(s, 0, computed_blocks=blocks, num_computed_tokens=4)
    with pytest.raises(ValueError, match="!= num_computed_tokens 0"):
        mgr.allocate_slots(Seq("c", list(range(5))), 1, computed_blocks=blocks,
                           num_computed_tokens=0)


def test_stale_computed_blocks_are_rejected():
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    admit(mgr, Seq("a", list(range(5))))
    mgr.free("a")
    b = Seq("b", list(range(5)))
    blocks, hit = mgr.get_computed_blocks(b)
    admit(mgr, Seq("x", list(range(50, 62))))  # evicts a's cached block
    with pytest.raises(ValueError, match="stale"):
        mgr.allocate_slots(b, 1, computed_blocks=blocks, num_computed_tokens=hit)


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (4, 2.0), (True, 4)])
def test_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=num_blocks, block_size=block_size)


def test_integrity_catches_leaks_and_bad_ref_counts():
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    admit(mgr, Seq("a", list(range(6))))
    with pytest.raises(RuntimeError, match="'a' is not live but holds 2 blocks"):
        mgr.check_integrity([])
    mgr.pool.blocks[mgr.block_table("a")[0]].ref_cnt += 1
    with pytest.raises(RuntimeError, match="ref_cnt 2 != 1 owners"):
        mgr.check_integrity(["a"])


def test_integrity_catches_sharing_of_a_writable_block():
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    admit(mgr, Seq("a", list(range(3))))
    admit(mgr, Seq("b", list(range(50, 53))))
    rec_a, rec_b = mgr._records["a"], mgr._records["b"]  # corrupt on purpose
    mgr.pool.release(rec_b.blocks)
    rec_b.blocks[0] = rec_a.blocks[0]
    rec_b.block_ids = (rec_a.block_ids[0], *rec_b.block_ids[1:])
    mgr.pool.touch([rec_a.blocks[0]])
    with pytest.raises(RuntimeError, match="held by 2 requests but request '.' may still write it"):
        mgr.check_integrity(["a", "b"])


# ---- fork (parallel sampling) ----

@pytest.mark.parametrize("caching", [True, False])
def test_fork_shares_full_blocks_and_copies_the_partial_one(caching):
    mgr = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=caching)
    prompt = list(range(10))
    parent = Seq("p", list(prompt))
    admit(mgr, parent)  # 10 tokens: blocks 0, 1 full, block 2 holds 2
    table = mgr.block_table("p")
    child = Seq("c", list(prompt))
    copies = mgr.fork("p", child, 9)  # the child recomputes the last prompt token itself
    assert copies == [(table[2], copies[0][1])] and copies[0][1] not in table
    assert mgr.block_table("c") == [table[0], table[1], copies[0][1]]
    assert [mgr.pool.blocks[b].ref_cnt for b in table] == [2, 2, 1]
    assert mgr.num_free_blocks == 8 - 4  # 3 blocks for the parent, 1 copy for the child
    mgr.check_integrity(["p", "c"])
    child.num_computed_tokens = 9
    assert mgr.allocate_slots(child, 1) == []  # position 9 goes into the child's own copy
    child.all_token_ids += [50, 51, 52]
    child.num_computed_tokens = 10
    assert len(mgr.allocate_slots(child, 3)) == 1  # 13 tokens: a 4th block of its own
    mgr.check_integrity(["p", "c"])
    mgr.free("p")
    assert [mgr.pool.blocks[b].ref_cnt for b in table] == [1, 1, 0]
    mgr.check_integrity(["c"])
    mgr.free("c")
    assert mgr.num_free_blocks == 8
    mgr.check_integrity([])


def test_fork_on_a_block_boundary_copies_nothing():
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    admit(mgr, Seq("p", list(range(9))))  # the child recomputes token 8, the first of block 2
    copies = mgr.fork("p", Seq("c", list(range(9))), 8)
    assert copies == [] and mgr.block_table("c") == mgr.block_table("p")[:2]
    mgr.check_integrity(["p", "c"])


def test_fork_without_a_free_block_changes_nothing():
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    admit(mgr, Seq("p", list(range(10))))
    assert mgr.fork("p", Seq("c", list(range(10))), 9) is None
    assert mgr.block_table("c") == [] and mgr.num_free_blocks == 0
    mgr.check_integrity(["p"])


def test_fork_misuse_raises():
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    admit(mgr, Seq("p", list(range(5))))
    with pytest.raises(ValueError, match="holds 2 blocks of 4"):
        mgr.fork("p", Seq("c", list(range(5))), 9)
    with pytest.raises(ValueError, match="'q', which holds 0 blocks"):
        mgr.fork("q", Seq("c", list(range(5))), 1)
    admit(mgr, Seq("c", list(range(5))))
    with pytest.raises(ValueError, match="already holds"):
        mgr.fork("p", Seq("c", list(range(5))), 4)

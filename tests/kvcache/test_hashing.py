"""Chained block hashes: deterministic, chained on the parent, salted at the root only."""

import pytest

from kvcache.hashing import extend_block_hashes, hash_block_tokens


def test_digest_is_deterministic_32_bytes():
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == 32
    assert h == hash_block_tokens(None, (1, 2, 3, 4))


def test_content_parent_and_salt_all_matter():
    root = hash_block_tokens(None, [1, 2])
    assert root != hash_block_tokens(None, [2, 1])
    assert hash_block_tokens(root, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(None, [1, 2], "tenant-a") != root
    assert hash_block_tokens(None, [1, 2], "tenant-a") != hash_block_tokens(None, [1, 2], "b")
    assert hash_block_tokens(None, [1, 2], "") != root  # empty salt is still a salt
    # The salt is only read for a first block: the chain carries it.
    assert hash_block_tokens(root, [3], "x") == hash_block_tokens(root, [3])


def test_encoding_is_unambiguous_for_large_ids():
    assert hash_block_tokens(None, [1, 0]) != hash_block_tokens(None, [256])
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0, 256])


def test_extend_is_incremental_and_matches_full():
    tokens = list(range(20))
    full = extend_block_hashes([], tokens, 4, 5, "s")
    part = extend_block_hashes([], tokens, 4, 2, "s")
    assert extend_block_hashes(part, tokens, 4, 5, "s") is part
    assert part == full
    expect = []
    parent = None
    for i in range(5):
        parent = hash_block_tokens(parent, tokens[4 * i : 4 * i + 4], "s")
        expect.append(parent)
    assert full == expect
    assert extend_block_hashes(full, tokens, 4, 3) == expect  # never shrinks or rehashes


def test_extend_needs_known_tokens():
    with pytest.raises(ValueError, match="only 7 tokens"):
        extend_block_hashes([], list(range(7)), 4, 2)


def test_the_lora_adapter_enters_the_first_block_only():
    root = hash_block_tokens(None, [1, 2])
    with_a = hash_block_tokens(None, [1, 2], adapter="A")
    assert with_a != root and with_a != hash_block_tokens(None, [1, 2], adapter="B")
    assert with_a != hash_block_tokens(None, [1, 2], "A")  # an adapter is not a salt of the same text
    assert hash_block_tokens(None, [1, 2], "s", "A") not in (with_a, hash_block_tokens(None, [1, 2], "s"))
    assert hash_block_tokens(root, [3], adapter="A") == hash_block_tokens(root, [3])
    tokens = list(range(8))
    assert extend_block_hashes([], tokens, 4, 2, adapter="A")[1] != extend_block_hashes([], tokens, 4, 2)[1]

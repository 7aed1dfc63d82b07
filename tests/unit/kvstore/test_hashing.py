"""Chained block hashes: equal prefixes and only equal prefixes hash equal; salts separate chains."""

from __future__ import annotations

import random

import numpy as np

from kvstore.hashing import block_hashes, hash_block

BS = 16


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


def test_only_full_blocks_are_hashed():
    assert block_hashes(list(range(15)), BS) == []
    assert len(block_hashes(list(range(16)), BS)) == 1
    assert len(block_hashes(list(range(47)), BS)) == 2
    assert block_hashes(list(range(47)), BS) == block_hashes(list(range(32)), BS)


def test_block_hashes_is_hash_block_chained_from_the_salt():
    rng = random.Random(0)
    tokens = rand_tokens(rng, 5 * BS + 3)
    for salt in (0, 12345):
        h, expect = salt, []
        for i in range(5):
            h = hash_block(h, tokens[i * BS:(i + 1) * BS])
            expect.append(h)
        assert block_hashes(tokens, BS, salt=salt) == expect
        assert block_hashes(np.array(tokens), BS, salt=salt) == expect


def test_continuing_a_chain_from_a_parent_equals_hashing_the_whole():
    rng = random.Random(1)
    tokens = rand_tokens(rng, 6 * BS)
    whole = block_hashes(tokens, BS)
    assert block_hashes(tokens[2 * BS:], BS, parent=whole[1]) == whole[2:]


def test_equal_prefix_iff_equal_hashes():
    rng = random.Random(2)
    base = rand_tokens(rng, 8 * BS)
    hb = block_hashes(base, BS)
    for _ in range(200):
        pos = rng.randrange(len(base))
        other = list(base)
        other[pos] = (other[pos] + rng.randrange(1, 50_000)) % 50_000
        ho = block_hashes(other, BS)
        first_diff = pos // BS
        assert ho[:first_diff] == hb[:first_diff]
        # the block holding the change and every block after it differ (the chain carries it)
        assert all(a != b for a, b in zip(ho[first_diff:], hb[first_diff:]))


def test_same_block_at_another_position_hashes_differently():
    block = list(range(BS))
    assert block_hashes(block * 2, BS)[0] != block_hashes(block * 2, BS)[1]


def test_a_salt_changes_every_hash():
    rng = random.Random(3)
    tokens = rand_tokens(rng, 4 * BS)
    plain, salted = block_hashes(tokens, BS), block_hashes(tokens, BS, salt=7)
    assert all(a != b for a, b in zip(plain, salted))
    assert block_hashes(tokens, BS, salt=7) == salted


def test_hashes_are_unsigned_64_bit_and_stable():
    hs = block_hashes(list(range(64)), BS)
    assert all(0 <= h < 2 ** 64 for h in hs)
    # pinned: workers and routers of different builds must agree (xxh3-64 over int32 little-endian)
    assert hs == [8773583392624668237, 10421089986442883640, 17402071496389690874, 6095338283470437404]


def test_large_parents_wrap_to_64_bits():
    assert hash_block(2 ** 64 + 5, [1, 2, 3]) == hash_block(5, [1, 2, 3])

"""BlockPool: LRU free queue, reference counts, prefix lookup/touch/register, KV events."""

from __future__ import annotations

import random

import pytest

from kvstore.pools.block_pool import BlockPool, NoFreeBlocks
from kvstore.events import AllCleared, BlockRemoved, BlockStored
from kvstore.hashing import block_hashes


def test_allocates_from_the_head_and_frees_to_the_tail_last_block_first():
    pool = BlockPool(6)
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    assert pool.num_free == 3
    pool.free(a)                      # tail gets 2, 1, 0 (a prefix's tail is evicted first)
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.allocate(1) == [2]    # LRU: the freed prefix's last block goes first
    assert pool.num_free == 2
    pool.check_invariants()


def test_a_reused_run_comes_back_ascending_so_transfers_merge_it():
    pool = BlockPool(8)
    a = pool.allocate(8)
    pool.free(a)                      # queue: 7, 6, ..., 0
    assert pool.allocate(4) == [4, 5, 6, 7]    # the same LRU set, handed out in ascending order


def test_allocate_beyond_the_free_count_takes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_invariants()


def test_shared_blocks_stay_in_use_until_the_last_reference_is_dropped():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    hs = block_hashes(list(range(8)), 4)
    pool.register(blocks, hs, None)
    pool.touch(pool.lookup(hs))        # a second request shares both blocks
    assert pool.ref_counts[blocks[0]] == 2
    pool.free(blocks)
    assert pool.num_free == 2 and all(pool.ref_counts[b] == 1 for b in blocks)
    pool.free(blocks)
    assert pool.num_free == 4
    pool.check_invariants()
    with pytest.raises(AssertionError):
        pool.free(blocks)              # double free is our bug, not the client's


def test_lookup_returns_the_longest_cached_prefix_and_takes_no_reference():
    pool = BlockPool(8)
    tokens = list(range(100, 116))
    hs = block_hashes(tokens, 4)
    blocks = pool.allocate(4)
    pool.register(blocks[:3], hs[:3], None)         # the 4th block is not computed yet
    assert pool.lookup(hs) == blocks[:3]
    other = block_hashes([7] + tokens[1:], 4)       # differs in the first token: nothing matches
    assert pool.lookup(other) == []
    assert all(pool.ref_counts[b] == 1 for b in blocks)
    pool.check_invariants()


def test_free_cached_blocks_are_reused_by_touch_and_leave_the_free_queue():
    pool = BlockPool(4)
    hs = block_hashes(list(range(8)), 4)
    blocks = pool.allocate(2)
    pool.register(blocks, hs, None)
    pool.free(blocks)
    assert pool.num_free == 4 and pool.num_cached() == 2
    hit = pool.lookup(hs)
    assert hit == blocks
    pool.touch(hit)
    assert pool.num_free == 2
    assert sorted(pool.allocate(2)) == sorted(set(range(4)) - set(blocks))   # not the touched ones
    pool.check_invariants()


def test_register_emits_one_stored_event_per_chained_run_with_the_right_parent():
    pool = BlockPool(8)
    hs = block_hashes(list(range(24)), 4)   # 6 blocks
    blocks = pool.allocate(6)
    pool.register(blocks[:2], hs[:2], None)
    pool.register(blocks[2:5], hs[2:5], hs[1])
    assert pool.take_events() == [BlockStored(tuple(hs[:2]), None), BlockStored(tuple(hs[2:5]), hs[1])]
    assert pool.take_events() == []
    # a second copy of an already cached prefix (another request computed it concurrently) is not
    # registered again; the run after it chains from the existing hash
    twin = pool.allocate(2)
    pool.register([twin[0], blocks[5]], [hs[4], hs[5]], hs[3])
    assert pool.take_events() == [BlockStored((hs[5],), hs[4])]
    assert pool.lookup(hs) == blocks
    assert dict(pool.snapshot())[hs[5]] == hs[4]
    assert dict(pool.snapshot())[hs[0]] is None
    pool.check_invariants()


def test_reusing_a_free_cached_block_evicts_its_hash_lru_first():
    pool = BlockPool(4)
    hs = block_hashes(list(range(16)), 4)
    blocks = pool.allocate(4)
    pool.register(blocks, hs, None)
    pool.take_events()
    pool.free(blocks)                         # free queue: 3, 2, 1, 0 (tail of the prefix first)
    assert pool.allocate(1) == [blocks[3]]
    assert pool.take_events() == [BlockRemoved((hs[3],))]
    assert pool.lookup(hs) == blocks[:3]      # the head of the prefix survives
    pool.allocate(2)
    assert pool.take_events() == [BlockRemoved((hs[2], hs[1]))]
    assert pool.lookup(hs) == blocks[:1]
    assert pool.num_cached() == 1
    pool.check_invariants()


def test_a_touched_cached_block_is_not_evicted():
    pool = BlockPool(3)
    hs = block_hashes(list(range(8)), 4)
    blocks = pool.allocate(2)
    pool.register(blocks, hs, None)
    pool.free(blocks)
    pool.touch(pool.lookup(hs[:1]))          # the first block is in use again
    pool.allocate(2)                          # takes the free block and the 2nd cached block
    assert pool.take_events()[-1] == BlockRemoved((hs[1],))
    assert pool.lookup(hs) == blocks[:1]
    pool.check_invariants()


def test_without_caching_nothing_is_looked_up_or_announced():
    pool = BlockPool(4, enable_caching=False)
    hs = block_hashes(list(range(8)), 4)
    blocks = pool.allocate(2)
    pool.register(blocks, hs, None)
    assert pool.lookup(hs) == [] and pool.take_events() == []


def test_reset_cache_forgets_hashes_and_announces_it():
    pool = BlockPool(4)
    hs = block_hashes(list(range(8)), 4)
    blocks = pool.allocate(2)
    pool.register(blocks, hs, None)
    pool.take_events()
    pool.reset_cache()
    assert pool.lookup(hs) == [] and pool.take_events() == [AllCleared()]
    pool.free(blocks)
    pool.check_invariants()


def test_random_operations_keep_invariants_and_events_replay_to_the_cache():
    """Replaying the events gives exactly the set of cached hashes, with the pool's parents."""
    rng = random.Random(7)
    pool = BlockPool(32)
    held: list[list[int]] = []
    known: dict[int, int | None] = {}       # what a consumer of the events believes is cached
    for step in range(2000):
        op = rng.random()
        if op < 0.45 and pool.num_free:
            n = rng.randint(1, min(4, pool.num_free))
            prefix = [rng.randrange(3) for _ in range(rng.randint(0, 2) * 4)]
            tokens = prefix + [rng.randrange(1000) for _ in range(4 * n)]
            hs = block_hashes(tokens, 4)
            hit = pool.lookup(hs)
            pool.touch(hit)
            new = pool.allocate(min(len(hs) - len(hit), pool.num_free))
            blocks = hit + new
            pool.register(new, hs[len(hit):len(blocks)], hs[len(hit) - 1] if hit else None)
            held.append(blocks)
        elif held:
            pool.free(held.pop(rng.randrange(len(held))))
        for e in pool.take_events():
            if isinstance(e, BlockStored):
                parent = e.parent_hash
                for h in e.block_hashes:
                    assert h not in known, "stored twice without a removal"
                    known[h] = parent
                    parent = h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    del known[h]
        pool.check_invariants()
        assert known == dict(pool.snapshot()), step
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free == pool.num_blocks
    pool.check_invariants()

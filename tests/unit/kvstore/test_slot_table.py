"""SlotTable (the LRU, pins and states of the host and disk tiers), disk admission, the host pool."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.pools.admission import FrequencySketch, SecondHitAdmission
from kvstore.block_format import BlockFormat
from kvstore.events import BlockRemoved, BlockStored, Tier
from kvstore.movers.host_pool import PAGE_BYTES, HostPool
from kvstore.pools.slot_table import SlotState, SlotTable

FMT = BlockFormat("tiny", 4, 4096, 16, "torch.float32")


def fill(table: SlotTable, hashes, parent=None) -> list[int]:
    slots = []
    for h in hashes:
        slots.append(table.reserve(h, parent))
        parent = h
    table.commit(slots)
    return slots


def test_free_slots_come_lowest_first_so_a_batch_is_one_run():
    t = SlotTable(8, Tier.HOST)
    assert [t.reserve(h, None) for h in (10, 11, 12)] == [0, 1, 2]
    t.abort([1])
    assert t.reserve(13, None) == 1
    t.check_invariants()


def test_filling_slots_are_invisible_and_ready_ones_found_by_prefix():
    t = SlotTable(4, Tier.HOST)
    s = t.reserve(1, None)
    assert t.lookup([1]) == [] and t.holds(1)
    assert t.reserve(1, None) is None           # on its way already: no duplicate
    t.commit([s])
    s2 = fill(t, [2], parent=1)
    assert t.lookup([1, 2, 3]) == [s, s2[0]]
    assert t.lookup([2, 1]) == [s2[0], s]       # leading run only stops at a miss
    assert t.lookup([3, 1]) == []


def test_full_table_evicts_the_least_recently_used_and_says_so():
    t = SlotTable(3, Tier.DISK)
    slots = fill(t, [1, 2, 3])
    t.take_events()
    t.touch([slots[0]])                          # 1 used again: 2 is now the oldest
    assert t.evictable(2) == [slots[1], slots[2]]
    s = t.reserve(4, None)
    assert s == slots[1] and t.find(2) is None
    assert t.take_events() == [BlockRemoved((2,), Tier.DISK)]
    t.check_invariants()


def test_pinned_and_filling_slots_are_never_evicted():
    t = SlotTable(3, Tier.HOST)
    a, b, c = fill(t, [1, 2, 3])
    t.pin([a, b])
    assert t.reserve(4, None) == c               # the only evictable one
    assert t.reserve(5, None) is None            # a, b pinned; c filling
    t.unpin([a])
    assert t.pins(b) == 1 and t.reserve(5, None) == a
    t.check_invariants()


def test_unpinning_puts_a_block_back_at_the_lru_tail():
    t = SlotTable(3, Tier.HOST)
    a, b, c = fill(t, [1, 2, 3])
    t.pin([a])
    t.pin([a])                                   # two readers
    t.unpin([a])
    assert a not in t.evictable(3)
    t.unpin([a])
    assert t.evictable(3) == [b, c, a]
    with pytest.raises(AssertionError):
        t.unpin([a])


def test_commit_emits_one_stored_event_per_chained_run_with_the_tier():
    t = SlotTable(8, Tier.HOST)
    s = [t.reserve(h, p) for h, p in ((1, None), (2, 1), (3, 2), (7, 5), (8, 7))]
    t.commit(s)
    assert t.take_events() == [BlockStored((1, 2, 3), None, Tier.HOST), BlockStored((7, 8), 5, Tier.HOST)]


def test_drop_frees_a_ready_block_and_restore_brings_blocks_back_in_lru_order():
    t = SlotTable(4, Tier.DISK)
    a, b = fill(t, [1, 2])
    t.take_events()
    t.drop([a])
    assert t.state(a) == SlotState.FREE and t.find(1) is None
    assert t.take_events() == [BlockRemoved((1,), Tier.DISK)]
    t2 = SlotTable(4, Tier.DISK)
    t2.restore([(3, 30, None), (1, 10, 30)])
    assert t2.lookup([30, 10]) == [3, 1] and t2.evictable(4) == [3, 1]
    assert t2.take_events() == [BlockStored((30, 10), None, Tier.DISK)]
    assert t2.reserve(99, None) == 0 and t2.reserve(98, None) == 2   # the free ones, lowest first
    t2.check_invariants()


def test_retired_slots_are_not_handed_out_again():
    t = SlotTable(6, Tier.DISK)
    a, _, c, _ = fill(t, [1, 2, 3, 4])           # slots 0-3
    t.retire_from(2)                              # storage for slots >= 2 could not be created
    assert t.num_usable == 2 and t.num_free == 0
    assert t.find(3) == c                         # ready blocks beyond keep serving ...
    s = t.reserve(5, None)                        # ... until evicted, and are then gone
    assert s == a
    t.check_invariants()


def test_random_operations_keep_the_invariants():
    rng = np.random.default_rng(0)
    t = SlotTable(16, Tier.HOST)
    filling, pinned = [], []
    for step in range(3000):
        op = rng.integers(6)
        if op == 0:
            s = t.reserve(int(rng.integers(40)), None)
            if s is not None:
                filling.append(s)
        elif op == 1 and filling:
            t.commit([filling.pop(int(rng.integers(len(filling))))])
        elif op == 2 and filling:
            t.abort([filling.pop(int(rng.integers(len(filling))))])
        elif op == 3:
            s = t.find(int(rng.integers(40)))
            if s is not None:
                t.pin([s])
                pinned.append(s)
        elif op == 4 and pinned:
            t.unpin([pinned.pop(int(rng.integers(len(pinned))))])
        elif op == 5:
            t.touch(t.lookup([int(rng.integers(40))]))
        if step % 100 == 0:
            t.check_invariants()
    t.check_invariants()


# ---- admission ----------------------------------------------------------------------------------
def test_a_block_is_admitted_to_disk_on_its_second_use_not_its_first():
    adm = SecondHitAdmission(FrequencySketch(1 << 12))
    rng = np.random.default_rng(1)
    once = [int(x) for x in rng.integers(0, 2**63, 500, dtype=np.uint64)]
    twice = [int(x) for x in rng.integers(0, 2**63, 500, dtype=np.uint64)]
    adm.record(once)
    adm.record(twice)
    adm.record(twice)
    assert all(adm.admits(h) for h in twice)
    false_admits = sum(adm.admits(h) for h in once)
    assert false_admits <= 5                      # collisions only overestimate, and rarely


def test_counts_age_so_old_popularity_fades():
    sk = FrequencySketch(1 << 12, reset_every=1000)
    sk.add([42])
    sk.add([42])
    sk.add([42])
    assert sk.estimate(42) == 3
    sk.add(range(10**6, 10**6 + 1000))           # the reset: every count halves
    assert sk.estimate(42) == 1


def test_full_64_bit_hashes_are_counted():
    sk = FrequencySketch(1 << 12)
    sk.add([2**64 - 1, 2**63])
    assert sk.estimate(2**64 - 1) == 1 and list(sk.estimates([2**63, 5])) == [1, 0]


# ---- host pool --------------------------------------------------------------------------------------
def test_host_pool_is_sized_in_bytes_block_major_and_page_aligned():
    pool = HostPool(FMT, 10 * FMT.block_bytes + 100)
    assert pool.num_slots == 10 and pool.data.shape == (10, FMT.block_bytes)
    assert pool.base_addr % PAGE_BYTES == 0 and pool.slot_addr(3) == pool.base_addr + 3 * FMT.block_bytes
    pool.data[3] = 7
    assert pool.tensor()[3].sum().item() == 7 * FMT.block_bytes    # torch sees the same bytes
    assert pool.slots.tier == Tier.HOST
    with pytest.raises(ValueError):
        HostPool(FMT, FMT.block_bytes - 1)

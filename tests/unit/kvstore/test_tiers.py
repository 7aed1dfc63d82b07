"""The tier manager end to end on the CPU: a device pool's blocks go down to host RAM and disk and
come back byte-identical, across evictions, corruption and a restart. The test plays the engine's
part (it executes the BlockCopy operations with a real mover, as the model runner will)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.block_format import BlockFormat
from kvstore.movers.disk_pool import DiskConfig, DiskError
from kvstore.events import BlockRemoved, BlockStored, Tier
from kvstore.hashing import block_hashes
from kvstore.movers.host_copy import CopyDirection, TorchHostCopy, wait
from kvstore.pools.tier_policy import OnboardMode, PathRate, PrefillSpeed, TierPath
from kvstore.tiers import BlockCopy, TierConfig, TierManager

L, NB, BS = 2, 40, 16


class Engine:
    """The G1 side: a KV cache tensor, its mover, and the scheduler calls of tiers.py's lifecycle."""

    def __init__(self, tmp_path, host_blocks=8, disk_blocks=32, mode=OnboardMode.ALWAYS, **cfg):
        self.kv = torch.randn(L, NB, 2, BS, 2, 8, generator=torch.Generator().manual_seed(0))
        self.ref = self.kv.clone()
        self.fmt = BlockFormat.of(self.kv, "tiny")
        self.dir = tmp_path
        disk = DiskConfig(str(tmp_path), disk_blocks * self.fmt.block_bytes, slab_bytes=8 * self.fmt.block_bytes)
        self.tiers = TierManager(self.fmt, TierConfig(host_blocks * self.fmt.block_bytes, disk, mode,
                                                      disk_batch_blocks=4, **cfg))
        self.mover = TorchHostCopy(self.kv, self.tiers.host)

    def run(self, op: BlockCopy) -> float:
        if op.direction == CopyDirection.OFFLOAD:
            h = self.mover.offload(op.g1_blocks, op.g2_slots)
        else:
            h = self.mover.onboard(op.g2_slots, op.g1_blocks)
        wait(self.mover, h)
        return h.seconds

    def offload(self, blocks: list[int], hashes: list[int]) -> list[int]:
        """Write-through of newly computed blocks (lifecycle step 1); returns the host slots."""
        parents = [None] + hashes[:-1]
        pairs = self.tiers.reserve_offload(hashes, parents)
        op = BlockCopy(CopyDirection.OFFLOAD, tuple(blocks[i] for i, _ in pairs), tuple(s for _, s in pairs))
        secs = self.run(op)
        self.tiers.offload_landed(op.g2_slots, True, secs)
        return list(op.g2_slots)

    def onboard(self, hashes: list[int], into: list[int]) -> int:
        """Steps 3-5 for a prompt whose first block is hashes[0]; returns the blocks loaded."""
        d = self.tiers.decide(hashes, 0, PrefillSpeed(1e9))
        ob = self.tiers.start_onboard("r", hashes[:d.num_load], [None] + hashes[:d.num_load - 1])
        self.tiers.drain()
        assert ob.ready
        op = self.tiers.onboard_copy(ob, into[:ob.num_ok])
        self.tiers.onboard_landed(ob, self.run(op))
        self.tiers.finish_onboard(ob)
        return ob.num_ok

    def hot_on_disk(self, n: int, seed: int) -> list[int]:
        """n blocks used twice (worth a disk write), offloaded from G1 blocks 0..n-1 and written
        back to disk; they stay in host RAM too until other blocks push them out."""
        hot = hashes(n, seed)
        for _ in range(2):
            self.tiers.record_use(hot)
        self.offload(list(range(n)), hot)
        self.tiers.poll()
        self.tiers.drain()
        return hot

    def close(self):
        self.mover.close()
        self.tiers.close()


def hashes(n: int, seed: int = 0) -> list[int]:
    return block_hashes(np.arange(seed * 1000, seed * 1000 + n * BS), BS)


@pytest.fixture
def eng(tmp_path):
    e = Engine(tmp_path)
    yield e
    e.close()


def test_offloaded_blocks_are_host_hits_announced_with_their_tier(eng):
    hs = hashes(4)
    eng.offload([0, 1, 2, 3], hs)
    assert eng.tiers.lookup(hs + [123]) == [Tier.HOST] * 4
    assert eng.tiers.take_events() == [BlockStored(tuple(hs), None, Tier.HOST)]
    assert eng.offload([0, 1, 2, 3], hs) == []          # already there: no second copy


def test_a_host_hit_comes_back_byte_identical_into_other_blocks(eng):
    hs = hashes(4)
    eng.offload([0, 1, 2, 3], hs)
    assert eng.onboard(hs, [20, 21, 22, 23]) == 4
    assert torch.equal(eng.kv[:, 20:24], eng.ref[:, 0:4])
    assert eng.tiers.counters.loaded[Tier.HOST] == 4


def test_blocks_used_twice_go_to_disk_before_host_ram_evicts_them_and_come_back(eng):
    hot, cold = hashes(4, seed=1), hashes(4, seed=2)
    eng.tiers.record_use(hot)
    eng.tiers.record_use(hot)                           # the second use: worth a disk write
    eng.tiers.record_use(cold)                          # seen once: not
    eng.offload([0, 1, 2, 3], hot)
    eng.offload([4, 5, 6, 7], cold)                     # host RAM (8 slots) is now full
    eng.tiers.poll()
    eng.tiers.drain()
    ev = eng.tiers.take_events()
    assert BlockStored(tuple(hot), None, Tier.DISK) in ev
    assert not any(e.tier == Tier.DISK and set(e.block_hashes) & set(cold) for e in ev)
    eng.offload(list(range(8, 16)), hashes(8, seed=3))  # pushes everything out of host RAM
    removed = {h for e in eng.tiers.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed == set(hot + cold)
    assert eng.tiers.lookup(hot) == [Tier.DISK] * 4 and eng.tiers.lookup(cold) == []
    assert eng.onboard(hot, [30, 31, 32, 33]) == 4      # G3 -> G2 -> G1
    assert torch.equal(eng.kv[:, 30:34], eng.ref[:, 0:4])
    assert eng.tiers.lookup(hot) == [Tier.HOST] * 4     # promoted on the way up
    assert eng.tiers.counters.loaded[Tier.DISK] == 4
    s = eng.tiers.stats()
    assert s.path_bytes[TierPath.G3_TO_G2] == 4 * eng.fmt.block_bytes and s.blocks[Tier.DISK] == 4


def test_a_corrupted_disk_block_ends_the_usable_prefix_there(eng):
    hot = eng.hot_on_disk(6, seed=4)
    eng.offload(list(range(10, 18)), hashes(8, seed=5))  # out of host RAM
    disk = eng.tiers.disk
    slab, off = disk._where(disk.slots.find(hot[3]))
    with open(disk._slab_path(slab), "r+b") as f:
        f.seek(off + 17)
        f.write(b"\xff\xfe")
    assert eng.onboard(hot, list(range(30, 36))) == 3   # blocks 0-2 load; 3 failed; 4-5 recompute
    assert torch.equal(eng.kv[:, 30:33], eng.ref[:, 0:3])
    assert disk.errors[DiskError.CHECKSUM] == 1 and eng.tiers.stats().errors == {DiskError.CHECKSUM: 1}
    assert eng.tiers.lookup(hot) == [Tier.HOST] * 3     # 3 is gone from disk; 4-5 sit in host RAM unused
    assert BlockRemoved((hot[3],), Tier.DISK) in eng.tiers.take_events()


def test_a_restarted_worker_serves_its_disk_blocks(tmp_path):
    e = Engine(tmp_path)
    hot = e.hot_on_disk(5, seed=6)
    e.close()
    e2 = Engine(tmp_path)                               # same directory, new process state
    assert e2.tiers.lookup(hot) == [Tier.DISK] * 5
    assert BlockStored(tuple(hot), None, Tier.DISK) in e2.tiers.take_events()
    assert e2.onboard(hot, [20, 21, 22, 23, 24]) == 5
    assert torch.equal(e2.kv[:, 20:25], e2.ref[:, 0:5])
    e2.close()


def test_auto_loads_host_hits_and_recomputes_disk_hits_a_fast_prefill_beats(tmp_path):
    e = Engine(tmp_path, mode=OnboardMode.AUTO)
    e.tiers.set_rate(TierPath.G2_TO_G1, PathRate(50e9))
    e.tiers.set_rate(TierPath.G3_TO_G2, PathRate(1e9))
    hot = e.hot_on_disk(6, seed=7)
    e.offload(list(range(10, 16)), hashes(6, seed=8))   # 2 free slots, then 4 of hot leave host RAM
    tiers = e.tiers.lookup(hot)
    assert len(tiers) == 6 and tiers.count(Tier.DISK) == 4 and tiers.count(Tier.HOST) == 2
    # 8 KiB blocks: 8 us from disk; recomputing 16 tokens at 1M tok/s: 16 us -> load all
    d = e.tiers.decide(hot, 0, PrefillSpeed(1e6))
    assert (d.num_load, d.num_disk, d.num_host) == (6, 4, 2)
    # at 100M tok/s recomputing beats even a host copy: recompute everything, counted
    d = e.tiers.decide(hot, 0, PrefillSpeed(1e8))
    assert d.num_load == 0 and e.tiers.counters.recomputed == {Tier.HOST: 2, Tier.DISK: 4}
    e.close()


def test_a_disk_load_slower_end_to_end_than_its_bandwidth_teaches_auto_to_recompute(tmp_path):
    e = Engine(tmp_path, mode=OnboardMode.AUTO)
    e.tiers.set_rate(TierPath.G2_TO_G1, PathRate(50e9))
    e.tiers.set_rate(TierPath.G3_TO_G2, PathRate(1e9))
    hot = e.hot_on_disk(6, seed=10)
    e.offload(list(range(10, 18)), hashes(8, seed=11))  # hot leaves host RAM: on disk only
    assert e.tiers.lookup(hot) == [Tier.DISK] * 6
    fast = PrefillSpeed(1e6)                            # 16 us a block to recompute, 8 us to read
    assert e.tiers.decide(hot, 0, fast).num_load == 6
    ob = e.tiers.start_onboard("r", hot, [None] + hot[:-1])
    e.tiers.drain()
    ob.started_s -= 0.05                                # the load took 50 ms end to end
    op = e.tiers.onboard_copy(ob, [30, 31, 32, 33, 34, 35])
    e.tiers.onboard_landed(ob, e.run(op))
    e.tiers.finish_onboard(ob)
    assert torch.equal(e.kv[:, 30:36], e.ref[:, 0:6])
    lat = e.tiers.stats().load_latency_s
    assert lat[Tier.DISK] >= 0.3 * 0.05 and lat[Tier.HOST] == 0.0     # an EWMA step towards >= 50 ms
    e.offload(list(range(10, 18)), hashes(8, seed=12))  # on disk only again
    assert e.tiers.lookup(hot) == [Tier.DISK] * 6
    assert e.tiers.decide(hot, 0, fast).num_load == 0   # bandwidth still says load; the latency says no
    e.close()


def test_the_disk_probe_measures_both_directions_and_leaves_nothing_behind(eng):
    rates = eng.tiers.probe_disk(probe_bytes=16 * eng.fmt.block_bytes)
    assert rates is not None and all(r.bytes_per_s > 0 for r in rates)
    assert eng.tiers.meters[TierPath.G3_TO_G2].rate == rates[1]
    assert eng.tiers.take_events() == []
    assert eng.tiers.host.slots.num_free == eng.tiers.host.num_slots
    assert eng.tiers.disk.slots.num_free == eng.tiers.disk.num_slots and eng.tiers.disk.index.rows() == []


def test_write_back_stays_within_its_inflight_bound(tmp_path):
    e = Engine(tmp_path, host_blocks=16, max_disk_inflight_blocks=4, clean_fraction=1.0)
    hot = hashes(12, seed=9)
    for _ in range(2):
        e.tiers.record_use(hot)
    e.offload(list(range(12)), hot)
    e.tiers.poll()
    assert e.tiers._inflight_writes <= 4
    for _ in range(10):
        e.tiers.drain()
    assert e.tiers.lookup(hot) == [Tier.HOST] * 12
    assert sorted(e.tiers.disk.slots.snapshot()) == sorted(hot)   # all of them, 4 at a time
    e.close()

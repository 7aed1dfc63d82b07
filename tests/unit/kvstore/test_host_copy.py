"""Bytes between the device pool and the host tier (host_copy.py: torch and NIXL UCX loopback) and
between the host tier and files (file_io.py: NIXL POSIX and os), on the CPU with real NIXL."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvstore.block_format import BlockFormat
from kvstore.movers.file_io import FileIoError, NixlFileIo, OsFileIo, merge_extents
from kvstore.movers.host_copy import (
    CopyDirection,
    NixlHostCopy,
    TorchHostCopy,
    _pairs,
    choose,
    slot_runs,
    wait,
)
from kvstore.movers.host_pool import HostPool
from kvstore.movers.transfer import nixl_available

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")

L, NB = 3, 21


def cache(dtype=torch.float32) -> torch.Tensor:
    """The engine's layout, every (layer, block) chunk distinct."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(L, NB, 2, 16, 2, 8, generator=g).to(dtype)


def movers(kv, host):
    yield TorchHostCopy(kv, host)
    yield TorchHostCopy(kv, host, max_staging_blocks=2, staged=True)   # the CUDA path's indexing
    if nixl_available():
        yield NixlHostCopy(kv, host)


def host_block(host: HostPool, slot: int, kv: torch.Tensor) -> torch.Tensor:
    """A host slot viewed as (layers, chunk) in the cache's dtype."""
    return torch.from_numpy(host.data[slot].copy()).view(kv.dtype).view(L, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_offload_writes_each_block_block_major_into_its_host_slot(dtype):
    kv = cache(dtype)
    host = HostPool(BlockFormat.of(kv, "m"), 12 * BlockFormat.of(kv, "m").block_bytes)
    blocks, slots = [4, 9, 10, 0, 20], [7, 8, 9, 2, 11]          # runs of slots: 7-9, 2, 11
    for m in movers(kv, host):
        host.data[:] = 0
        h = m.offload(blocks, slots)
        wait(m, h)
        assert h.direction == CopyDirection.OFFLOAD and h.num_bytes == 5 * host.fmt.block_bytes
        for b, s in zip(blocks, slots):
            assert torch.equal(host_block(host, s, kv).view(torch.uint8),
                               kv[:, b].reshape(L, -1).view(torch.uint8)), (m.name, b, s)
        assert not host.data[[0, 1, 3, 4, 5, 6, 10]].any(), m.name           # nothing else touched
        m.close()


def test_onboard_puts_host_blocks_back_into_any_device_blocks():
    kv = cache()
    ref = kv.clone()
    fmt = BlockFormat.of(kv, "m")
    host = HostPool(fmt, 8 * fmt.block_bytes)
    for m in movers(kv, host):
        wait(m, m.offload([1, 2, 3, 5], [4, 5, 6, 0]))
        kv[:, [11, 12, 17, 13]] = 0
        h = m.onboard([4, 5, 6, 0], [11, 12, 17, 13])
        wait(m, h)
        assert torch.equal(kv[:, [11, 12, 17, 13]], ref[:, [1, 2, 3, 5]]), m.name
        others = [b for b in range(NB) if b not in (11, 12, 17, 13)]
        assert torch.equal(kv[:, others], ref[:, others]), m.name
        kv.copy_(ref)
        m.close()


def test_an_empty_copy_is_done_at_once():
    kv = cache()
    host = HostPool(BlockFormat.of(kv, "m"), 2 * BlockFormat.of(kv, "m").block_bytes)
    for m in movers(kv, host):
        assert m.done(m.offload([], [])) and m.done(m.onboard([], []))
        m.close()


def test_slot_runs_split_where_slots_stop_being_consecutive():
    assert slot_runs(np.array([7, 8, 9, 2, 11, 12])) == [(0, 7, 3), (3, 2, 1), (4, 11, 2)]
    assert slot_runs(np.array([], dtype=np.int64)) == []


# ---- files --------------------------------------------------------------------------------------
def test_merge_extents_joins_runs_contiguous_in_memory_and_in_one_file():
    assert merge_extents([0, 10, 20, 40], [3, 3, 3, 3], [100, 110, 120, 130], 10) == \
        [(0, 3, 100, 30), (40, 3, 130, 10)]
    assert merge_extents([0, 10], [3, 4], [100, 110], 10) == [(0, 3, 100, 10), (10, 4, 110, 10)]
    assert merge_extents([0, 10, 20], [3, 3, 3], [0, 10, 20], 10, max_bytes=20) == \
        [(0, 3, 0, 20), (20, 3, 20, 10)]


def file_ios(addr: int, nbytes: int):
    yield OsFileIo()
    if nixl_available():
        yield NixlFileIo(addr, nbytes)
        yield NixlFileIo(addr, nbytes, {"use_uring": "true"})


def test_blocks_round_trip_through_files_scattered_across_two_slabs(tmp_path):
    fmt = BlockFormat("m", 2, 4096, 16, "torch.float32")
    host = HostPool(fmt, 8 * fmt.block_bytes)
    fds = []
    for i in range(2):
        fd = os.open(tmp_path / f"s{i}", os.O_RDWR | os.O_CREAT, 0o644)
        os.posix_fallocate(fd, 0, 4 * fmt.block_bytes)
        fds.append(fd)
    slots = [0, 1, 2, 6]                                   # -> slab 0 slots 1, 2, 3 and slab 1 slot 0
    where = [(fds[0], fmt.block_bytes), (fds[0], 2 * fmt.block_bytes), (fds[0], 3 * fmt.block_bytes), (fds[1], 0)]
    for io in file_ios(host.base_addr, host.capacity_bytes):
        for fd in fds:
            io.add_file(fd, 4 * fmt.block_bytes)
        host.data[:] = np.random.default_rng(1).integers(0, 256, host.data.shape, dtype=np.uint8)
        ref = host.data[slots].copy()
        io.write([host.slot_addr(s) for s in slots], [w[0] for w in where], [w[1] for w in where], fmt.block_bytes)
        host.data[:] = 0
        io.read([host.slot_addr(s) for s in (3, 4, 5, 7)], [w[0] for w in where], [w[1] for w in where],
                fmt.block_bytes)
        assert np.array_equal(host.data[[3, 4, 5, 7]], ref), io.name
        os.ftruncate(fds[1], 100)                          # the second slab loses its block
        with pytest.raises(FileIoError):
            io.read([host.slot_addr(0)], [fds[1]], [0], fmt.block_bytes)
        os.posix_fallocate(fds[1], 0, 4 * fmt.block_bytes)
        for fd in fds:
            io.remove_file(fd)
        io.close()
    for fd in fds:
        os.close(fd)


@needs_nixl
def test_nixl_host_copy_needs_no_remote_agent_for_a_loopback_copy():
    """An agent cannot add itself as a remote agent (NIXL_ERR_INVALID_PARAM, docs/kv_tiers.md); it need not: a list
    prepared under its own name is a loopback target."""
    kv = cache()
    host = HostPool(BlockFormat.of(kv, "m"), 4 * BlockFormat.of(kv, "m").block_bytes)
    m = NixlHostCopy(kv, host)
    wait(m, m.offload([3], [1]))
    assert torch.equal(host_block(host, 1, kv), kv[:, 3].reshape(L, -1))
    m.close()


def test_choose_probes_every_mover_keeps_one_and_leaves_the_blocks_as_they_were():
    kv = cache()
    ref = kv.clone()
    host = HostPool(BlockFormat.of(kv, "m"), 8 * BlockFormat.of(kv, "m").block_bytes)
    mover, seen = choose(kv, host, [2, 9, 15, 16], [0, 1, 2, 3])
    assert set(seen) == ({"torch", "nixl"} if nixl_available() else {"torch"})
    assert all(off > 0 and on > 0 for off, on in seen.values())
    assert mover.name in seen and torch.equal(kv, ref)
    mover.close()


def test_a_prefix_held_in_reverse_slot_order_moves_as_one_host_copy_with_exact_bytes():
    """G1 frees a request's blocks tail first, so a prefix reaches G2 in descending slots: taken in
    slot order, the whole prefix is one host range (one copy), not one copy per block."""
    kv = cache(torch.bfloat16)
    ref = kv.clone()
    host = HostPool(BlockFormat.of(kv, "m"), 12 * BlockFormat.of(kv, "m").block_bytes)
    blocks, slots = [3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5, 4]
    b, s = _pairs(blocks, slots)
    assert len(slot_runs(s)) == 1 and sorted(zip(b, s)) == sorted(zip(blocks, slots))
    for m in movers(kv, host):
        wait(m, m.offload(blocks, slots))
        kv[:, 12:18] = 0
        wait(m, m.onboard(slots, list(range(12, 18))))
        assert torch.equal(kv[:, 12:18].view(torch.uint8), ref[:, 3:9].view(torch.uint8)), m.name
        kv.copy_(ref)

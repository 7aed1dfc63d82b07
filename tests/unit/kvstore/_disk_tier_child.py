"""Child process for the disk-tier tests (tests/unit/kvstore/test_disk_pool.py): a writer that gets
killed, a writer that crashes at a chosen point, a reader after a restart, a run on a tiny
filesystem. Prints one JSON line of results where the mode has any.

    python tests/unit/kvstore/_disk_tier_child.py MODE DIR [ARG]
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from kvstore.block_format import BlockFormat
from kvstore.movers.disk_index import DiskIndex, DiskTierError
from kvstore.movers.disk_pool import DiskConfig, DiskPool, ReadItem, WriteItem
from kvstore.movers.host_pool import HostPool

FMT = BlockFormat("tiny-test", 4, 4096, 16, "torch.float32")     # 16 KiB blocks


def content(h: int) -> np.ndarray:
    return np.random.default_rng(h % 2**32).integers(0, 256, FMT.block_bytes, dtype=np.uint8)


def open_pool(d: str, num_slots: int, slab_slots: int = 4, host_slots: int = 8):
    host = HostPool(FMT, host_slots * FMT.block_bytes)
    disk = DiskPool(FMT, DiskConfig(d, num_slots * FMT.block_bytes, slab_bytes=slab_slots * FMT.block_bytes), host)
    return host, disk


def write_blocks(host: HostPool, disk: DiskPool, hashes: list[int]) -> list:
    """Reserve disk slots (evicting LRU blocks), write the blocks' content, commit what was indexed."""
    items = []
    for i, h in enumerate(hashes):
        slot = disk.slots.reserve(h, None)
        if slot is None:
            continue
        host.data[i] = content(h)
        items.append(WriteItem(slot, h, None, i))
    res = disk.write(items)
    disk.slots.commit([it.slot for it, r in zip(items, res) if r is None])
    disk.slots.abort([it.slot for it, r in zip(items, res) if r is not None])
    if disk.full_from_slot is not None:
        disk.slots.retire_from(disk.full_from_slot)
    return res


def read_blocks(host: HostPool, disk: DiskPool, hashes: list[int]) -> dict[int, str]:
    """hash -> "ok" (checksum passed and the bytes are the block's), "absent", or the error."""
    out = {}
    for h in hashes:
        slot = disk.slots.find(h)
        if slot is None:
            out[h] = "absent"
            continue
        hslot = host.slots.reserve(h, None)
        disk.slots.pin([slot])
        (r,) = disk.read([ReadItem(slot, h, hslot)])
        disk.slots.unpin([slot])
        if r is None:
            out[h] = "ok" if np.array_equal(host.data[hslot], content(h)) else "WRONG BYTES"
        else:
            disk.slots.drop([slot])
            out[h] = r.value
        host.slots.abort([hslot])
    return out


def filler(d: str, leave_bytes: int, name: str = "filler") -> None:
    """Take the filesystem's free space down to ``leave_bytes``."""
    st = os.statvfs(d)
    with open(os.path.join(d, name), "wb") as f:
        try:
            f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave_bytes))
        except OSError:
            pass


def main() -> None:
    mode, d = sys.argv[1], sys.argv[2]
    if mode == "loop":                      # write forever; the parent kills us
        start = int(sys.argv[3])
        host, disk = open_pool(d, 16)
        h = start
        while True:
            write_blocks(host, disk, [h, h + 1, h + 2])
            h += 3
            if h == start + 3:
                print("ready", flush=True)
    elif mode == "crash_before_index":      # data written and synced, the index commit never runs
        host, disk = open_pool(d, 4)
        write_blocks(host, disk, [1, 2, 3, 4])
        DiskIndex.add = lambda self, entries: os._exit(9)
        write_blocks(host, disk, [5, 6, 7, 8])          # reuses the 4 slots
    elif mode == "torn_write":              # half a batch's bytes, then the process dies
        host, disk = open_pool(d, 4)
        write_blocks(host, disk, [1, 2, 3, 4])
        real = disk.file_io.write

        def torn(addrs, fds, offsets, nbytes, **kw):
            real(addrs[:2], fds[:2], offsets[:2], nbytes)
            os._exit(9)
        disk.file_io.write = torn
        write_blocks(host, disk, [5, 6, 7, 8])
    elif mode == "reopen":                  # a restart in a new process
        host, disk = open_pool(d, int(sys.argv[3]))
        print(json.dumps(read_blocks(host, disk, [int(x) for x in sys.argv[4].split(",")])))
    elif mode == "full":                    # run inside a small filesystem (the parent mounts it)
        host, disk = open_pool(d, 48, slab_slots=16)     # 3 slabs of 256 KiB asked
        results = []
        for batch in range(8):              # 32 blocks: slab 0 fills, slab 1 fails, LRU reuse
            if batch == 1:
                filler(d, 160 << 10)        # someone else fills the disk: no room for a 2nd slab
            res = write_blocks(host, disk, [100 + 4 * batch + i for i in range(4)])
            results.append([None if r is None else r.value for r in res])
        filler(d, 0, name="filler2")        # now not even the index can grow
        last = write_blocks(host, disk, [200, 201, 202, 203])
        os.unlink(os.path.join(d, "filler2"))     # room again: the index works on (no stuck transaction)
        again = write_blocks(host, disk, [300, 301, 302, 303])
        print(json.dumps({"results": results, "last": [None if r is None else r.value for r in last],
                          "again": [None if r is None else r.value for r in again],
                          "full": disk.full, "usable": disk.slots.num_usable,
                          "errors": {k.value: v for k, v in disk.errors.items()},
                          "read": read_blocks(host, disk, list(range(100, 132)) + [200] + list(range(300, 304)))}))
    elif mode == "open":                    # start-up only: report the error, if any
        try:
            open_pool(d, int(sys.argv[3]))
            print(json.dumps({"error": None}))
        except DiskTierError as e:
            print(json.dumps({"error": str(e)}))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()

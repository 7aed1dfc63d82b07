"""The host-RAM tier (G2): a pinned buffer of block slots and the table of what they hold.

Sized in bytes (``--kv-host-gib``): ``num_slots = capacity_bytes // block_bytes``. Slots are
block-major (kvstore/block_format.py): slot s is ``block_bytes`` contiguous bytes at
``s * block_bytes``, all layers of one block, so a block is one descriptor on the host side of
every copy, the device side gathering its per-layer chunks. Bookkeeping (LRU of reusable blocks
keyed by chained hash, pins for blocks being copied out, FILLING for blocks being copied in) is a
SlotTable with tier HOST, so its events say "host".

The buffer is page-aligned (the disk tier may read and write it with O_DIRECT) and, with
``pin_memory=True``, page-locked through torch's CUDA host allocator so that device copies run
asynchronously at full PCIe speed (pinning 100 GiB takes seconds: done once, at start-up). Without
torch or a GPU it is an anonymous mmap. ``data`` is a numpy view either way; ``tensor()`` the
torch view that copies use. Nothing here moves bytes: host_copy.py (G1<->G2) and file_io.py
(G2<->G3) do.
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

import numpy as np

from kvstore.block_format import BlockFormat
from kvstore.events import Tier
from kvstore.pools.slot_table import SlotTable

if TYPE_CHECKING:
    import torch

PAGE_BYTES = mmap.PAGESIZE


class HostPool:
    def __init__(self, fmt: BlockFormat, capacity_bytes: int, pin_memory: bool = False,
                 emit_events: bool = True) -> None:
        num_slots = capacity_bytes // fmt.block_bytes
        if num_slots < 1:
            raise ValueError(f"host tier of {capacity_bytes} bytes holds no block of {fmt.block_bytes} bytes")
        self.fmt = fmt
        self.num_slots = num_slots
        self.slots = SlotTable(num_slots, Tier.HOST, emit_events)
        self._tensor, self._mmap, flat = _allocate(num_slots * fmt.block_bytes, pin_memory)
        self.data = flat.reshape(num_slots, fmt.block_bytes)   # (num_slots, block_bytes) uint8
        self.pinned = pin_memory

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.fmt.block_bytes

    @property
    def base_addr(self) -> int:
        return self.data.ctypes.data

    def slot_addr(self, slot: int) -> int:
        return self.base_addr + slot * self.fmt.block_bytes

    def tensor(self) -> torch.Tensor:
        """(num_slots, block_bytes) uint8 torch view of the buffer (the pinned tensor itself when
        pinned, so that torch recognises it for asynchronous copies)."""
        import torch
        if self._tensor is None:
            self._tensor = torch.from_numpy(self.data.reshape(-1))
        return self._tensor.view(self.num_slots, self.fmt.block_bytes)

    def close(self) -> None:
        """Drop the buffer (views handed out must be gone)."""
        self.data = None   # type: ignore[assignment]
        self._tensor = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass   # a view is still alive; the mapping goes with it
            self._mmap = None


def _allocate(nbytes: int, pin_memory: bool):
    """(torch tensor or None, mmap or None, flat uint8 numpy view), page-aligned."""
    if pin_memory:
        import torch
        # torch's pinned allocator rounds small requests up inside its own blocks, which need not
        # start on a page (seen on torch 2.11 for buffers of a few MiB): one page more, sliced to one
        t = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8, pin_memory=True)
        skip = -t.data_ptr() % PAGE_BYTES
        t = t[skip:skip + nbytes]
        flat = t.numpy()
        assert flat.ctypes.data % PAGE_BYTES == 0, "pinned host buffer is not page-aligned"
        return t, None, flat
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return None, m, np.frombuffer(m, dtype=np.uint8)

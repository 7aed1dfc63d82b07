"""Which block sits in which slot of a lower tier (host RAM, G2; disk, G3), and which may be reused.

Plain Python, no torch, no I/O: the host pool and the disk pool each own one table over their
slots and the bytes behind them. A slot is in one of three states:

- FREE: holds nothing. Free slots are handed out lowest id first, so a batch reserved together
  gets an ascending run of slots, which copies and file writes merge into one descriptor/extent.
- FILLING: reserved for a block whose bytes are on their way in (a copy from the device, a read
  from disk). Invisible to lookups and never evicted: the copy would land in someone else's block.
- READY: holds a block under its chained hash; lookups find it.

A READY slot with a pin count of zero sits in the LRU (least recently used first). Reserving a
slot when none is free evicts the LRU head: its hash is forgotten and a BlockRemoved event says so.
A pin protects a READY slot that is being copied *out* (to the device, or to disk) from reuse until
the copy lands; pinned slots leave the LRU and rejoin it when the last pin goes: at the tail after
a use, at the head after a copy that only saved it elsewhere (write-back to disk).

Events carry the table's tier (BlockStored when a filled slot is committed, BlockRemoved when a
block is evicted or dropped), buffered until `take_events()`. BlockStored groups committed blocks
into runs chained by their parents, as BlockPool does, so the events keep their chain-order meaning.

Threading: one thread owns a table (the engine's step loop); transfer completions reach it as
plain results that the owner applies (commit / abort / unpin / drop).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from enum import IntEnum

from kvstore.events import BlockRemoved, BlockStored, KvEvent, Tier


class SlotState(IntEnum):
    FREE = 0
    FILLING = 1
    READY = 2


class SlotTable:
    def __init__(self, num_slots: int, tier: Tier, emit_events: bool = True) -> None:
        assert num_slots > 0
        self.num_slots = num_slots
        self.tier = tier
        self.emit_events = emit_events
        self._usable = num_slots                   # slots >= this are retired (disk full)
        self._free: list[int] = list(range(num_slots))    # a heap: lowest id first
        self._state = [SlotState.FREE] * num_slots
        self._pins = [0] * num_slots
        self._hash: list[int] = [0] * num_slots
        self._parent: list[int | None] = [None] * num_slots
        self._slot_of: dict[int, int] = {}          # hash -> slot (FILLING or READY)
        self._lru: OrderedDict[int, None] = OrderedDict()  # READY and unpinned, oldest first
        self._num_ready = 0
        self._events: list[KvEvent] = []
        self.version = 0      # bumped by every change of state or LRU order: lets a scan skip an unchanged table

    # ---- lookups ---------------------------------------------------------------------------
    def find(self, h: int) -> int | None:
        """The READY slot holding hash ``h``, or None."""
        slot = self._slot_of.get(h)
        return slot if slot is not None and self._state[slot] == SlotState.READY else None

    def lookup(self, hashes: Iterable[int]) -> list[int]:
        """READY slots of the longest leading run of ``hashes`` held here (no pins taken)."""
        out = []
        for h in hashes:
            slot = self.find(h)
            if slot is None:
                break
            out.append(slot)
        return out

    def holds(self, h: int) -> bool:
        """Whether ``h`` is here or on its way in (so offering it again would duplicate it)."""
        return h in self._slot_of

    def hash_of(self, slot: int) -> int:
        assert self._state[slot] != SlotState.FREE, f"slot {slot} is free"
        return self._hash[slot]

    def parent_of(self, slot: int) -> int | None:
        return self._parent[slot]

    def state(self, slot: int) -> SlotState:
        return self._state[slot]

    def pins(self, slot: int) -> int:
        return self._pins[slot]

    # ---- filling -----------------------------------------------------------------------------
    def reserve(self, h: int, parent: int | None) -> int | None:
        """A FILLING slot for block ``h``: a free one, else the LRU head evicted. None when ``h``
        is already here or on its way, or when every usable slot is filling or pinned."""
        if h in self._slot_of:
            return None
        self.version += 1
        slot = self._take_free()
        if slot is None:
            if not self._lru:
                return None
            slot, _ = self._lru.popitem(last=False)
            self._emit_removed([self._forget(slot)])
        self._state[slot] = SlotState.FILLING
        self._hash[slot] = h
        self._parent[slot] = parent
        self._slot_of[h] = slot
        return slot

    def commit(self, slots: Sequence[int]) -> None:
        """FILLING -> READY at the LRU tail (most recent), in the given order."""
        self.version += 1
        run: list[int] = []
        run_parent: int | None = None
        for slot in slots:
            assert self._state[slot] == SlotState.FILLING, f"slot {slot} is not filling"
            self._state[slot] = SlotState.READY
            self._num_ready += 1
            self._lru[slot] = None
            h, parent = self._hash[slot], self._parent[slot]
            if run and parent != run[-1]:
                self._emit_stored(run, run_parent)
                run = []
            if not run:
                run_parent = parent
            run.append(h)
        self._emit_stored(run, run_parent)

    def abort(self, slots: Iterable[int]) -> None:
        """FILLING -> FREE: the copy in failed or was abandoned; nobody ever saw the block."""
        self.version += 1
        for slot in slots:
            assert self._state[slot] == SlotState.FILLING, f"slot {slot} is not filling"
            del self._slot_of[self._hash[slot]]
            self._release(slot)

    def restore(self, entries: Sequence[tuple[int, int, int | None]]) -> None:
        """Mark (slot, hash, parent) READY without a fill, oldest first (a disk index reopened)."""
        taken = set()
        for slot, h, parent in entries:
            assert self._state[slot] == SlotState.FREE and h not in self._slot_of, (slot, h)
            self._state[slot] = SlotState.FILLING
            self._hash[slot], self._parent[slot] = h, parent
            self._slot_of[h] = slot
            taken.add(slot)
        self._free = [s for s in self._free if s not in taken]
        heapq.heapify(self._free)
        self.commit([slot for slot, _, _ in entries])

    # ---- use ----------------------------------------------------------------------------------
    def pin(self, slots: Iterable[int]) -> None:
        """Protect READY slots from reuse while they are copied out."""
        self.version += 1
        for slot in slots:
            assert self._state[slot] == SlotState.READY, f"slot {slot} is not ready"
            if self._pins[slot] == 0:
                del self._lru[slot]
            self._pins[slot] += 1

    def unpin(self, slots: Sequence[int], oldest: bool = False) -> None:
        """Drop a pin; a slot whose last pin goes rejoins the LRU at its tail (just used), or with
        ``oldest`` at its head, in the given order (a block copied out only to be kept elsewhere,
        e.g. written to disk, goes back where it was: first in line for eviction)."""
        self.version += 1
        for slot in (reversed(slots) if oldest else slots):
            assert self._pins[slot] > 0, f"slot {slot} is not pinned"
            self._pins[slot] -= 1
            if self._pins[slot] == 0:
                self._lru[slot] = None
                if oldest:
                    self._lru.move_to_end(slot, last=False)

    def touch(self, slots: Iterable[int]) -> None:
        """A hit: unpinned READY slots move to the LRU tail (used last-first, so a prefix's head
        ends most recent and its tail is evicted first)."""
        self.version += 1
        for slot in reversed(list(slots)):
            if slot in self._lru:
                self._lru.move_to_end(slot)

    def drop(self, slots: Iterable[int]) -> None:
        """READY, unpinned -> FREE, announcing the removal (a damaged block, a failed write)."""
        self.version += 1
        removed = []
        for slot in slots:
            assert self._state[slot] == SlotState.READY and self._pins[slot] == 0, f"slot {slot}"
            del self._lru[slot]
            removed.append(self._forget(slot))
            self._release(slot)
        self._emit_removed(removed)

    def evictable(self, n: int) -> list[int]:
        """The ``n`` slots the next reservations would evict, oldest first (no state change)."""
        out = []
        for slot in self._lru:
            if len(out) == n:
                break
            out.append(slot)
        return out

    def retire_from(self, num_usable: int) -> None:
        """Stop handing out slots >= ``num_usable`` (their storage could not be created). Free ones
        go at once; filling or ready ones keep their block and are not reused once released."""
        self.version += 1
        self._usable = min(self._usable, num_usable)
        self._free = [s for s in self._free if s < self._usable]
        heapq.heapify(self._free)

    # ---- counts / events ----------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self._usable

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_ready(self) -> int:
        return self._num_ready

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def snapshot(self) -> list[int]:
        """Hashes of every READY block, least recently used first among the unpinned."""
        return [self._hash[s] for s in range(self.num_slots) if self._state[s] == SlotState.READY]

    def check_invariants(self) -> None:
        """For tests: states, pins, LRU, free heap and hash map agree."""
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is free twice"
        for s in range(self.num_slots):
            st = self._state[s]
            assert (s in free) == (st == SlotState.FREE and s < self._usable), f"slot {s}: {st}"
            assert self._pins[s] == 0 or st == SlotState.READY, f"slot {s} pinned while {st}"
            assert (s in self._lru) == (st == SlotState.READY and self._pins[s] == 0), f"slot {s} LRU"
            if st != SlotState.FREE:
                assert self._slot_of[self._hash[s]] == s
        assert len(self._slot_of) == sum(st != SlotState.FREE for st in self._state)
        assert self._num_ready == sum(st == SlotState.READY for st in self._state)

    # ---- internals ------------------------------------------------------------------------------
    def _take_free(self) -> int | None:
        return heapq.heappop(self._free) if self._free else None

    def _forget(self, slot: int) -> int:
        """A READY slot loses its block (evicted for reuse, or dropped); returns its hash."""
        h = self._hash[slot]
        del self._slot_of[h]
        self._num_ready -= 1
        self._state[slot] = SlotState.FREE
        return h

    def _release(self, slot: int) -> None:
        self._state[slot] = SlotState.FREE
        self._parent[slot] = None
        if slot < self._usable:
            heapq.heappush(self._free, slot)

    def _emit_removed(self, hashes: list[int]) -> None:
        """One BlockRemoved per uninterrupted series of removals (evictions come one by one)."""
        if not hashes or not self.emit_events:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            self._events[-1] = BlockRemoved(last.block_hashes + tuple(hashes), self.tier)
        else:
            self._events.append(BlockRemoved(tuple(hashes), self.tier))

    def _emit_stored(self, run: list[int], parent: int | None) -> None:
        if run and self.emit_events:
            self._events.append(BlockStored(tuple(run), parent, self.tier))

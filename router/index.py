"""The prefix index: which workers hold which chained block hashes, on which tier.

It consumes workers' numbered KV event batches (kvstore.events), keeps them in order per worker
(duplicates dropped, early batches buffered until the gap fills), and says when a gap has lasted
too long and the worker must be resynced from a snapshot. It answers one question fast: for a
prompt's block hashes, how many LEADING blocks does each worker hold?

Representation: per tier, ``hash -> bitmask of worker slots``; per worker, the set of hashes it
holds per tier (needed to forget a worker, clear a tier or replace its state from a snapshot).
A lookup walks the prompt once and ANDs the masks, so it stops at the first block no worker
holds. Because the hashes are chained (kvstore.hashing), equal hashes mean equal prefixes, so the
index needs no tree and ignores ``BlockStored.parent_hash``.

It does not know about roles, load, Redis or time beyond the injected clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from kvstore.events import AllCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, Tier

# A snapshot: for each tier, every block hash the worker holds there.
SnapshotEntries = Iterable[tuple[Tier, Iterable[int]]]

_TIERS = tuple(Tier)


@dataclass(slots=True, frozen=True)
class ApplyResult:
    """What one ``apply`` did. ``needs_resync`` is true while the worker waits for a snapshot."""
    worker_id: str
    applied_batches: int = 0      # this batch plus buffered ones it unblocked
    duplicate: bool = False
    buffered: bool = False
    needs_resync: bool = False


@dataclass(slots=True)
class _Worker:
    slot: int
    bit: int
    applied_seq: int = 0
    needs_resync: bool = False
    pending: dict[int, tuple[float, KvEventBatch]] = field(default_factory=dict)  # seq -> (arrival, batch)
    blocks: dict[Tier, set[int]] = field(default_factory=lambda: {t: set() for t in _TIERS})


class PrefixIndex:
    """Per-worker, per-tier block sets fed by ordered event batches; prefix-overlap lookups."""

    def __init__(self, gap_max_buffered: int = 64, gap_timeout_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_resync_needed: Callable[[str], None] | None = None) -> None:
        self._gap_max_buffered = gap_max_buffered
        self._gap_timeout_s = gap_timeout_s
        self._clock = clock
        self._on_resync_needed = on_resync_needed
        self._holders: dict[Tier, dict[int, int]] = {t: {} for t in _TIERS}
        self._workers: dict[str, _Worker] = {}
        self._slot_owner: list[str | None] = []
        self._free_slots: list[int] = []

    # ---- lookups -------------------------------------------------------------------------

    def overlaps(self, block_hashes: Sequence[int],
                 tiers: Sequence[Tier] = (Tier.GPU,)) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` each worker holds on any of ``tiers``.

        Workers holding no leading block are absent from the result. A hole (a block the worker
        lacks) ends that worker's run even if it holds later blocks.
        """
        if len(tiers) == 1:
            get = self._holders[tiers[0]].get
        else:
            gets = [self._holders[t].get for t in tiers]
            get = lambda h, d: _or_all(gets, h)  # noqa: E731
        out: dict[str, int] = {}
        mask = -1
        i = 0
        for h in block_hashes:
            m = get(h, 0) & mask
            if m != mask:
                if i:
                    self._record(out, mask & ~m, i)
                if not m:
                    return out
                mask = m
            i += 1
        if i:
            self._record(out, mask, i)
        return out

    def _record(self, out: dict[str, int], bits: int, run: int) -> None:
        owner = self._slot_owner
        while bits:
            low = bits & -bits
            out[owner[low.bit_length() - 1]] = run  # type: ignore[index]
            bits ^= low

    def worker_blocks(self, worker_id: str, tier: Tier = Tier.GPU) -> frozenset[int]:
        w = self._workers.get(worker_id)
        return frozenset(w.blocks[tier]) if w else frozenset()

    def workers(self) -> list[str]:
        return list(self._workers)

    def applied_seq(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return w.applied_seq if w else 0

    def num_hashes(self, tier: Tier = Tier.GPU) -> int:
        """Distinct block hashes held by at least one worker on ``tier``."""
        return len(self._holders[tier])

    def num_entries(self) -> int:
        """(worker, tier, block) entries in the index."""
        return sum(len(s) for w in self._workers.values() for s in w.blocks.values())

    # ---- event batches ---------------------------------------------------------------------

    def apply(self, batch: KvEventBatch) -> ApplyResult:
        """Apply a batch in sequence order; buffer it if early, drop it if already applied."""
        w = self._worker(batch.worker_id)
        if batch.seq <= w.applied_seq:
            return ApplyResult(batch.worker_id, duplicate=True, needs_resync=w.needs_resync)
        if w.needs_resync or batch.seq != w.applied_seq + 1:
            w.pending.setdefault(batch.seq, (self._clock(), batch))
            if w.needs_resync:
                self._cap_pending(w)
            else:
                self._check_gap(batch.worker_id, w, self._clock())
            return ApplyResult(batch.worker_id, buffered=True, needs_resync=w.needs_resync)
        self._apply_events(w, batch.events)
        w.applied_seq = batch.seq
        n = 1 + self._drain(w)
        return ApplyResult(batch.worker_id, applied_batches=n)

    def check_gaps(self) -> list[str]:
        """Mark workers whose gap has outlived the timeout; returns the newly marked ones.

        Call it periodically: a gap followed by silence produces no batch to trigger the check.
        """
        now = self._clock()
        return [wid for wid, w in self._workers.items()
                if w.pending and not w.needs_resync and self._check_gap(wid, w, now)]

    def workers_needing_resync(self) -> list[str]:
        return [wid for wid, w in self._workers.items() if w.needs_resync]

    def mark_needs_resync(self, worker_id: str) -> None:
        w = self._worker(worker_id)
        if not w.needs_resync:
            w.needs_resync = True
            if self._on_resync_needed:
                self._on_resync_needed(worker_id)

    def apply_snapshot(self, worker_id: str, last_seq: int, entries: SnapshotEntries) -> None:
        """Replace the worker's state with a snapshot taken after batch ``last_seq``.

        Buffered batches newer than ``last_seq`` are replayed if contiguous; a gap left after the
        snapshot starts a fresh gap timer.
        """
        w = self._worker(worker_id)
        for tier in _TIERS:
            self._clear(w, tier)
        for tier, hashes in entries:
            self._store(w, Tier(tier), hashes)
        w.applied_seq = last_seq
        w.needs_resync = False
        now = self._clock()
        w.pending = {s: (now, b) for s, (_, b) in sorted(w.pending.items()) if s > last_seq}
        self._drain(w)
        if w.pending:
            self._check_gap(worker_id, w, now)

    def remove_worker(self, worker_id: str) -> None:
        """Forget everything about a worker (its lease expired)."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return
        for tier in _TIERS:
            self._clear(w, tier)
        self._slot_owner[w.slot] = None
        self._free_slots.append(w.slot)

    # ---- direct edits (approximate mode, tests) ---------------------------------------------

    def store(self, worker_id: str, block_hashes: Iterable[int], tier: Tier = Tier.GPU) -> None:
        self._store(self._worker(worker_id), tier, block_hashes)

    def remove(self, worker_id: str, block_hashes: Iterable[int], tier: Tier = Tier.GPU) -> None:
        w = self._workers.get(worker_id)
        if w is not None:
            self._remove(w, tier, block_hashes)

    # ---- internals -------------------------------------------------------------------------

    def _worker(self, worker_id: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._slot_owner[slot] = worker_id
            else:
                slot = len(self._slot_owner)
                self._slot_owner.append(worker_id)
            w = self._workers[worker_id] = _Worker(slot=slot, bit=1 << slot)
        return w

    def _drain(self, w: _Worker) -> int:
        n = 0
        while (nxt := w.pending.pop(w.applied_seq + 1, None)) is not None:
            self._apply_events(w, nxt[1].events)
            w.applied_seq += 1
            n += 1
        return n

    def _check_gap(self, worker_id: str, w: _Worker, now: float) -> bool:
        oldest = min(t for t, _ in w.pending.values())
        if len(w.pending) > self._gap_max_buffered or now - oldest > self._gap_timeout_s:
            self.mark_needs_resync(worker_id)
            self._cap_pending(w)
            return True
        return False

    def _cap_pending(self, w: _Worker) -> None:
        # While a snapshot is awaited keep only the newest batches: the snapshot will be taken
        # after the request, so it covers every batch older than the ones we keep.
        limit = 4 * self._gap_max_buffered
        if len(w.pending) > limit:
            for s in sorted(w.pending)[: len(w.pending) - limit]:
                del w.pending[s]

    def _apply_events(self, w: _Worker, events: list[KvEvent]) -> None:
        for ev in events:
            kind = type(ev)
            if kind is BlockStored:
                self._store(w, ev.tier, ev.block_hashes)
            elif kind is BlockRemoved:
                self._remove(w, ev.tier, ev.block_hashes)
            elif kind is AllCleared:
                self._clear(w, ev.tier)
            else:
                raise TypeError(f"not a KV event: {ev!r}")

    def _store(self, w: _Worker, tier: Tier, hashes: Iterable[int]) -> None:
        held = w.blocks[tier]
        holders = self._holders[tier]
        get = holders.get
        bit = w.bit
        for h in hashes:
            if h not in held:
                held.add(h)
                holders[h] = get(h, 0) | bit

    def _remove(self, w: _Worker, tier: Tier, hashes: Iterable[int]) -> None:
        held = w.blocks[tier]
        holders = self._holders[tier]
        keep = ~w.bit
        for h in hashes:
            if h in held:
                held.discard(h)
                m = holders[h] & keep
                if m:
                    holders[h] = m
                else:
                    del holders[h]

    def _clear(self, w: _Worker, tier: Tier) -> None:
        held = w.blocks[tier]
        holders = self._holders[tier]
        keep = ~w.bit
        for h in held:
            m = holders[h] & keep
            if m:
                holders[h] = m
            else:
                del holders[h]
        held.clear()


def _or_all(gets: list, h: int) -> int:
    m = 0
    for g in gets:
        m |= g(h, 0)
    return m

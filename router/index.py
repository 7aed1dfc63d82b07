"""The prefix index: which workers hold which chained block hashes, on which tier.

It consumes workers' numbered KV event batches (kvstore.events), keeps them in order per worker
(duplicates dropped, early batches buffered until the gap fills), and says when a gap has lasted
too long and the worker must be resynced from a snapshot. It answers one question fast: for a
prompt's block hashes, how many LEADING blocks does each worker hold?

Each worker gets a slot, i.e. a bit in the masks of router/chains.py, which keeps per block the
workers holding the whole chain up to it and answers a lookup in a few dozen dict reads however
long the prompt (see there). Hashes must be chained (kvstore.hashing): a hash names its prefix,
and ``BlockStored.parent_hash`` ties a run to the block before it.

It does not know about roles, load, Redis or time beyond the injected clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from kvstore.events import AllCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, Tier
from router.chains import ChainIndex, Holdings

# A snapshot: for each tier, every block the worker holds there, as (hash, parent hash or None)
# pairs (or bare hashes, whose parents the index may have learned from events).
SnapshotEntries = Iterable[tuple[Tier, Iterable[int | tuple[int, int | None]]]]

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
    held: Holdings
    applied_seq: int = 0
    needs_resync: bool = False
    pending: dict[int, tuple[float, KvEventBatch]] = field(default_factory=dict)  # seq -> (arrival, batch)


class PrefixIndex:
    """Per-worker, per-tier block sets fed by ordered event batches; prefix-overlap lookups."""

    def __init__(self, gap_max_buffered: int = 64, gap_timeout_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_resync_needed: Callable[[str], None] | None = None) -> None:
        self._gap_max_buffered = gap_max_buffered
        self._gap_timeout_s = gap_timeout_s
        self._clock = clock
        self._on_resync_needed = on_resync_needed
        self._chains = ChainIndex()
        self._workers: dict[str, _Worker] = {}
        self._slot_owner: list[str | None] = []
        self._free_slots: list[int] = []
        self.slots_version = 0      # bumped whenever a slot changes hands (router/pool.py caches)

    # ---- lookups -------------------------------------------------------------------------

    def overlaps(self, block_hashes: Sequence[int],
                 tiers: Sequence[Tier] = (Tier.GPU,)) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` each worker holds on any of ``tiers``.

        Workers holding no leading block are absent from the result. A hole (a block the worker
        lacks) ends that worker's run even if it holds later blocks.
        """
        out: dict[str, int] = {}
        owner = self._slot_owner
        for bits, run in self.runs(block_hashes, tiers):
            while bits:
                low = bits & -bits
                out[owner[low.bit_length() - 1]] = run  # type: ignore[index]
                bits ^= low
        return out

    def runs(self, block_hashes: Sequence[int],
             tiers: Sequence[Tier] = (Tier.GPU,)) -> list[tuple[int, int]]:
        """``overlaps`` before it is spelled out per worker: (slot bitmask, leading blocks) pairs,
        disjoint. Slot ``s`` is bit ``1 << s``; ``slot`` names a worker's."""
        if len(tiers) == 1:
            return self._chains.runs(block_hashes, tiers[0])
        return self._chains.runs_any_tier(block_hashes, tiers,
                                          {w.held.bit: w.held for w in self._workers.values()})

    def slot(self, worker_id: str) -> int | None:
        """The worker's slot (its bit in ``runs``), None if the index has not seen it."""
        w = self._workers.get(worker_id)
        return w.slot if w else None

    def worker_blocks(self, worker_id: str, tier: Tier = Tier.GPU) -> frozenset[int]:
        w = self._workers.get(worker_id)
        return frozenset(w.held.blocks[tier]) if w else frozenset()

    def workers(self) -> list[str]:
        return list(self._workers)

    def applied_seq(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return w.applied_seq if w else 0

    def num_hashes(self, tier: Tier | None = None) -> int:
        """Distinct block hashes held by at least one worker (on ``tier``, if given: that count
        walks every worker's set)."""
        if tier is None:
            return self._chains.num_hashes()
        return len(set().union(*(w.held.blocks[tier] for w in self._workers.values())))

    def holds_outside(self, tiers: Sequence[Tier]) -> bool:
        """Whether any worker holds a block on a tier not in ``tiers`` (a look at workers x tiers
        sets, no walk): while none does, weighing the other tiers changes no overlap."""
        others = [t for t in _TIERS if t not in tiers]
        return any(w.held.blocks[t] for w in self._workers.values() for t in others)

    def num_entries(self) -> int:
        """(worker, tier, block) entries in the index."""
        return sum(len(s) for w in self._workers.values() for s in w.held.blocks.values())

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
        by_tier: dict[Tier, list] = {}
        for tier, hashes in entries:
            by_tier.setdefault(Tier(tier), []).extend(hashes)
        for tier in _TIERS:
            self._chains.replace(w.held, tier, by_tier.get(tier, ()))
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
            self._chains.clear(w.held, tier)
        self._slot_owner[w.slot] = None
        self._free_slots.append(w.slot)
        self.slots_version += 1

    # ---- direct edits (approximate mode, tests) ---------------------------------------------

    def store(self, worker_id: str, block_hashes: Iterable[int], tier: Tier = Tier.GPU,
              parent: int | None = None) -> None:
        """The worker holds this chain (continuing from ``parent``; None: from the root)."""
        self._chains.store(self._worker(worker_id).held, tier, block_hashes, parent)

    def remove(self, worker_id: str, block_hashes: Iterable[int], tier: Tier = Tier.GPU) -> None:
        w = self._workers.get(worker_id)
        if w is not None:
            self._chains.remove(w.held, tier, block_hashes)

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
            w = self._workers[worker_id] = _Worker(slot, Holdings(1 << slot))
            self.slots_version += 1
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
        chains, held = self._chains, w.held
        for ev in events:
            kind = type(ev)
            if kind is BlockStored:
                chains.store(held, ev.tier, ev.block_hashes, ev.parent_hash)
            elif kind is BlockRemoved:
                chains.remove(held, ev.tier, ev.block_hashes)
            elif kind is AllCleared:
                chains.clear(held, ev.tier)
            else:
                raise TypeError(f"not a KV event: {ev!r}")

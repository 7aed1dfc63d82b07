"""The tier manager: host RAM (G2) and disk (G3) below the engine's device pool (G1), as one object
the scheduler talks to.

It owns the host pool, the disk pool, the disk tier's I/O thread, disk admission and the
load-or-recompute cost model, and it turns requests into plain data: slot reservations, BlockCopy
operations for the step plan, and completions. It never touches the device and never blocks: every
call returns at once; disk work runs on the I/O thread and comes back through ``poll()``.

The lifecycle of a block (numbers match the phase-2 wiring below):

 1. Offload G1 -> G2, ahead of eviction (docs/kv_tiers.md says why): when cached G1 blocks near
    the head of G1's free queue (the next to be reused), or any cached block once the engine is
    idle, are not in G2, the scheduler calls ``reserve_offload(hashes, parents)``; blocks not yet
    in G2 get a FILLING host slot. The scheduler keeps those G1 blocks referenced, puts a
    ``BlockCopy(OFFLOAD, g1_blocks, g2_slots)`` in the step plan, and when the model runner
    reports it landed calls ``offload_landed`` (the slots become READY: BlockStored HOST).
 2. G2 -> G3, written back ahead of eviction: each ``poll()`` looks at the LRU tail of G2 (the
    blocks the next reservations will evict); those the admission rule accepts (seen at least
    twice: kvstore/pools/admission.py) and that are not on disk yet are pinned in G2 and written to
    disk in batches on the I/O thread (BlockStored DISK when indexed). Eviction from G2 never
    waits for the disk; a block evicted before its turn is simply not on disk. At most
    ``max_disk_inflight_blocks`` are in flight; a full disk pauses it quietly (for
    ``disk_full_retry_s``, then on in the slabs that exist).
 3. A prompt arrives: the scheduler looks up G1 first (BlockPool.lookup), then calls
    ``record_use`` once for the prompt's hashes (admission counts) and ``decide`` for the rest:
    which of the following blocks are in G2 or G3 (``lookup``) and how many of them to load
    (tier_policy.py; ``--kv-onboard auto|always``; both choices counted).
 4. ``start_onboard(request_id, hashes)`` pins the G2 hits and starts disk reads of the G3 hits
    into FILLING host slots. The request waits in the scheduler like one awaiting a remote
    prefill. ``poll()`` finishes reads; a block that fails its checksum is dropped from disk and
    ends the usable prefix there (``Onboarding.num_ok``): the rest is recomputed.
 5. When ``Onboarding.ready``: the scheduler allocates G1 blocks for its ``num_ok`` blocks, puts
    ``onboard_copy(ob, g1_blocks)`` in the step plan, registers those G1 blocks under their
    hashes when the copy lands, then calls ``finish_onboard`` (host slots unpinned).

Events (``take_events``) are the host and disk tables' BlockStored/BlockRemoved with their tier;
the worker publishes them beside BlockPool's (tier GPU).

Phase-2 wiring (not done here): the scheduler (steps 1, 3-5; onboarding waits like
``awaiting_kv``), the model runner (executes BlockCopy with the mover ``host_copy.choose`` picks
at start-up, torch or NIXL, whose probe figures go to ``set_rate``), prefill workers (the same
object: their prompts hit the tiers too), the flags (``--kv-host-gib --kv-disk-gib --kv-disk-dir
--kv-onboard`` -> ``TierConfig``), metrics (``stats()``: hits per tier, occupancy, bytes and seconds per path,
errors by reason), the router's ``lower_tier_weight``, and the mock engine's tier model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.pools.admission import FrequencySketch, SecondHitAdmission
from kvstore.block_format import BlockFormat
from kvstore.movers.disk_pool import DiskConfig, DiskError, DiskPool, ReadItem, WriteItem
from kvstore.movers.disk_worker import DiskJob, DiskJobKind, DiskWorker
from kvstore.events import KvEvent, Tier
from kvstore.movers.host_copy import CopyDirection
from kvstore.movers.host_pool import HostPool
from kvstore.pools.tier_policy import (LatencyMeter, OnboardCounters, OnboardDecision, OnboardMode, PathRate,
                                 PrefillSpeed, RateMeter, TierPath, TierRates, decide_onboard)

log = logging.getLogger(__name__)

# Until a probe says otherwise: the H100 machine's measured figures (docs/kv_tiers.md).
DEFAULT_RATES = {TierPath.G1_TO_G2: PathRate(55e9, 20e-6), TierPath.G2_TO_G1: PathRate(55e9, 20e-6),
                 TierPath.G2_TO_G3: PathRate(1.3e9, 200e-6), TierPath.G3_TO_G2: PathRate(1.3e9, 200e-6)}


@dataclass(frozen=True, slots=True)
class TierConfig:
    host_bytes: int                          # --kv-host-gib
    disk: DiskConfig | None = None           # --kv-disk-dir, --kv-disk-gib; None: no disk tier
    onboard: OnboardMode = OnboardMode.AUTO  # --kv-onboard
    pin_memory: bool = False                 # page-lock the host tier (with a GPU)
    disk_min_count: int = 2                  # sightings before a block is worth a disk write
    max_disk_inflight_blocks: int = 64       # disk writes queued or running
    disk_batch_blocks: int = 32              # blocks per disk write
    clean_fraction: float = 0.25             # G2's LRU tail kept written to disk ahead of eviction
    disk_full_retry_s: float = 60.0          # after a write finds the disk full, pause writes this long
    disk_block_s: float = 0.0                # mock engine: modelled disk seconds per block (disk_worker.py)


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """A copy between device blocks and host slots, for the step plan (the model runner runs it)."""
    direction: CopyDirection
    g1_blocks: tuple[int, ...]
    g2_slots: tuple[int, ...]


@dataclass(slots=True)
class Onboarding:
    """A request's lower-tier hit on its way into host slots (then into device blocks)."""
    request_id: str
    hashes: list[int]
    parents: list[int | None]
    host_slots: list[int]
    num_ok: int                      # leading blocks usable (shrinks when a disk read fails)
    num_pending: int = 0             # disk reads not back yet
    num_disk: int = 0                # of the blocks, those read from disk
    started_s: float = 0.0
    _pinned: list[bool] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.num_pending == 0


@dataclass(slots=True)
class TierStats:
    """What the worker exports as metrics (the exporter names them; tiers are "host" / "disk")."""
    blocks: dict[Tier, int]                  # blocks held (occupancy)
    capacity_blocks: dict[Tier, int]
    loaded_blocks: dict[Tier, int]           # lower-tier hits loaded (splitserve_kv_hits_total{tier})
    recomputed_blocks: dict[Tier, int]       # lower-tier hits recomputed instead
    path_bytes: dict[TierPath, int]          # bytes moved per path ...
    path_seconds: dict[TierPath, float]      # ... and the seconds they took
    path_rate_bytes_per_s: dict[TierPath, float]   # the cost model's current rates
    load_latency_s: dict[Tier, float]        # ... and its fixed cost of one load per tier
    errors: dict[DiskError, int]             # splitserve_kv_tier_errors_total{reason}
    disk_full: bool


class TierManager:
    def __init__(self, fmt: BlockFormat, cfg: TierConfig, emit_events: bool = True) -> None:
        self.fmt = fmt
        self.cfg = cfg
        self.host = HostPool(fmt, cfg.host_bytes, cfg.pin_memory, emit_events)
        self.disk: DiskPool | None = None
        self.meters = {p: RateMeter(r) for p, r in DEFAULT_RATES.items()}
        self.load_latency = {Tier.HOST: LatencyMeter(0.0), Tier.DISK: LatencyMeter(0.0)}
        self._seed_latencies()
        self.counters = OnboardCounters()
        self._inflight_writes = 0
        self._disk_paused_until = 0.0    # write-back pauses after a full disk
        self._scanned: tuple[int, int, int] | None = None   # what the last fruitless write-back scan saw
        self._worker: DiskWorker | None = None
        if cfg.disk is not None:
            try:
                self.disk = DiskPool(fmt, cfg.disk, self.host, emit_events)
            except BaseException:
                self.host.close()
                raise
            self.admission = SecondHitAdmission(FrequencySketch.for_capacity(self.disk.num_slots), cfg.disk_min_count)
            self._worker = DiskWorker(self.disk, cfg.disk_block_s)

    # ---- lookups and decisions (step loop) --------------------------------------------------
    def lookup(self, hashes: Sequence[int]) -> list[Tier]:
        """For the leading run of ``hashes`` held below G1: each block's fastest tier."""
        out = []
        for h in hashes:
            if self.host.slots.find(h) is not None:
                out.append(Tier.HOST)
            elif self.disk is not None and self.disk.slots.find(h) is not None:
                out.append(Tier.DISK)
            else:
                break
        return out

    def record_use(self, hashes: Sequence[int]) -> None:
        """A request uses these blocks (once per request): what disk admission counts."""
        if self.disk is not None:
            self.admission.record(hashes)

    def decide(self, hashes: Sequence[int], first_block: int, prefill: PrefillSpeed) -> OnboardDecision:
        """How many leading blocks of ``hashes`` (the prompt's blocks after its G1 hit, the first
        being block ``first_block``) to load rather than recompute. Counted for the metrics: call
        it once per request admitted, not per scheduling attempt."""
        hit = self.lookup(hashes)
        d = decide_onboard(hit, first_block, self.fmt.block_bytes, self.fmt.block_size, self.rates(),
                           prefill, self.cfg.onboard)
        self.counters.count(hit, d)
        return d

    def rates(self) -> TierRates:
        return TierRates(self.meters[TierPath.G2_TO_G1].rate,
                         self.meters[TierPath.G3_TO_G2].rate if self.disk is not None else None,
                         self.load_latency[Tier.HOST].seconds, self.load_latency[Tier.DISK].seconds)

    def _seed_latencies(self) -> None:
        """The per-load latencies until loads are measured: the probed paths' one-transfer latencies."""
        g2g1, g3g2 = self.meters[TierPath.G2_TO_G1].rate, self.meters[TierPath.G3_TO_G2].rate
        self.load_latency[Tier.HOST].seed(g2g1.latency_s)
        self.load_latency[Tier.DISK].seed(g2g1.latency_s + g3g2.latency_s)

    # ---- offload G1 -> G2 ------------------------------------------------------------------------
    def reserve_offload(self, hashes: Sequence[int], parents: Sequence[int | None]) -> list[tuple[int, int]]:
        """(position in ``hashes``, host slot) for each block to copy down; blocks already in G2
        (or on their way) are skipped, and so are blocks that find no evictable slot."""
        out = []
        for i, (h, p) in enumerate(zip(hashes, parents)):
            slot = self.host.slots.reserve(h, p)
            if slot is not None:
                out.append((i, slot))
        return out

    def offload_landed(self, g2_slots: Sequence[int], ok: bool = True, seconds: float = 0.0) -> None:
        """The step plan's OFFLOAD copy into these slots completed (or failed)."""
        if ok:
            self.host.slots.commit(g2_slots)
            self.meters[TierPath.G1_TO_G2].observe(len(g2_slots) * self.fmt.block_bytes, seconds)
        else:
            self.host.slots.abort(g2_slots)

    # ---- onboard G3/G2 -> G1 -----------------------------------------------------------------------
    def start_onboard(self, request_id: str, hashes: Sequence[int],
                      parents: Sequence[int | None]) -> Onboarding:
        """Pin the host hits and read the disk hits into host slots. The usable prefix ends early
        where a block has left both tiers since ``decide`` or no host slot can take a disk block."""
        ob = Onboarding(request_id, list(hashes), list(parents), [], len(hashes), started_s=time.perf_counter())
        reads, read_slots = [], []
        for i, (h, p) in enumerate(zip(hashes, parents)):
            slot = self.host.slots.find(h)
            if slot is not None:
                self.host.slots.pin([slot])
                self.host.slots.touch([slot])
                ob.host_slots.append(slot)
                ob._pinned.append(True)
                continue
            dslot = self.disk.slots.find(h) if self.disk is not None else None
            hslot = self.host.slots.reserve(h, p) if dslot is not None else None
            if hslot is None:
                ob.num_ok = i
                break
            self.disk.slots.pin([dslot])
            reads.append(ReadItem(dslot, h, hslot))
            ob.num_disk += 1
            read_slots.append(hslot)
            ob.host_slots.append(hslot)
            ob._pinned.append(False)
        ob.hashes, ob.parents = ob.hashes[:ob.num_ok], ob.parents[:ob.num_ok]
        if reads:
            ob.num_pending = len(reads)
            self._worker.submit(DiskJob(DiskJobKind.READ, reads, read_slots, owner=ob))
        return ob

    def onboard_copy(self, ob: Onboarding, g1_blocks: Sequence[int]) -> BlockCopy:
        """The step plan's copy of the onboarding's ``num_ok`` blocks into ``g1_blocks``."""
        assert ob.ready and len(g1_blocks) == ob.num_ok
        return BlockCopy(CopyDirection.ONBOARD, tuple(g1_blocks), tuple(ob.host_slots[:ob.num_ok]))

    def onboard_landed(self, ob: Onboarding, seconds: float) -> None:
        """The copy into G1 landed, ``seconds`` after it started: refines the G2 -> G1 rate, and the
        load's wall time since ``start_onboard`` refines its tier's fixed latency (the part of the
        time that the bandwidths do not explain)."""
        self.meters[TierPath.G2_TO_G1].observe(ob.num_ok * self.fmt.block_bytes, seconds)
        rates = self.rates()
        num_disk = min(ob.num_disk, ob.num_ok)
        bandwidth_s = sum(rates.block_load_s(t, self.fmt.block_bytes) * n
                          for t, n in ((Tier.HOST, ob.num_ok - num_disk), (Tier.DISK, num_disk)) if n)
        self.load_latency[Tier.DISK if num_disk else Tier.HOST].observe(time.perf_counter() - ob.started_s,
                                                                         bandwidth_s)

    def finish_onboard(self, ob: Onboarding) -> None:
        """The copy into G1 landed (or the request went away): the host slots may be reused."""
        assert ob.ready, "an onboarding finishes after its disk reads"
        self.host.slots.unpin([s for s, pinned in zip(ob.host_slots, ob._pinned) if pinned])
        ob._pinned = [False] * len(ob._pinned)

    # ---- the step loop's poll -----------------------------------------------------------------------
    def poll(self) -> None:
        """Apply finished disk work and queue more write-back. Never blocks; call once per step."""
        if self._worker is None:
            return
        for job in self._worker.take_done():
            if job.kind == DiskJobKind.WRITE:
                self._write_done(job)
            else:
                self._read_done(job)
        self._write_back()

    def _write_back(self) -> None:
        """Queue disk writes of admitted blocks at G2's LRU tail (step 2 of the module docstring).

        Runs every step, so it must cost next to nothing when there is nothing to write: the scan
        is skipped while the host table, the admission counts and the disk table are as the last
        fruitless scan left them, and a scan checks admission for the whole window in one numpy
        pass. (A per-slot scan of a 1,536-slot window, every step of a decode whose blocks the rule
        rejects, took 22.7 ms per step on the CPU machine: the H100's 2x decode ITL.)"""
        disk = self.disk
        room = self.cfg.max_disk_inflight_blocks - self._inflight_writes
        if time.monotonic() < self._disk_paused_until or \
                room < min(self.cfg.disk_batch_blocks, self.cfg.max_disk_inflight_blocks):
            return
        seen = (self.host.slots.version, self.admission.sketch.version, disk.slots.version)
        if seen == self._scanned:
            return
        window = max(self.cfg.disk_batch_blocks, int(self.cfg.clean_fraction * self.host.num_slots))
        slots = self.host.slots.evictable(window)
        hashes = [self.host.slots.hash_of(s) for s in slots]
        admitted = self.admission.admitted(hashes) if hashes else []
        items, host_slots = [], []
        for hslot, h, ok in zip(slots, hashes, admitted):
            if not ok or disk.slots.holds(h):
                continue
            dslot = disk.slots.reserve(h, self.host.slots.parent_of(hslot))
            if dslot is None:
                break
            items.append(WriteItem(dslot, h, self.host.slots.parent_of(hslot), hslot))
            host_slots.append(hslot)
            if len(items) == room:
                break
        self._scanned = None if items else seen
        if items:
            self.host.slots.pin(host_slots)
            self._inflight_writes += len(items)
            for i in range(0, len(items), self.cfg.disk_batch_blocks):
                chunk = slice(i, i + self.cfg.disk_batch_blocks)
                self._worker.submit(DiskJob(DiskJobKind.WRITE, items[chunk], host_slots[chunk]))

    def _write_done(self, job: DiskJob) -> None:
        self._inflight_writes -= len(job.items)
        self.host.slots.unpin(job.host_slots, oldest=True)    # saved on disk: first to go from RAM
        ok = [it.slot for it, r in zip(job.items, job.result) if r is None]
        self.disk.slots.commit(ok)
        self.disk.slots.abort([it.slot for it, r in zip(job.items, job.result) if r is not None])
        if self.disk.full_from_slot is not None:
            self.disk.slots.retire_from(self.disk.full_from_slot)
        if DiskError.DISK_FULL in job.result:
            self._disk_paused_until = time.monotonic() + self.cfg.disk_full_retry_s
        if ok:
            self.meters[TierPath.G2_TO_G3].observe(len(ok) * self.fmt.block_bytes, job.seconds)

    def _read_done(self, job: DiskJob) -> None:
        ob: Onboarding = job.owner
        position = {h: i for i, h in enumerate(ob.hashes)}
        good: set[int] = set()
        for it, r in zip(job.items, job.result):
            self.disk.slots.unpin([it.slot])
            if r is None:
                self.disk.slots.touch([it.slot])
                self.host.slots.commit([it.host_slot])       # promoted: a host hit from now on
                good.add(position[it.block_hash])
            else:
                self.disk.slots.drop([it.slot])               # damaged or gone: never served
                self.host.slots.abort([it.host_slot])
                ob.num_ok = min(ob.num_ok, position[it.block_hash])
        for i in good:
            if i < ob.num_ok:
                self.host.slots.pin([ob.host_slots[i]])
                ob._pinned[i] = True
        ob.num_pending = 0
        if good:
            self.meters[TierPath.G3_TO_G2].observe(len(good) * self.fmt.block_bytes, job.seconds)

    # ---- probes (start-up) ---------------------------------------------------------------------------
    def probe_disk(self, probe_bytes: int = 64 << 20, timeout_s: float = 60.0) -> tuple[PathRate, PathRate] | None:
        """Measure G2 -> G3 and G3 -> G2 (synced write, uncached read) of scratch slots: bandwidth
        from ``probe_bytes``, latency from one block. Blocks until done: call at start-up. Returns
        the rates set, or None without a disk tier, room, or success."""
        if self.disk is None:
            return None
        n = max(1, min(probe_bytes // self.fmt.block_bytes, self.host.slots.num_free, self.disk.slots.num_free))
        # scratch slots under hashes no block has (chained hashes are unsigned): never indexed, aborted after
        hslots = [s for s in (self.host.slots.reserve(-1 - i, None) for i in range(n)) if s is not None]
        dslots = [s for s in (self.disk.slots.reserve(-1 - i, None) for i in range(len(hslots))) if s is not None]
        hslots, extra = hslots[:len(dslots)], hslots[len(dslots):]
        self.host.slots.abort(extra)
        if not dslots:
            return None
        self.host.data[hslots] = np.random.default_rng(0).integers(0, 256, (len(hslots), self.fmt.block_bytes),
                                                                  dtype=np.uint8)
        timings = []
        for k in (len(dslots), 1):
            job = DiskJob(DiskJobKind.PROBE, dslots[:k], hslots[:k])
            if not self._worker.run(job, timeout_s):
                log.warning("disk tier probe timed out after %.0f s; its scratch slots stay reserved", timeout_s)
                return None
            if isinstance(job.result, BaseException):
                log.warning("disk tier probe failed: %r", job.result)
                break
            timings.append(job.result)
        self.host.slots.abort(hslots)
        self.disk.slots.abort(dslots)
        if len(timings) < 2:
            return None
        nbytes, one = len(dslots) * self.fmt.block_bytes, self.fmt.block_bytes
        rates = tuple(PathRate(nbytes / t, max(0.0, t1 - one * t / nbytes))
                      for t, t1 in zip(timings[0], timings[1]))
        self.meters[TierPath.G2_TO_G3].rate, self.meters[TierPath.G3_TO_G2].rate = rates
        self._seed_latencies()
        log.info("disk tier probe: %d MiB, write %.2f GB/s (+%.2f ms), read %.2f GB/s (+%.2f ms)", nbytes >> 20,
                 rates[0].bytes_per_s / 1e9, rates[0].latency_s * 1e3, rates[1].bytes_per_s / 1e9,
                 rates[1].latency_s * 1e3)
        return rates

    def set_rate(self, path: TierPath, rate: PathRate) -> None:
        """A probe's figure (the runner probes G1 <-> G2 with host_copy.probe)."""
        self.meters[path].rate = rate
        self._seed_latencies()

    # ---- events, metrics, shutdown ------------------------------------------------------------------
    def take_events(self) -> list[KvEvent]:
        events = self.host.slots.take_events()
        if self.disk is not None:
            events += self.disk.slots.take_events()
        return events

    def snapshot(self) -> list[tuple[Tier, list[int]]]:
        out = [(Tier.HOST, self.host.slots.snapshot())]
        if self.disk is not None:
            out.append((Tier.DISK, self.disk.slots.snapshot()))
        return out

    def stats(self) -> TierStats:
        tables = {Tier.HOST: self.host.slots}
        if self.disk is not None:
            tables[Tier.DISK] = self.disk.slots
        return TierStats(
            blocks={t: s.num_ready for t, s in tables.items()},
            capacity_blocks={t: s.num_usable for t, s in tables.items()},
            loaded_blocks=dict(self.counters.loaded), recomputed_blocks=dict(self.counters.recomputed),
            path_bytes={p: m.total_bytes for p, m in self.meters.items()},
            path_seconds={p: m.total_s for p, m in self.meters.items()},
            path_rate_bytes_per_s={p: m.rate.bytes_per_s for p, m in self.meters.items()},
            load_latency_s={t: m.seconds for t, m in self.load_latency.items()},
            errors=dict(self.disk.errors) if self.disk is not None else {},   # a copy: the I/O thread counts
            disk_full=bool(self.disk and self.disk.full))

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait for queued disk work and apply it (tests, shutdown): never on a step loop."""
        deadline = time.monotonic() + timeout_s
        while self._worker is not None and self._worker.num_outstanding:
            if time.monotonic() > deadline:
                raise TimeoutError("disk tier still busy")
            time.sleep(1e-3)
            self.poll()
        self.poll()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self.disk is not None:
            self.disk.close()
        self.host.close()

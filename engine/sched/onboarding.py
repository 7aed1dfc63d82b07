"""The scheduler's side of the KV tiers (kvstore/tiers.py; docs/kv_tiers.md): what moves between
G1 and the tiers below it, decided per step and put in the step's plan as `BlockCopy`s.

Offload is ahead of eviction: each step, the cached blocks among the next `offload_window` that
G1 would hand out, and not in G2 yet, are copied down (a reference held until the copy lands,
then they go back to the head of the free queue, clean); when the engine goes idle, every cached
block not in G2 is. A decode with room in G1 copies nothing. A prompt's hit below G1 is decided
(load or recompute) at admission; a request that loads waits here (disk reads, then G1 room),
its copy goes into a plan, and once it lands the request returns to the head of the scheduler's
queue with the loaded blocks registered, as if they had been in G1.

`OnboardingManager` owns the requests waiting for their blocks, the copies in flight by step and
the offload window's state. It does not admit, run or finish a request (the scheduler does, and
tells it of admissions, registrations and ends), nor move bytes (engine/kv_tiers.py runs the
plan's copies and reports them landed), nor know torch, NIXL or files: the tier manager it is
given does the lookups, the load-or-recompute decisions, slot reservations and disk reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvstore.events import Tier
from kvstore.pools.block_pool import BlockPool, NoFreeBlocks
from kvstore.pools.tier_policy import PrefillSpeed
from engine.plan import BlockCopy, StepPlan
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class _Onboard:
    """A request's G2/G3 hit on its way into G1: the request waits here, out of the queue."""
    request: Request
    ob: object                       # kvstore.tiers.Onboarding
    blocks: list[int] | None = None  # G1 blocks the copy writes, once allocated
    admitted: bool = False           # queued with its copy (ordered mover, idle engine): not requeued at landing


class OnboardingManager:
    """The KV tiers' offload and onboarding work for one scheduler.

    Contract, per step (the scheduler calls, in this order): `step(plan, idle, num_running)` first
    (disk work applied, offloads queued into the plan); `start(req, ...)` at a prompt's admission,
    True if the request now waits here (the scheduler takes it out of its queue); `copy_in(plan,
    num_running)` before new admissions, False while a loaded prefix waits for G1 room (so the
    scheduler admits nothing new). Outside the step: `copies_landed` when the engine's mover
    reports a plan's copies; `drop(request_id)` when a request ends (True if it waited here).
    The scheduler sets `unflushed` when it registers blocks in G1. A request that is ready to run
    again goes to the head of the scheduler's queue through `requeue` (`tier.ready` set: its
    blocks are in `block_ids`; or not: recompute from its G1 hit)."""

    def __init__(self, tiers, pool: BlockPool, block_size: int, max_num_seqs: int, budget_tokens: int,
                 ordered: bool, requeue: Callable[[Request], None]) -> None:
        self.tiers = tiers                          # kvstore.tiers.TierManager
        self.pool = pool
        self.block_size, self.max_num_seqs, self.budget_tokens = block_size, max_num_seqs, budget_tokens
        # the mover orders the compute stream after an onboard (kvstore/movers/host_copy.py HostCopy.ordered):
        # with nothing running, a loaded request is admitted in the step that queues its copy
        self.ordered = ordered
        self._requeue_at_head = requeue
        self.waiting: dict[str, _Onboard] = {}      # waiting for disk reads / G1 room, then copied
        self.unflushed = False                      # blocks registered since G1 was last flushed to G2
        self._abandoned: list[object] = []          # onboardings of requests gone while disk reads run
        self._offloads: list[tuple[int, int, bool]] = []   # (G1 block, host slot, back to the free
        #                                                 queue's head) to copy in the next plan
        self._num_offloading = 0                    # G1 blocks held for offload copies not landed yet
        self._scanned_at: int | None = None         # pool.num_taken when the window was last found clean
        # G1 -> G2 offload ahead of eviction: the next `offload_window` blocks the pool would hand
        # out are kept copied down (a step's worth of allocations, a full budget of prefill plus a
        # decode block per sequence, so that a block is copied a step before it is needed; at most
        # half of the pool)
        self.offload_window = max(1, min(pool.num_blocks // 2, budget_tokens // block_size + max_num_seqs))
        self._copies: dict[int, tuple[list[tuple[int, int, bool]], list[_Onboard]]] = {}   # by step_id

    def busy(self, idle: bool) -> bool:
        """Onboardings or copies under way (the loop must keep stepping to finish them); `idle`:
        the scheduler has nothing else to do."""
        return bool(self.waiting or self._offloads or self._copies or self._abandoned or
                    (self.unflushed and idle))

    def step(self, plan: StepPlan, idle: bool, num_running: int) -> None:
        """Disk work applied; offloads queued into the plan."""
        tiers = self.tiers
        tiers.poll()
        self._offload_ahead(idle, num_running)
        if self._abandoned:
            for ob in [o for o in self._abandoned if o.ready]:
                tiers.finish_onboard(ob)
                self._abandoned.remove(ob)
        offloads, self._offloads = self._offloads, []
        if offloads:
            plan.copies[:0] = [BlockCopy(Tier.GPU, b, Tier.HOST, s) for b, s, _ in offloads]
            self._copies[plan.step_id] = (offloads, [])

    def _offload_ahead(self, idle: bool, num_running: int) -> None:
        """Queue copies of the cached G1 blocks that the next allocations would evict (or, idle,
        of the most recently used cached blocks, as many as G2 holds) that G2 lacks. Under way, at
        most the blocks G1 can spare beyond the next step's needs (a decode block per running
        sequence and a budget of prefill) are held, and at most half of G2 is in question, so that
        the blocks copied cannot push each other out of G2 and be copied again. Blocks already held
        for copies count against the window: they are the next in line, only out of the queue."""
        if idle and not self.unflushed:
            return
        pool, host = self.pool, self.tiers.host
        room = self.offload_window - self._num_offloading
        spare = pool.num_free if idle else pool.num_free - num_running - self.budget_tokens // self.block_size
        if room <= 0 or spare <= 0:
            return
        if idle:
            candidates = pool.reusable(pool.num_free)[-host.num_slots:]
            self._scanned_at = None
        else:
            # only the blocks that moved into the window since it was last found clean (one per
            # block taken off the queue since); the whole window when the queue is shorter
            n = min(room, max(1, host.num_slots // 2))
            skip = 0
            if self._scanned_at is not None and pool.num_free > n:
                skip = max(0, n - (pool.num_taken - self._scanned_at))
            self._scanned_at = pool.num_taken
            candidates = pool.reusable(n, skip)
        dirty = [c for c in candidates if not host.slots.holds(c[1])]
        picked = dirty[:min(spare, room)]
        if idle:
            self.unflushed = bool(picked)        # flushed once a scan finds nothing left to copy
        if not picked:
            return
        pairs = self.tiers.reserve_offload([h for _, h, _ in picked], [p for _, _, p in picked])
        if len(pairs) < len(dirty):
            self._scanned_at = None              # some stay dirty: the whole window again next step
        blocks = [picked[i][0] for i, _ in pairs]
        pool.touch(blocks)                       # protected from reuse until the copy lands
        self._num_offloading += len(blocks)
        # taken from the free queue's head, they go back there; an idle flush's go to its tail in
        # the order taken (oldest first), so the cached blocks keep their LRU order behind the clean
        self._offloads += [(b, s, not idle) for b, (_, s) in zip(blocks, pairs)]

    def start(self, req: Request, hit: list[int], max_hit_blocks: int, speed: PrefillSpeed) -> bool:
        """Decide the prompt's hit below G1 (after its G1 `hit`); start loading it if that pays at
        the prefill `speed`. True: the request waits here, its G1 hit in `block_ids`."""
        tiers, first = self.tiers, len(hit)
        req.tier.checked = True
        if req.num_cached_tokens < 0:
            tiers.record_use(req.block_hashes[:max_hit_blocks])     # disk admission counts uses
        rest = req.block_hashes[first:max_hit_blocks]
        if not rest or not tiers.lookup(rest[:1]):
            return False
        d = tiers.decide(rest, first, speed)
        if d.num_load == 0:
            return False
        hashes = rest[:d.num_load]
        ob = tiers.start_onboard(req.request_id, hashes, [req.block_hashes[first - 1] if first else None] + hashes[:-1])
        if ob.num_ok == 0 and ob.ready:
            tiers.finish_onboard(ob)
            return False
        self.pool.touch(hit)                      # the G1 part of the prefix stays while it waits
        req.block_ids = list(hit)
        self.waiting[req.request_id] = _Onboard(req, ob)
        return True

    def copy_in(self, plan: StepPlan, num_running: int) -> bool:
        """Ready onboardings get G1 blocks and their copies go into the plan. False: one waits for
        G1 room (so new admissions wait too).

        With an ordered mover and nothing running, the request goes back to the queue at once and
        the plan asks for the compute stream to wait for the copy (`plan.wait_onboard`): its step
        is launched while the bytes move, rather than a step after they land, and nothing else is
        held up by the wait. Otherwise it is requeued when the copy lands (`copies_landed`), and
        the running requests' steps go on meanwhile."""
        tiers, started, room = self.tiers, [], True
        early = self.ordered and not num_running
        for rid, o in list(self.waiting.items()):
            ob = o.ob
            if not ob.ready:
                continue
            if ob.num_ok == 0:               # every read failed its checksum: recompute
                del self.waiting[rid]
                tiers.finish_onboard(ob)
                self._requeue(o.request)
                continue
            if not room or num_running >= self.max_num_seqs:
                room = False
                continue
            try:
                o.blocks = self.pool.allocate(ob.num_ok)
            except NoFreeBlocks:
                if not num_running and not self._copies:   # nothing will free blocks: recompute
                    del self.waiting[rid]
                    tiers.finish_onboard(ob)
                    self._requeue(o.request)
                else:
                    room = False
                continue
            del self.waiting[rid]
            started.append(o)
            c = tiers.onboard_copy(ob, o.blocks)
            plan.copies.extend(BlockCopy(Tier.HOST, s, Tier.GPU, b) for b, s in zip(c.g1_blocks, c.g2_slots))
        if started:
            offloads = self._copies.get(plan.step_id, ([], []))[0]
            self._copies[plan.step_id] = (offloads, started)
            if early:
                plan.wait_onboard = True
                for o in reversed(started):
                    o.admitted = True
                    self._loaded(o)
        return room

    def _loaded(self, o: _Onboard) -> None:
        """The onboarded blocks are the request's prefix (cached in G1 from now): back to the head
        of the queue, to be admitted as it is."""
        req, ob = o.request, o.ob
        self.pool.register(o.blocks, ob.hashes, ob.parents[0])
        req.block_ids = req.block_ids + o.blocks
        req.num_registered_blocks = len(req.block_ids)
        req.num_computed_tokens = len(req.block_ids) * self.block_size
        req.tier.ready = True
        req.status = RequestStatus.WAITING
        self._requeue_at_head(req)

    def copies_landed(self, step_id: int, offload: bool, ok: bool = True, seconds: float = 0.0) -> None:
        """The engine's report that a plan's offload or onboard copies landed (or failed)."""
        entry = self._copies.get(step_id)
        if entry is None:
            return
        offloads, started = entry
        tiers = self.tiers
        if offload:
            if offloads:
                self._num_offloading -= len(offloads)
                tiers.offload_landed([s for _, s, _ in offloads], ok, seconds)
                self.pool.free([b for b, _, head in offloads if head], oldest=True)
                self.pool.free([b for b, _, head in reversed(offloads) if not head])   # tail, oldest first
            entry = ([], started)
        else:
            for o in started:
                req, ob = o.request, o.ob
                if ok:
                    tiers.onboard_landed(ob, seconds)
                tiers.finish_onboard(ob)
                if o.admitted:                 # the request has had its blocks since the copy was queued
                    continue
                if req.finished:               # the blocks hold the prefix's KV: cached in G1 anyway
                    if ok:
                        self.pool.register(o.blocks, ob.hashes, ob.parents[0])
                    self.pool.free(o.blocks)
                elif ok:
                    self._loaded(o)
                else:
                    self.pool.free(o.blocks)
                    self._requeue(req)
            entry = (offloads, [])
        if entry[0] or entry[1]:
            self._copies[step_id] = entry
        else:
            del self._copies[step_id]

    def _requeue(self, req: Request) -> None:
        """Back to the head of the queue without its lower-tier hit (recomputed from G1's hit)."""
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.tier.checked = True
        self._requeue_at_head(req)

    def drop(self, request_id: str) -> bool:
        """The request ended; True if it was waiting here (its reads finish and are released)."""
        o = self.waiting.pop(request_id, None)
        if o is None:
            return False
        if o.ob.ready:
            self.tiers.finish_onboard(o.ob)
        else:
            self._abandoned.append(o.ob)
        return True

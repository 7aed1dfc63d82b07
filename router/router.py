"""The router's facade: the one object the frontend talks to. Pure logic, no I/O.

It composes the prefix index (fed by KV events, or the approximate index built from its own
decisions), the prefill queues and the cost model (the KV policy's time to first token), the
session pins (routing hints), the load tracker (the other policies' load) and the selector. Roles
decide who may take what: a PREFILL request goes to PREFILL workers; DECODE and AGGREGATED requests
go to DECODE or AGGREGATED workers (both can prefill locally). Transport of events
(runtime/kv_events.py) and discovery of workers live elsewhere and call in here.

A request's life as the router sees it: ``route`` (charge the chosen worker), ``first_token`` (its
prefill is done), ``finished`` (release it). A request routed twice (decode worker, then a prefill
worker that computes its prompt) moves its prefill work to the prefill worker.
"""

from __future__ import annotations

import random
import time
from typing import Callable, NamedTuple, Sequence

from kvstore.events import KvEventBatch, Tier
from router.affinity import SessionAffinity
from router.approx import ApproxIndex
from router.config import RouterConfig, RoutingPolicy, WorkerRole
from router.cost import PrefillCost
from router.errors import NoWorkerAvailable, UnknownWorker
from router.index import ApplyResult, PrefixIndex, SnapshotEntries
from router.load import LoadTracker
from router.pool import CandidatePool
from router.queues import PrefillQueues, Utilisation
from router.selection import Holder, Selector, cached_tokens, holder_blocks
from perf.profile import CurveTiming

_SERVES: dict[WorkerRole, frozenset[WorkerRole]] = {
    WorkerRole.PREFILL: frozenset({WorkerRole.PREFILL}),
    WorkerRole.DECODE: frozenset({WorkerRole.DECODE, WorkerRole.AGGREGATED}),
    WorkerRole.AGGREGATED: frozenset({WorkerRole.DECODE, WorkerRole.AGGREGATED}),
}


class RouteDecision(NamedTuple):
    """Immutable; a named tuple because one is built per decision (a frozen dataclass's
    constructor costs twice as much)."""
    worker_id: str
    overlap_blocks: int        # leading prompt blocks already cached on the worker (config.tiers)
    cost: float                # the policy's cost of this worker (KV: predicted TTFT in seconds)
    prefill_blocks: int        # prompt blocks the worker still has to compute


MAX_UTILISATION = 0.95      # caps the prefill weight at 20


def prefill_weight(utilisation: float) -> float:
    """How much a second of prefill work weighs against a second of waiting, at this utilisation.

    Work added to a busy worker delays the request itself and every request served after it in
    the same busy period: 1 / (1 - utilisation) requests on average (an M/G/1 busy period), so
    the KV cost counts prefill seconds that many times. Idle fleets trade seconds one for one;
    loaded ones keep a prefix's requests on its worker longer, rather than recompute it.
    """
    return 1.0 / (1.0 - min(max(utilisation, 0.0), MAX_UTILISATION))


class Router:
    def __init__(self, config: RouterConfig, block_size: int, seed: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert block_size > 0
        self.config = config
        self.block_size = block_size
        self._roles: dict[str, WorkerRole] = {}
        self._pools: dict[WorkerRole, CandidatePool] = {}
        self._index = PrefixIndex(config.gap_max_buffered, config.gap_timeout_s, clock)
        self._approx = ApproxIndex(config.approx_ttl_s, clock) if config.approximate else None
        self._loads = LoadTracker(block_size)
        self._selector = Selector(config, random.Random(seed))
        self._clock = clock
        self._ttft = config.policy is RoutingPolicy.KV
        self._prefill = PrefillCost(config.timing or CurveTiming(), config.chunk_tokens)
        self._queues = PrefillQueues(clock)
        self._pins = SessionAffinity(config.max_session_keys)
        self._utilisation = {role: Utilisation() for role in WorkerRole}

    # ---- workers -----------------------------------------------------------------------

    def add_worker(self, worker_id: str, role: WorkerRole) -> None:
        self._roles[worker_id] = role
        self._loads.add_worker(worker_id)
        self._queues.add_worker(worker_id)
        self._pools.clear()

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker entirely (lease expired or drained): cache, load, role."""
        self._roles.pop(worker_id, None)
        self._loads.remove_worker(worker_id)
        self._queues.remove_worker(worker_id)
        self._pins.remove_worker(worker_id)
        self._index.remove_worker(worker_id)
        if self._approx:
            self._approx.remove_worker(worker_id)
        self._pools.clear()

    def workers(self) -> dict[str, WorkerRole]:
        return dict(self._roles)

    # ---- requests ----------------------------------------------------------------------

    def route(self, request_id: str, block_hashes: Sequence[int], num_prompt_tokens: int,
              role: WorkerRole, exclude: set[str] | frozenset[str] = frozenset(),
              hint: str | None = None) -> RouteDecision:
        """Choose a worker of ``role`` for the prompt and charge it the request's load.

        ``hint`` is the client's routing key (prompt_cache_key or user): requests with one key are
        kept together while load allows (router/affinity.py). Only the KV policy reads it."""
        pool = all_eligible = self._pool(role)
        if exclude:
            pool = self._new_pool([c for c in pool.names if c not in exclude])
        if not pool.names:
            raise NoWorkerAvailable(f"no {role.value} worker available "
                                    f"({len(self._roles)} registered, {len(exclude)} excluded)")
        prompt_blocks = max(len(block_hashes), -(-num_prompt_tokens // self.block_size))
        if self._ttft:
            now = self._clock()
            holders = self._holders(block_hashes, pool)
            pinned = None
            if hint is not None and self.config.use_hints:
                pinned = self._pinned(hint, block_hashes, pool, holders)
            util = self._utilisation[role]
            weight = (prefill_weight(util.value(now, len(all_eligible.names)))
                      if self.config.busy_period_weight else 1.0)
            queues = self._queues
            i, cost = self._selector.select_ttft(
                pool, num_prompt_tokens, self.block_size, holders, queues.busy_until, now,
                self._prefill, pinned, weight, queues.decodes() if self.config.decode_delay else None)
            worker, overlap = pool.names[i], holder_blocks(holders, i, pool.slots[i])
            cached = cached_tokens(overlap, num_prompt_tokens, self.block_size) if overlap else 0
            prefill_s = self._prefill.seconds(cached, num_prompt_tokens)
            queues.route(request_id, worker, prefill_s, cached)
            util.add(now, prefill_s)
            if hint is not None and self.config.use_hints:
                self._pins.record(hint, worker, request_id, block_hashes)
            overlap = int(overlap)
        else:
            overlaps = self._overlaps(block_hashes)
            load = self._loads.prefill if role is WorkerRole.PREFILL else self._loads.decode
            worker, cost = self._selector.select(pool.names, prompt_blocks, overlaps, load)
            overlap = int(overlaps.get(worker, 0))
        to_prefill = prompt_blocks - overlap
        if role is WorkerRole.PREFILL:
            self._loads.route(request_id, worker, 0.0, to_prefill)
        else:
            self._loads.route(request_id, worker, prompt_blocks, 0.0)
        if self._approx:
            self._approx.record(worker, block_hashes)
        return RouteDecision(worker, overlap, cost, to_prefill)

    def first_token(self, request_id: str) -> None:
        """The request's first token is out: its prefill (and everything queued before it on that
        worker) is done. Unknown ids are ignored."""
        self._queues.first_token(request_id)

    def finished(self, request_id: str, worker_id: str | None = None) -> None:
        """Release the load ``route`` charged for this request (only on ``worker_id`` if given,
        e.g. when the prefill half of a disaggregated request is done). Unknown ids are ignored:
        a cancel may race the normal finish."""
        self._loads.finish(request_id, worker_id)
        self._queues.finished(request_id, worker_id)

    def update_worker_load(self, worker_id: str, active_blocks: int,
                           waiting_prefill_tokens: int, num_decoding: int | None = None) -> None:
        """A worker's own report. ``num_decoding`` (its running requests past their prefill, whoever
        routed them) lets the KV policy count the decodes other routers (frontends) sent there
        (router/queues.py)."""
        if worker_id not in self._roles:
            raise UnknownWorker(worker_id)
        self._loads.report(worker_id, active_blocks, waiting_prefill_tokens)
        self._queues.report(worker_id, waiting_prefill_tokens, self._prefill.linear_seconds)
        if num_decoding is not None:
            self._queues.report_decoding(worker_id, num_decoding)

    def load(self, worker_id: str) -> float:
        """The load the KV cost uses for this worker (decode blocks, or queued prefill blocks)."""
        if self._roles.get(worker_id) is WorkerRole.PREFILL:
            return self._loads.prefill[worker_id]
        return self._loads.decode[worker_id]

    def overlaps(self, block_hashes: Sequence[int]) -> dict[str, float]:
        """Cached leading blocks per worker, as the KV cost sees them."""
        return self._overlaps(block_hashes)

    # ---- KV events -----------------------------------------------------------------------

    def apply_events(self, batch: KvEventBatch) -> ApplyResult:
        return self._index.apply(batch)

    def apply_snapshot(self, worker_id: str, last_seq: int, entries: SnapshotEntries) -> None:
        self._index.apply_snapshot(worker_id, last_seq, entries)

    def check_gaps(self) -> list[str]:
        """Mark workers whose event gap timed out; call periodically. Returns newly marked."""
        return self._index.check_gaps()

    def workers_needing_resync(self) -> list[str]:
        return self._index.workers_needing_resync()

    def resync_all(self) -> None:
        """Every worker's events may be lost (the stream was reset): resync each from a snapshot."""
        for worker_id in self._roles:
            self._index.mark_needs_resync(worker_id)

    @property
    def index(self) -> PrefixIndex:
        return self._index

    # ---- internals -----------------------------------------------------------------------

    def _pool(self, role: WorkerRole) -> CandidatePool:
        """The role's candidates in registration order (the order ties are broken in)."""
        found = self._pools.get(role)
        if found is None or found.slots_version != self._index.slots_version:
            serves = _SERVES[role]
            found = self._pools[role] = self._new_pool(
                [w for w, r in self._roles.items() if r in serves])
        return found

    def _new_pool(self, names: list[str]) -> CandidatePool:
        index, rows = self._index, self._queues.row
        return CandidatePool(names, [rows[w] for w in names], [index.slot(w) for w in names],
                             index.slots_version)

    def _holders(self, block_hashes: Sequence[int], pool: CandidatePool) -> list[Holder]:
        """The pool's workers holding a prefix of the prompt, grouped by its length: straight from
        the index's slot masks, or (approximate index, lower tiers weighed) per worker."""
        cfg = self.config
        if self._approx is not None or self._weighs_other_tiers():
            position = pool.position
            return [(position[w], n, 0) for w, n in self._overlaps(block_hashes).items()
                    if w in position]
        out: list[Holder] = []
        for bits, run in self._index.runs(block_hashes, cfg.tiers):
            if bits & (bits - 1):
                pos = pool.positions(bits)
                if len(pos):
                    out.append((pos, run, bits))
            else:
                p = pool.position_of_slot(bits.bit_length() - 1)
                if p >= 0:
                    out.append((p, run, 0))
        return out

    def _pinned(self, hint: str, block_hashes: Sequence[int], pool: CandidatePool,
                holders: list[Holder]) -> str | None:
        """The hint's pinned worker if it may take the request; while the key's last request is
        still queued there, its prompt counts as cached there (the index cannot know yet)."""
        pin = self._pins.get(hint)
        if pin is None:
            return None
        p = pool.position.get(pin.worker_id)
        if p is None:
            return None
        if self._queues.is_queued(pin.request_id):
            common = pin.common_prefix(block_hashes)
            slot = pool.slots[p]
            if common > holder_blocks(holders, p, slot):   # take it out of its group
                holders[:] = [(pos[pos != p], blocks, bits & ~(1 << slot))
                              if type(pos) is not int and slot is not None and bits >> slot & 1
                              else (pos, blocks, bits)
                              for pos, blocks, bits in holders if type(pos) is not int or pos != p]
                holders.append((p, common, 0))
        return pin.worker_id

    def _weighs_other_tiers(self) -> bool:
        """Blocks on tiers beyond `config.tiers` count a fraction of a hit, and some worker holds
        such blocks (with none, the weighed overlaps equal the fast ones: the index's masks answer)."""
        cfg = self.config
        return cfg.lower_tier_weight > 0 and self._index.holds_outside(cfg.tiers)

    def _overlaps(self, block_hashes: Sequence[int]) -> dict[str, float]:
        if self._approx:
            return self._approx.overlaps(block_hashes)  # type: ignore[return-value]
        cfg = self.config
        fast = self._index.overlaps(block_hashes, cfg.tiers)
        if not self._weighs_other_tiers():
            return fast  # type: ignore[return-value]
        slow = self._index.overlaps(block_hashes, tuple(Tier))
        return {w: fast.get(w, 0) + cfg.lower_tier_weight * (n - fast.get(w, 0))
                for w, n in slow.items()}

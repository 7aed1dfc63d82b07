"""The router's facade: the one object the frontend talks to. Pure logic, no I/O.

It composes the prefix index (fed by KV events, or the approximate index built from its own
decisions), the load tracker and the selector. Roles decide who may take what: a PREFILL request
goes to PREFILL workers; DECODE and AGGREGATED requests go to DECODE or AGGREGATED workers (both
can prefill locally). Transport of events (runtime/kv_events.py) and discovery of workers live
elsewhere and call in here.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.events import KvEventBatch, Tier
from router.approx import ApproxIndex
from router.config import RouterConfig, WorkerRole
from router.errors import NoWorkerAvailable, UnknownWorker
from router.index import ApplyResult, PrefixIndex, SnapshotEntries
from router.load import LoadTracker
from router.selection import Selector

_SERVES: dict[WorkerRole, frozenset[WorkerRole]] = {
    WorkerRole.PREFILL: frozenset({WorkerRole.PREFILL}),
    WorkerRole.DECODE: frozenset({WorkerRole.DECODE, WorkerRole.AGGREGATED}),
    WorkerRole.AGGREGATED: frozenset({WorkerRole.DECODE, WorkerRole.AGGREGATED}),
}


@dataclass(slots=True, frozen=True)
class RouteDecision:
    worker_id: str
    overlap_blocks: int        # leading prompt blocks already cached on the worker (config.tiers)
    cost: float                # the KV cost of this worker (also reported for non-KV policies)
    prefill_blocks: int        # prompt blocks the worker still has to compute


class Router:
    def __init__(self, config: RouterConfig, block_size: int, seed: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert block_size > 0
        self.config = config
        self.block_size = block_size
        self._roles: dict[str, WorkerRole] = {}
        self._candidates: dict[WorkerRole, list[str]] = {}
        self._index = PrefixIndex(config.gap_max_buffered, config.gap_timeout_s, clock)
        self._approx = ApproxIndex(config.approx_ttl_s, clock) if config.approximate else None
        self._loads = LoadTracker(block_size)
        self._selector = Selector(config, random.Random(seed))

    # ---- workers -----------------------------------------------------------------------

    def add_worker(self, worker_id: str, role: WorkerRole) -> None:
        self._roles[worker_id] = role
        self._loads.add_worker(worker_id)
        self._candidates.clear()

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker entirely (lease expired or drained): cache, load, role."""
        self._roles.pop(worker_id, None)
        self._loads.remove_worker(worker_id)
        self._index.remove_worker(worker_id)
        if self._approx:
            self._approx.remove_worker(worker_id)
        self._candidates.clear()

    def workers(self) -> dict[str, WorkerRole]:
        return dict(self._roles)

    # ---- requests ----------------------------------------------------------------------

    def route(self, request_id: str, block_hashes: Sequence[int], num_prompt_tokens: int,
              role: WorkerRole, exclude: set[str] | frozenset[str] = frozenset()) -> RouteDecision:
        """Choose a worker of ``role`` for the prompt and charge it the request's load."""
        candidates = self._eligible(role)
        if exclude:
            candidates = [c for c in candidates if c not in exclude]
        if not candidates:
            raise NoWorkerAvailable(f"no {role.value} worker available "
                                    f"({len(self._roles)} registered, {len(exclude)} excluded)")
        prompt_blocks = max(len(block_hashes), -(-num_prompt_tokens // self.block_size))
        overlaps = self._overlaps(block_hashes)
        load = self._loads.prefill if role is WorkerRole.PREFILL else self._loads.decode
        worker, cost = self._selector.select(candidates, prompt_blocks, overlaps, load)
        overlap = int(overlaps.get(worker, 0))
        to_prefill = prompt_blocks - overlap
        if role is WorkerRole.PREFILL:
            self._loads.route(request_id, worker, 0.0, to_prefill)
        else:
            self._loads.route(request_id, worker, prompt_blocks, 0.0)
        if self._approx:
            self._approx.record(worker, block_hashes)
        return RouteDecision(worker, overlap, cost, to_prefill)

    def finished(self, request_id: str, worker_id: str | None = None) -> None:
        """Release the load ``route`` charged for this request (only on ``worker_id`` if given,
        e.g. when the prefill half of a disaggregated request is done). Unknown ids are ignored:
        a cancel may race the normal finish."""
        self._loads.finish(request_id, worker_id)

    def update_worker_load(self, worker_id: str, active_blocks: int,
                           waiting_prefill_tokens: int) -> None:
        if worker_id not in self._roles:
            raise UnknownWorker(worker_id)
        self._loads.report(worker_id, active_blocks, waiting_prefill_tokens)

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

    def _eligible(self, role: WorkerRole) -> list[str]:
        found = self._candidates.get(role)
        if found is None:
            serves = _SERVES[role]
            found = self._candidates[role] = [w for w, r in self._roles.items() if r in serves]
        return found

    def _overlaps(self, block_hashes: Sequence[int]) -> dict[str, float]:
        if self._approx:
            return self._approx.overlaps(block_hashes)  # type: ignore[return-value]
        cfg = self.config
        fast = self._index.overlaps(block_hashes, cfg.tiers)
        if cfg.lower_tier_weight <= 0:
            return fast  # type: ignore[return-value]
        slow = self._index.overlaps(block_hashes, tuple(Tier))
        return {w: fast.get(w, 0) + cfg.lower_tier_weight * (n - fast.get(w, 0))
                for w, n in slow.items()}

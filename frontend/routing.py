"""Adapter between the frontend's worker pool and the KV-aware router (router/).

It keeps the router's worker set in step with discovery, feeds it KV events from Redis (resyncing
a worker through its Snapshot RPC when events went missing) and worker-reported load (pushed on
each worker's session stream while it runs, polled every 0.5 s besides), and turns
its decisions into the pool's (worker id, cached blocks) answer. The router is made when the first
worker joins: the pool admits only workers of one block size (frontend/admission.py), and that
block size may be learned from the first one.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from kvstore.events import Tier
from proto.splitserve.v1 import worker_pb2
from router import LOWER_TIER_WEIGHT, NoWorkerAvailable, Router, RouterConfig, RoutingPolicy, WorkerRole
from runtime.errors import Unavailable
from runtime.grpc_links import cluster_metadata
from runtime.kv_events import KvEventConsumer

log = logging.getLogger(__name__)

# KV event reads, at most one per this interval while events flow: a mock or GPU worker publishes a
# batch per engine step (~10 ms), and an XREAD through redis-py cost the frontend ~0.5 ms of CPU,
# more than the tokens of the step; batches now come several to a read, for an index at most this
# much later (docs/frontend.md measures what that costs).
KV_EVENT_MIN_INTERVAL_S = 0.025

ROLES = {"aggregated": WorkerRole.AGGREGATED, "decode": WorkerRole.DECODE, "prefill": WorkerRole.PREFILL}


class FrontendRouter:
    def __init__(self, policy: RoutingPolicy | str, approximate: bool = False, seed: int = 0,
                 lower_tier_weight: float = LOWER_TIER_WEIGHT) -> None:
        # KV tiers: events carry their tier; blocks only in host RAM or on disk count lower_tier_weight
        self._config = RouterConfig(policy=RoutingPolicy(policy), approximate=approximate,
                                    lower_tier_weight=lower_tier_weight)
        self._seed = seed
        self.router: Router | None = None      # made by the first add_worker, with its block size
        self._stubs: dict[str, object] = {}
        self._tasks: list[asyncio.Task] = []
        self._feeds: tuple[aioredis.Redis, str, float] | None = None
        self._pushed_at: dict[str, float] = {}     # worker -> when its stream last brought its load

    # ---- membership (called by WorkerPool) ----------------------------------------------
    def add_worker(self, worker_id: str, info, stub=None) -> None:
        if self.router is None:
            self.router = Router(self._config, info.block_size, self._seed)
            self._start_feeds()
        assert info.block_size == self.router.block_size, "the pool admits one block size"
        self.router.add_worker(worker_id, ROLES[info.role])
        if stub is not None:
            self._stubs[worker_id] = stub

    def remove_worker(self, worker_id: str) -> None:
        self.router.remove_worker(worker_id)
        self._stubs.pop(worker_id, None)
        self._pushed_at.pop(worker_id, None)

    # ---- decisions ----------------------------------------------------------------------
    def route(self, request_id: str, block_hashes: list[int], num_prompt_tokens: int,
              candidates: list[str], role: WorkerRole = WorkerRole.DECODE,
              hint: str | None = None) -> tuple[str, int]:
        """``hint``: the client's routing key (prompt_cache_key / user), see router/affinity.py."""
        if self.router is None:
            raise Unavailable("no workers are available")
        exclude = set(self.router.workers()) - set(candidates)
        try:
            d = self.router.route(request_id, block_hashes, num_prompt_tokens, role, exclude, hint)
        except NoWorkerAvailable as e:
            raise Unavailable(str(e)) from None
        return d.worker_id, d.overlap_blocks

    def queued_prefill_tokens(self, worker_id: str) -> float:
        """Prompt tokens queued on a prefill worker: its last report plus what we routed there since."""
        return self.router.load(worker_id) * self.router.block_size

    def first_token(self, request_id: str) -> None:
        """The request's prefill is done (the KV policy's queue estimate re-anchors on it)."""
        if self.router is not None:
            self.router.first_token(request_id)

    def finished(self, request_id: str, worker_id: str | None = None) -> None:
        if self.router is not None:
            self.router.finished(request_id, worker_id)

    def worker_load(self, worker_id: str, load: worker_pb2.WorkerLoad) -> None:
        """A worker's load as its session stream brought it (every 50 ms while it runs): its KV
        blocks in use, queued prompt tokens and decoding requests, whichever frontend sent them."""
        if self.router is not None and worker_id in self._stubs:
            self.router.update_worker_load(worker_id, load.num_total_blocks - load.num_free_blocks,
                                           load.num_waiting_prefill_tokens, load.num_decoding)
            self._pushed_at[worker_id] = time.monotonic()

    def decodes(self) -> dict[str, tuple[int, int]]:
        """Per worker, the requests it decodes as this frontend's KV policy counts them: (this
        frontend's, the other frontends' as the worker last reported them)."""
        if self.router is None:
            return {}
        q = self.router._queues
        return {w: (int(q.decoding[row]), int(q.others[row])) for w, row in q.row.items()}

    # ---- background feeds ---------------------------------------------------------------
    def start(self, redis: aioredis.Redis, namespace: str, load_interval_s: float = 0.5) -> None:
        """Feed the router KV events and load from now on (or from when it is made)."""
        self._feeds = (redis, namespace, load_interval_s)
        self._start_feeds()

    def _start_feeds(self) -> None:
        if self.router is None or self._feeds is None or self._tasks:
            return
        redis, namespace, load_interval_s = self._feeds
        consumer = KvEventConsumer(redis, namespace, self.router, self._resync,
                                   min_interval_s=KV_EVENT_MIN_INTERVAL_S)
        self._tasks = [asyncio.create_task(consumer.run(), name="kv-events"),
                       asyncio.create_task(self._poll_load(load_interval_s), name="worker-load")]

    async def _resync(self, worker_id: str):
        stub = self._stubs.get(worker_id)
        if stub is None:
            raise Unavailable(f"no connection to {worker_id}")
        snap = await stub.Snapshot(worker_pb2.SnapshotRequest(), timeout=5.0, metadata=cluster_metadata())
        by_tier: dict[Tier, list[tuple[int, int | None]]] = {}
        parents = snap.parent_hashes if len(snap.has_parent) == len(snap.block_hashes) else None
        for i, (h, t) in enumerate(zip(snap.block_hashes, snap.tiers)):
            parent = parents[i] if parents is not None and snap.has_parent[i] else None
            # without parents (an older worker) the index takes the ones it learned from events
            by_tier.setdefault(Tier(t), []).append((h, parent) if parents is not None else h)
        return snap.last_event_seq, list(by_tier.items())

    async def _poll_load(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            fresh = time.monotonic() - interval_s
            for wid, stub in list(self._stubs.items()):
                if self._pushed_at.get(wid, 0.0) > fresh:
                    continue            # its session stream brought a newer report
                try:
                    s = await stub.GetStatus(worker_pb2.WorkerStatusRequest(), timeout=1.0,
                                             metadata=cluster_metadata())
                    self.router.update_worker_load(wid, s.num_total_blocks - s.num_free_blocks,
                                                   s.num_waiting_prefill_tokens)
                except Exception:   # a dying worker; discovery removes it
                    pass

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class RouterLoadCollector:
    """Prometheus samples of what this frontend routes with: `splitserve_router_decodes{frontend,
    worker, source="own|others"}` (requests decoding on each worker, sent by this frontend or by
    the others), read at scrape time."""

    def __init__(self, router: FrontendRouter, frontend_id: str) -> None:
        self.router, self.frontend_id = router, frontend_id

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        g = GaugeMetricFamily("splitserve_router_decodes", "Requests decoding on each worker as this frontend's "
                              "router counts them: sent by this frontend (own) or by the others (others, from "
                              "the workers' load reports)", labels=["frontend", "worker", "source"])
        for worker, (own, others) in self.router.decodes().items():
            g.add_metric([self.frontend_id, worker, "own"], own)
            g.add_metric([self.frontend_id, worker, "others"], others)
        yield g

"""The pool controller's live loop: the decision core (pools/book.py) wired to the world.

Every tick (0.5 s) it asks the connector for what it runs (`refresh`, `list`), reads discovery
(each worker's lease: starting, ready, draining), polls the ready workers' load over gRPC (at most
once a second), joins the three into `WorkerRow`s, lets the core plan, and carries out the plan
through the connector. It then publishes the desired sizes to Redis (runtime/pool_record.py: the
frontend's /health reports a pool below its size as degraded) and its gauges
(`splitserve_pool_*_workers{pool}`). A Redis outage does not stop it: decisions rest on the
connector's handles; discovery only refines their states, and the last view is kept meanwhile.
A lease that vanishes from discovery is remembered for `2 x lease_ttl_s` (a restarted Redis comes
back empty until the workers renew, within a third of the TTL): the pools show the workers as they
last were (ready), not as starting, while they serve on.

The admin API (pools/admin.py) and the SLA planner (planner/live.py) act through its methods: `scale`,
`release`, `set_limits`, `drain_worker`, `set_target`, and read `rows()` / `pools()`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
import redis.asyncio as aioredis

from pools.connector import Connector, ConnectorError, HandleState, WorkerHandle
from pools.book import Drain, PoolBook, PoolName, PoolSpec, Start, Stop, WorkerView
from proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from runtime.discovery import WorkerInfo, list_workers
from runtime.errors import NotFound
from runtime.grpc_links import cluster_metadata, worker_channel
from runtime.latency import merge, quantile_s, total
from runtime.lifecycle import WorkerState
from runtime.logging import Throttled
from runtime.metrics import PoolMetrics
from runtime.pool_record import PoolsRecord, read_latencies, write_pools
from runtime.process import bounded

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 1.0
CLOCK_SLACK_S = 5.0           # a lease started this long before its handle is an older incarnation's
CLOSE_STEP_S = 5.0            # each step of close(); past it the step is logged and left
GONE_MEMORY_S = 30.0          # a removed worker's lingering lease is not shown as someone else's


@dataclass(slots=True)
class WorkerRow:
    """One worker for `pools status` / `workers list` and for the core."""
    name: str
    pool: PoolName
    role: str
    state: WorkerState
    managed: bool
    worker_id: str = ""
    address: str = ""
    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    started_at: float = 0.0
    restarts: int = 0
    detail: str = ""
    gpus: str = ""                  # its GPUs: what its lease says, else what the connector gave it
    tensor_parallel_size: int = 0   # from its lease (0: not known yet)

    def view(self, now: float) -> WorkerView:
        return WorkerView(self.name, self.pool, self.state, self.num_running + self.num_waiting,
                          max(now - self.started_at, 0.0), self.managed)


@dataclass(slots=True)
class PoolRow:
    pool: PoolName
    role: str
    spec: PoolSpec
    ready: int = 0
    starting: int = 0
    draining: int = 0
    failed: int = 0
    num_running: int = 0
    num_waiting: int = 0
    used_blocks: int = 0
    total_blocks: int = 0
    latency: dict[str, float | int | None] = field(default_factory=dict)

    @property
    def degraded(self) -> bool:
        return self.ready < self.spec.desired


def pool_of(role: str) -> PoolName:
    return PoolName.PREFILL if role == "prefill" else PoolName.DECODE


class PoolController:
    def __init__(self, book: PoolBook, connector: Connector, roles: dict[PoolName, str], redis_url: str,
                 namespace: str, metrics: PoolMetrics, tick_s: float = 0.5, metrics_url: str | None = None,
                 admin_address: str | None = None, name: str = "serve", lease_ttl_s: float = 5.0) -> None:
        self.book, self.connector, self.roles = book, connector, roles
        self.redis = aioredis.Redis.from_url(redis_url)
        self.namespace, self.metrics, self.tick_s = namespace, metrics, tick_s
        self.metrics_url, self.admin_address, self.name = metrics_url, admin_address, name
        self.planner_metrics_url: str | None = None     # a planner process's /metrics, published beside ours
        self._infos: list[WorkerInfo] = []
        self._seen: dict[str, tuple[WorkerInfo, float]] = {}   # worker id -> (lease, when last listed: monotonic)
        self._recall_s = 2 * lease_ttl_s
        self._status: dict[str, worker_pb2.WorkerStatus] = {}
        self._status_at = 0.0
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._gone: dict[str, float] = {}          # names that left the connector -> when (monotonic)
        self._known: set[str] = set()
        self._rows: list[WorkerRow] = []
        self._warn = Throttled(log)
        self._task: asyncio.Task | None = None
        self.acting = True                          # off while serve shuts down: no starts, no drains
        self._closing = False

    # ---- the loop ----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="pool-controller")

    async def _run(self) -> None:
        while not self._closing:            # besides the cancel, which a gRPC call may swallow
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("pool controller tick failed")
            await asyncio.sleep(self.tick_s)

    async def tick(self) -> None:
        try:
            await self.connector.refresh()
        except ConnectorError as e:          # e.g. the Kubernetes API is away: keep the last view, retry
            self._warn.warning("refresh", "the connector could not refresh (retrying next tick): %s", e)
            return
        await self._read_discovery()
        await self._poll_status()
        self._rows = self._join(self.connector.list(), time.time())
        if self.acting:
            await self._act()
            self._rows = self._join(self.connector.list(), time.time())
        self._export()
        await self._publish()

    async def close(self) -> None:
        """Stop the loop and close its connections, each step bounded: a step that hangs is logged
        with what it waits on, and the rest still run. The workers are left as they are."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await bounded("stopping the pool controller's loop", asyncio.gather(self._task, return_exceptions=True),
                          CLOSE_STEP_S)
        for addr, ch in list(self._channels.items()):
            await bounded(f"closing the status channel to {addr}", ch.close(grace=None), CLOSE_STEP_S)
        self._channels.clear()
        await bounded("closing the pool controller's Redis client", self.redis.aclose(), CLOSE_STEP_S)

    # ---- what operators and the planner call ------------------------------------------------
    def scale(self, sizes: dict[str, int]) -> None:
        before = {p: self.book.spec(p).desired for p in sizes}
        self.book.scale(sizes)
        for pool, n in sizes.items():
            log.info("%s pool: override %d (desired %d -> %d)", pool, n, before[pool], self.book.spec(pool).desired)

    def release(self, pools: list[str] | None = None) -> None:
        self.book.release(pools)
        log.info("override released: %s", ", ".join(f"{p} desired {s.desired}" for p, s in self.book.pools.items()
                                                     if not pools or p in pools))

    def set_limits(self, pool: str, min_: int | None, max_: int | None) -> PoolSpec:
        spec = self.book.set_limits(pool, min_, max_)
        log.info("%s pool: limits min %d, max %d (desired %d)", pool, spec.min, spec.max, spec.desired)
        return spec

    def set_target(self, pool: str, n: int, decision: str = "") -> None:
        self.book.set_target(pool, n, decision)

    async def drain_worker(self, ident: str) -> WorkerRow:
        """Drain a worker by id or name: ours through the connector (and replaced unless the pool
        is above its size), one found in discovery only through its Worker.Drain RPC."""
        row = next((r for r in self._rows if ident in (r.worker_id, r.name) and ident), None)
        if row is None:
            raise NotFound(f"no worker {ident!r} (see splitserve workers list)")
        if row.managed:
            log.info("draining %s on request", row.name)
            await self.connector.drain(row.name)
        else:
            log.info("asking %s (%s, not started by us) to drain", row.worker_id, row.address)
            async with worker_channel(row.address) as ch:
                await worker_pb2_grpc.WorkerStub(ch).Drain(worker_pb2.DrainRequest(), timeout=5.0,
                                                           metadata=cluster_metadata())
        return row

    def rows(self) -> list[WorkerRow]:
        return list(self._rows)

    def pools(self) -> list[PoolRow]:
        out = {p: PoolRow(p, self.roles[p], s) for p, s in self.book.pools.items()}
        for r in self._rows:
            pr = out.get(r.pool)
            if pr is None:
                continue
            if r.state == WorkerState.READY:
                pr.ready += 1
            elif r.state == WorkerState.STARTING:
                pr.starting += 1
            elif r.state == WorkerState.DRAINING:
                pr.draining += 1
            elif r.state == WorkerState.FAILED:
                pr.failed += 1
            if r.state in (WorkerState.READY, WorkerState.DRAINING):
                pr.num_running += r.num_running
                pr.num_waiting += r.num_waiting
                pr.used_blocks += r.num_used_blocks
                pr.total_blocks += r.num_total_blocks
        return list(out.values())

    async def latency(self) -> dict[str, dict[str, float | int | None]]:
        """Per pool: TTFT and ITL p50/p90 (seconds) over every frontend's last minute."""
        records = await read_latencies(self.redis, self.namespace)
        out = {}
        for pool in self.book.pools:
            ttft = merge(r.ttft.get(pool, {}) for r in records)
            itl = merge(r.itl.get(pool, {}) for r in records)
            out[pool] = {"num_requests": total(ttft), "window_s": max((r.window_s for r in records), default=60.0),
                         "ttft_p50": quantile_s(ttft, 0.5), "ttft_p90": quantile_s(ttft, 0.9),
                         "itl_p50": quantile_s(itl, 0.5), "itl_p90": quantile_s(itl, 0.9)}
        return out

    # ---- one tick's parts -------------------------------------------------------------------
    async def _read_discovery(self) -> None:
        try:
            infos = await list_workers(self.redis, self.namespace)
            self._warn.clear("discovery")
        except Exception as e:       # keep the last view; decisions rest on the connector's handles
            self._warn.warning("discovery", "reading discovery failed (keeping the last view): %s", e)
            return
        now = time.monotonic()
        for info in infos:
            self._seen[info.worker_id] = (info, now)
        # a lease missing for less than recall_s is the worker as it last was (a Redis restart)
        self._seen = {wid: (i, t) for wid, (i, t) in self._seen.items() if now - t < self._recall_s}
        self._infos = [i for i, _ in self._seen.values()]

    async def _poll_status(self) -> None:
        now = time.monotonic()
        if now - self._status_at < STATUS_INTERVAL_S:
            return
        self._status_at = now
        live = [i for i in self._infos if i.state in (WorkerState.READY, WorkerState.DRAINING)]
        results = await asyncio.gather(*(self._status_of(i) for i in live))
        self._status = {i.worker_id: s for i, s in zip(live, results) if s is not None}
        for addr in set(self._channels) - {i.address for i in self._infos}:
            await self._channels.pop(addr).close()

    async def _status_of(self, info: WorkerInfo) -> worker_pb2.WorkerStatus | None:
        ch = self._channels.get(info.address)
        if ch is None:
            ch = self._channels[info.address] = worker_channel(info.address)
        try:
            return await worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.WorkerStatusRequest(), timeout=1.0,
                                                                  metadata=cluster_metadata())
        except grpc.aio.AioRpcError:
            # a cancel of this task can come back as the call's CANCELLED error: it stays a cancel
            # (swallowed, the controller's loop went on and close() waited for it: a CI hang)
            if asyncio.current_task().cancelling():
                raise asyncio.CancelledError from None
            return None

    def _join(self, handles: list[WorkerHandle], now_wall: float) -> list[WorkerRow]:
        mono = time.monotonic()
        names = {h.name for h in handles}
        for name in self._known - names:
            self._gone[name] = mono
        self._known = names
        self._gone = {n: t for n, t in self._gone.items() if mono - t < GONE_MEMORY_S and n not in names}
        by_name: dict[str, list[WorkerInfo]] = {}
        for info in self._infos:
            by_name.setdefault(info.name, []).append(info)
        rows = []
        for h in handles:
            fresh = [i for i in by_name.get(h.name, []) if i.started_at >= h.started_at - CLOCK_SLACK_S]
            info = max(fresh, key=lambda i: i.started_at) if fresh else None
            if h.state == HandleState.FAILED:
                state = WorkerState.FAILED
            elif h.state == HandleState.BACKOFF:
                state, info = WorkerState.STARTING, None
            elif h.state == HandleState.DRAINING:
                state = WorkerState.DRAINING
            else:
                state = WorkerState(info.state) if info else WorkerState.STARTING
            row = self._row(h.name, h.pool, state, True, info, h.started_at, h.restarts, h.detail)
            row.gpus = row.gpus or h.gpus
            rows.append(row)
        for info in self._infos:
            if info.name in names or info.name in self._gone:
                continue
            rows.append(self._row(info.name or info.worker_id, pool_of(info.role), WorkerState(info.state), False,
                                  info, info.started_at, 0, ""))
        return rows

    def _row(self, name, pool, state, managed, info, started_at, restarts, detail) -> WorkerRow:
        row = WorkerRow(name, pool, info.role if info else self.roles.get(pool, ""), state, managed,
                        started_at=started_at, restarts=restarts, detail=detail)
        if info is not None:
            row.worker_id, row.address = info.worker_id, info.address
            row.gpus, row.tensor_parallel_size = info.gpus, info.tensor_parallel_size
            s = self._status.get(info.worker_id)
            if s is not None:
                row.num_running, row.num_waiting = s.num_running, s.num_waiting
                row.num_used_blocks, row.num_total_blocks = s.num_total_blocks - s.num_free_blocks, s.num_total_blocks
        return row

    async def _act(self) -> None:
        now = time.time()
        for action in self.book.plan([r.view(now) for r in self._rows]):
            try:
                if isinstance(action, Start):
                    spec = self.book.pools[action.pool]
                    h = await self.connector.start(action.pool)
                    log.info("starting %s (%s pool: desired %d)", h.name, action.pool, spec.desired)
                elif isinstance(action, Drain):
                    log.info("draining %s (its pool is above its desired size)", action.name)
                    await self.connector.drain(action.name)
                elif isinstance(action, Stop):
                    log.info("removing %s", action.name)
                    await self.connector.stop(action.name)
            except (ConnectorError, KeyError) as e:
                self._warn.warning("act", "%s failed (retrying next tick): %s", action, e)

    def _export(self) -> None:
        m = self.metrics
        for pr in self.pools():
            p = pr.pool
            m.desired.labels(p).set(pr.spec.desired)
            m.ready.labels(p).set(pr.ready)
            m.starting.labels(p).set(pr.starting)
            m.draining.labels(p).set(pr.draining)
            m.failed.labels(p).set(pr.failed)
            m.degraded.labels(p).set(1 if pr.degraded else 0)

    async def _publish(self) -> None:
        pools = self.pools()
        record = PoolsRecord(desired={p.pool: p.spec.desired for p in pools},
                             failed={p.pool: p.failed for p in pools if p.failed},
                             metrics_url=self.metrics_url, admin_address=self.admin_address,
                             planner_metrics_url=self.planner_metrics_url)
        try:
            await write_pools(self.redis, self.namespace, record)
            self._warn.clear("publish")
        except Exception as e:
            self._warn.warning("publish", "publishing the pools' desired sizes failed: %s", e)

"""The frontend's view of the worker fleet: discovery, one Session stream per worker, routing.

Workers are discovered from their Redis leases; those serving another model or another block size
are refused (frontend/admission.py), with one log line each. For each accepted worker, the
frontend keeps one gRPC channel and
one long-lived bidirectional Session stream that multiplexes all of this frontend's requests on
that worker: Submit/Cancel go out, one StepOutput per engine step comes back and is fanned out to
the requests' sinks, synchronously, in one turn of the loop (a sink does its token's work there:
frontend/generation.py). If a stream breaks (the worker died) or its lease expires, every request
on it receives `WORKER_LOST` and the caller migrates it.

Only `ready` workers join and are routed to (runtime/lifecycle.py). A worker that starts draining
says so on its stream (and in its lease): it stays in the pool, unroutable, until its requests are
done and it ends the stream. A worker whose stream broke is not re-admitted while its lease lives
on (a dead process's lease outlives it by up to lease_ttl_s, and re-adding it on every poll made it
join and leave the pool 9 times in 5 s); if the lease is still renewed after `3 x lease_ttl_s` the
worker is alive after all and rejoins. A worker whose lease vanished while its stream is healthy is
kept for `2 x lease_ttl_s` (a restarted Redis comes back empty until the workers renew).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
import redis.asyncio as aioredis

from frontend.admission import Admission
from proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from runtime.discovery import WorkerInfo, list_workers
from runtime.grpc_links import cluster_metadata, worker_channel
from runtime.lifecycle import WorkerState
from runtime.logging import Throttled
from runtime.pool_record import PoolsRecord, read_pools
from router import WorkerRole
from runtime.errors import Unavailable

log = logging.getLogger(__name__)

WORKER_LOST = object()       # put on a request's queue when its worker goes away
SHUTTING_DOWN = object()     # put on every request's queue when the frontend stops before they finish


class WorkerConnection:
    """A channel to one worker; decode/aggregated workers also get the Session stream."""

    def __init__(self, info: WorkerInfo) -> None:
        self.info = info
        self.channel = worker_channel(info.address, max_message_bytes=64 << 20)   # runtime/grpc_links.py
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self._out: asyncio.Queue[worker_pb2.SessionRequest | None] = asyncio.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self.alive = True
        self.draining = info.state == WorkerState.DRAINING
        self.has_session = info.role != "prefill"
        self.on_load = None      # (worker id, WorkerLoad) -> None: the worker's load, as its stream brings it
        self._warn = Throttled(log)
        self._reader = asyncio.create_task(self._run() if self.has_session else self._watch(),
                                           name=f"session-{info.worker_id}")

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def num_active(self) -> int:
        return len(self._streams)

    @property
    def routable(self) -> bool:
        return self.alive and not self.draining and self.info.state == WorkerState.READY

    def update(self, info: WorkerInfo) -> None:
        """A newer lease record of this worker (its state may have changed)."""
        if info.state == WorkerState.DRAINING and not self.draining:
            log.info("worker %s is draining", self.worker_id)
            self.draining = True
        self.info = info

    def interrupt(self, marker: object) -> None:
        """Put `marker` on every request's queue (e.g. SHUTTING_DOWN)."""
        for q in self._streams.values():
            q.put_nowait(marker)

    def submit(self, msg: worker_pb2.WorkerSubmit, sink=None):
        """Send the request; its deltas (and WORKER_LOST / SHUTTING_DOWN) go to `sink.put_nowait`,
        called on the session reader's turn (frontend/generation.py); default: a new asyncio.Queue."""
        if not self.alive:
            raise Unavailable(f"worker {self.worker_id} is gone")
        q = asyncio.Queue() if sink is None else sink
        self._streams[msg.request_id] = q
        self._out.put_nowait(worker_pb2.SessionRequest(submit=msg))
        return q

    def cancel(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None and self.alive:
            self._out.put_nowait(worker_pb2.SessionRequest(cancel=worker_pb2.WorkerCancel(request_id=request_id)))

    def release(self, request_id: str) -> None:
        """The request finished normally; forget its queue."""
        self._streams.pop(request_id, None)

    async def _outgoing(self):
        while True:
            msg = await self._out.get()
            if msg is None:
                return
            yield msg

    async def _run(self) -> None:
        try:
            call = self.stub.Session(self._outgoing(), metadata=cluster_metadata())
            async for step in call:
                if step.draining and not self.draining:
                    log.info("worker %s is draining", self.worker_id)
                    self.draining = True
                if step.HasField("load") and self.on_load is not None:
                    self._load(step.load)
                for delta in step.deltas:
                    q = self._streams.get(delta.request_id)
                    if q is not None:
                        q.put_nowait(delta)
            log.info("worker %s closed its session", self.worker_id)
        except asyncio.CancelledError:
            pass
        except grpc.aio.AioRpcError as e:     # what ended it, said whole (a GOAWAY names its reason)
            log.warning("session with worker %s broke (%s: %s); %d request(s) on it move to other workers",
                        self.worker_id, e.code().name, e.details(), len(self._streams))
        finally:
            self._lost()

    def _load(self, load: worker_pb2.WorkerLoad) -> None:
        try:
            self.on_load(self.worker_id, load)
        except Exception as e:      # routing on without this report beats losing every stream on it
            self._warn.warning("load", "worker %s: its load report was not taken: %s", self.worker_id, e)

    async def _watch(self) -> None:
        """Prefill workers carry no session: notice their death by the channel's state."""
        try:
            state = self.channel.get_state(try_to_connect=True)
            while True:
                await self.channel.wait_for_state_change(state)
                state = self.channel.get_state(try_to_connect=True)
                if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:     # expected once it drained
                    log.log(logging.INFO if self.draining else logging.WARNING,
                            "the connection to prefill worker %s failed; it leaves the pool", self.worker_id)
                    break
        except asyncio.CancelledError:
            pass
        finally:
            self.alive = False

    def _lost(self) -> None:
        self.alive = False
        streams, self._streams = self._streams, {}
        for q in streams.values():
            q.put_nowait(WORKER_LOST)

    async def close(self) -> None:
        self._out.put_nowait(None)
        self._reader.cancel()
        self._lost()
        await self.channel.close()


@dataclass(slots=True)
class Choice:
    conn: WorkerConnection
    overlap_blocks: int


class WorkerPool:
    """Keeps connections in step with the leases in Redis and picks a worker per request."""

    def __init__(self, redis: aioredis.Redis, namespace: str, router, admission: Admission,
                 poll_interval_s: float = 0.5, lease_ttl_s: float = 5.0) -> None:
        self._redis, self._namespace, self.router = redis, namespace, router
        self.admission = admission
        self._poll_s = poll_interval_s
        self._missing_grace_s = 2 * lease_ttl_s
        self._quarantine_s = 3 * lease_ttl_s
        self.workers: dict[str, WorkerConnection] = {}
        self.refused: dict[str, str] = {}      # live workers that may not join: worker id -> why
        self._lost: dict[str, float] = {}      # workers whose connection failed -> when (monotonic)
        self._missing: dict[str, float] = {}   # pool members whose lease vanished -> since when
        self.pools: PoolsRecord | None = None  # the pool controller's desired sizes, if one runs
        self._task: asyncio.Task | None = None
        self.changed = asyncio.Event()
        self._warn = Throttled(log)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._poll(), name="worker-discovery")

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                await self.refresh()
                self._warn.clear("discovery")
            except Exception as e:
                self._warn.warning("discovery", "worker discovery failed (the pool keeps its workers meanwhile): %s",
                                   e)

    async def refresh(self) -> None:
        live = {w.worker_id: w for w in await list_workers(self._redis, self._namespace)}
        self.pools = await read_pools(self._redis, self._namespace)
        now = time.monotonic()
        for wid in list(self.workers):
            conn = self.workers[wid]
            info = live.get(wid)
            if info is not None:
                self._missing.pop(wid, None)
                conn.update(info)
            elif conn.alive and now - self._missing.setdefault(wid, now) < self._missing_grace_s:
                continue            # its lease is gone but its stream is fine: a Redis restart, maybe
            if info is None or not conn.alive:
                why = "its connection failed" if not conn.alive else "its lease expired"
                log.info("worker %s left the pool (%s)", wid, why)
                del self.workers[wid]
                self._missing.pop(wid, None)
                if not conn.alive and info is not None:
                    self._lost[wid] = now      # its lease outlives it: do not re-add it on the next poll
                self.router.remove_worker(wid)
                await conn.close()
        self.refused = {wid: why for wid, why in self.refused.items() if wid in live}
        self._lost = {wid: t for wid, t in self._lost.items() if wid in live}
        for wid, info in live.items():
            if wid in self.workers or wid in self.refused or not info.ready:
                continue
            if wid in self._lost:
                if now - self._lost[wid] < self._quarantine_s:
                    continue
                log.info("worker %s still renews its lease %.0f s after its connection failed: re-admitting it",
                         wid, now - self._lost.pop(wid))
            why = self.admission.refusal(info)
            if why is not None:
                log.warning("refusing worker %s (%s at %s): %s", wid, info.role, info.address, why)
                self.refused[wid] = why
                continue
            log.info("worker %s joined (%s at %s, %d-token blocks)", wid, info.role, info.address, info.block_size)
            conn = WorkerConnection(info)
            conn.on_load = self.router.worker_load
            self.workers[wid] = conn
            self.router.add_worker(wid, info, conn.stub)
        self.changed.set()

    @property
    def block_size(self) -> int | None:
        """Tokens per KV block of every worker in the pool (None before the first one joined)."""
        return self.admission.block_size

    def choose(self, request_id: str, block_hashes: list[int], num_prompt_tokens: int,
               exclude: set[str], prefill: bool = False, hint: str | None = None) -> Choice:
        role = WorkerRole.PREFILL if prefill else WorkerRole.DECODE
        wid, overlap = self.router.route(request_id, block_hashes, num_prompt_tokens,
                                         [w for w, c in self.workers.items()
                                          if c.routable and w not in exclude and (c.info.role == "prefill") == prefill],
                                         role, hint)
        return Choice(self.workers[wid], overlap)

    def sequence_capacity(self) -> int | None:
        """The most tokens one sequence can hold on a decode-side worker: its whole KV cache, which
        caps the engine's context below the model's (None before one joined)."""
        return max((c.info.num_blocks * c.info.block_size for c in self.workers.values()
                    if c.routable and c.info.role != "prefill"), default=None)

    def num_alive(self, prefill: bool = False) -> int:
        """Workers of one kind that take requests (ready, connected, not draining)."""
        return sum(1 for c in self.workers.values() if c.routable and (c.info.role == "prefill") == prefill)

    def num_draining(self, prefill: bool = False) -> int:
        return sum(1 for c in self.workers.values()
                   if c.alive and c.draining and (c.info.role == "prefill") == prefill)

    def degraded(self) -> dict[str, str]:
        """Pools below the size their controller wants: pool -> why (empty: none, or no controller)."""
        if self.pools is None:
            return {}
        out = {}
        for pool, desired in self.pools.desired.items():
            ready = self.num_alive(prefill=pool == "prefill")
            if ready < desired:
                failed = self.pools.failed.get(pool, 0)
                out[pool] = f"{ready} of {desired} workers ready" + (f", {failed} failed" if failed else "")
        return out

    def gpus(self) -> dict[str, str]:
        """Each live worker's GPUs, by worker id, as its lease says ("" where it runs on none)."""
        return {wid: c.info.gpus for wid, c in sorted(self.workers.items()) if c.alive}

    def interrupt_all(self, marker: object) -> None:
        for conn in self.workers.values():
            conn.interrupt(marker)
        self.changed.set()

    async def wait_for_workers(self, timeout_s: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.num_alive():
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except asyncio.TimeoutError:
                return False
        return True

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        for conn in self.workers.values():
            await conn.close()
        self.workers.clear()

"""What every worker process hosts around its engine, whatever its role, and the worker's lifecycle.

A gRPC server (health included) for the role's services, the worker's lease in Redis, the
KV-event publisher (fed from the engine thread, one XADD per batch of steps), and a /metrics
endpoint sampled from the engine's stats. The servers bind `host`; the lease carries the address
others reach them at (`advertised_host`: they differ behind Kubernetes services and NAT, and when
binding 0.0.0.0), the block size and the model's fingerprint, which frontends match. It knows
nothing about the engine itself: stats come from a callable, events through `events_sink`.

It also runs the lifecycle of runtime/lifecycle.py: `open()` starts the gRPC server (liveness
SERVING) and takes the lease as `starting` before the model loads; `serve()` turns it `ready`,
waits for SIGTERM or Worker.Drain, then drains through the role's `Drainable` (no new requests;
those in flight finish; past --drain-timeout-s the rest is handed back to the frontends) and
leaves (the lease is deleted: stopped). A second SIGTERM stops at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import time
import uuid
from typing import Callable, Protocol

import redis.asyncio as aioredis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from runtime.config import WorkerConfig
from runtime.discovery import Lease, WorkerInfo
from runtime.errors import StartupError
from runtime.grpc_links import worker_server
from runtime.host_checks import disk_dir_problem
from runtime.gpus import own_gpus
from runtime.kv_events import KvEventPublisher
from runtime.lifecycle import WORKER_HEALTH_SERVICE, WorkerState
from runtime.logging import Throttled
from runtime.metrics import WorkerMetrics, start_metrics_server
from runtime.model_config import model_fingerprint
from runtime.process import process_age_s

log = logging.getLogger(__name__)

# after the drain timeout, how long the frontends get to take back what was handed to them
GIVE_BACK_GRACE_S = 2.0


class Drainable(Protocol):
    """A role's side of a drain (decode_worker.service.WorkerService, prefill_worker.service.PrefillService)."""

    def begin_drain(self) -> None:
        """Take no new requests from now on (refuse them so that the sender goes elsewhere)."""

    def num_in_flight(self) -> int:
        """Requests (on a prefill worker: prompts and their KV pushes) not finished yet."""

    def give_back(self) -> int:
        """The drain timed out: hand every unfinished request back to its sender (a decode worker:
        its frontend resubmits it elsewhere with the tokens so far; a prefill worker: the decode
        worker computes the prompt itself). Returns how many."""

    def end(self) -> None:
        """Close the role's streams cleanly (the worker is about to exit)."""


_ALL_INTERFACES = ("", "0.0.0.0", "::")


def advertised_host(cfg: WorkerConfig) -> str:
    """The host other processes reach this worker at: --advertise-host, else the bind host, else
    (binding every interface) this machine's address."""
    if cfg.advertise_host:
        return cfg.advertise_host
    return cfg.host if cfg.host not in _ALL_INTERFACES else _this_machine()


def _this_machine() -> str:
    """The hostname's address (a pod's IP in Kubernetes); where that is loopback (Debian maps the
    hostname to 127.0.1.1), the source address of the default route (a UDP connect sends nothing)."""
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        ip = "127.0.0.1"
    if not ip.startswith("127."):
        return ip
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))       # TEST-NET-1: never routed anywhere, only looked up
            return s.getsockname()[0]
    except OSError:
        return ip


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def worker_engine_config(cfg: WorkerConfig):
    """The engine config a worker runs: with a disk KV tier and a --worker-id, the tier lives in the
    subdirectory of --kv-disk-dir named after the worker id (created), so workers sharing a
    directory (`serve` names them ROLE-INDEX) never share a tier, and a restarted one finds its own."""
    e = cfg.engine
    if not (e.kv_disk_dir and cfg.worker_id):
        return e
    problem = disk_dir_problem(e.kv_disk_dir)     # said of the directory the user gave, not of ours
    if problem:
        raise StartupError(problem)
    sub = os.path.join(e.kv_disk_dir, cfg.worker_id)
    os.makedirs(sub, exist_ok=True)
    return dataclasses.replace(e, kv_disk_dir=sub)


def make_worker_id(cfg: WorkerConfig) -> str:
    # unique per process: a restarted worker must not reuse its predecessor's KV-event numbering
    return f"{cfg.worker_id or cfg.role + '-' + socket.gethostname()}-{uuid.uuid4().hex[:6]}"


class StatusService(worker_pb2_grpc.WorkerServicer):
    """Worker.GetStatus, Worker.Snapshot and Worker.Drain, shared by every role (Session is the
    decode role's). `host` gives the lifecycle state; without one (tests) the worker is ready."""

    def __init__(self, worker_id: str, role: str, block_size: int, stats: Callable[[], object],
                 publisher: KvEventPublisher, host: "WorkerHost | None" = None) -> None:
        self.worker_id, self.role, self.block_size = worker_id, role, block_size
        self._stats, self.publisher, self._host = stats, publisher, host

    @property
    def state(self) -> WorkerState:
        return self._host.state if self._host is not None else WorkerState.READY

    async def GetStatus(self, request, context):
        state = self.state
        if state == WorkerState.STARTING:         # no engine yet: nothing to count
            return worker_pb2.WorkerStatus(worker_id=self.worker_id, role=self.role, block_size=self.block_size,
                                           state=state)
        s = self._stats()
        return worker_pb2.WorkerStatus(
            worker_id=self.worker_id, role=self.role, num_total_blocks=s.num_total_blocks,
            num_free_blocks=s.num_free_blocks, num_running=s.num_running, num_waiting=s.num_waiting,
            block_size=self.block_size, num_prefix_hit_tokens=s.num_prefix_hit_tokens,
            num_prompt_tokens=s.num_prompt_tokens, num_waiting_prefill_tokens=s.num_waiting_prefill_tokens,
            state=state)

    async def Drain(self, request, context):
        if self._host is not None:
            self._host.request_drain("Worker.Drain")
        return worker_pb2.DrainResponse(state=self.state)

    async def Snapshot(self, request, context):
        last_seq, per_tier = self.publisher.snapshot()
        hashes, parents, has_parent, tiers = [], [], [], []
        for tier, blocks in per_tier:
            for h, parent in blocks:
                hashes.append(h)
                parents.append(parent or 0)
                has_parent.append(parent is not None)
            tiers.extend([int(tier)] * len(blocks))
        return worker_pb2.SnapshotResponse(worker_id=self.worker_id, last_event_seq=last_seq,
                                           block_hashes=hashes, parent_hashes=parents,
                                           has_parent=has_parent, tiers=tiers)


class WorkerHost:
    def __init__(self, cfg: WorkerConfig, worker_id: str) -> None:
        self.cfg, self.worker_id = cfg, worker_id
        self.redis = aioredis.Redis.from_url(cfg.redis.url)
        self.publisher = KvEventPublisher(self.redis, cfg.redis.namespace, worker_id, track_blocks=True)
        self.metrics = WorkerMetrics(worker_id)
        self.server = worker_server(max_message_bytes=64 << 20)     # keepalive, the cluster token
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.state = WorkerState.STARTING
        self.started_at = time.time()
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._lease: Lease | None = None
        self._drain = asyncio.Event()
        self._stop_now = asyncio.Event()
        self._drain_by_signal = False          # whether a signal (not Worker.Drain) started the drain
        self._warn = Throttled(log)

    def events_sink(self, events) -> None:
        """Thread-safe: called on the engine thread with a step's KV events."""
        self._loop.call_soon_threadsafe(self._events.put_nowait, events)

    async def open(self) -> WorkerInfo:
        """Before the model loads: bind and start the gRPC server (its services must be added to
        `server` first), answer liveness, and take the lease as `starting`."""
        cfg = self.cfg
        port = self.server.add_insecure_port(host_port(cfg.host, cfg.port))
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(WORKER_HEALTH_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        host = advertised_host(cfg)
        metrics_url = None
        if cfg.metrics_port is not None:
            mport = start_metrics_server(cfg.host, cfg.metrics_port, self.metrics.registry)
            metrics_url = f"http://{host_port(host, mport)}/metrics"
        on_cpu = cfg.engine.mock or cfg.engine.device == "cpu"
        info = WorkerInfo(worker_id=self.worker_id, role=cfg.role, address=host_port(host, port),
                          model=cfg.engine.model, block_size=cfg.engine.block_size, num_blocks=0,
                          metrics_url=metrics_url,
                          model_fingerprint=await asyncio.to_thread(model_fingerprint, cfg.engine.model),
                          state=WorkerState.STARTING, name=cfg.worker_id or "", started_at=self.started_at,
                          gpus="" if on_cpu else await asyncio.to_thread(own_gpus),
                          tensor_parallel_size=cfg.engine.tensor_parallel_size)
        self._lease = Lease(self.redis, cfg.redis.namespace, info, cfg.redis.lease_ttl_s)
        await self._lease.start()
        return info

    async def start(self, num_blocks: int, stats: Callable[[], object], max_model_len: int = 0) -> WorkerInfo:
        """The engine is loaded: publish the worker as ready (opening it first if `open` was not
        called), with its KV blocks and its engine's context (frontends report and enforce both)."""
        if self._lease is None:
            await self.open()
        self._tasks += [asyncio.create_task(self._publish_events(), name="kv-event-publisher"),
                        asyncio.create_task(self._sample(stats), name="metrics-sampler")]
        await self._set_state(WorkerState.READY, num_blocks=num_blocks, max_model_len=max_model_len)
        return self._lease.info

    def add_task(self, coro, name: str) -> None:
        """Run a role's own background loop for the worker's life (cancelled in `close`, before
        Redis is)."""
        self._tasks.append(asyncio.create_task(coro, name=name))

    def request_drain(self, why: str) -> None:
        """Start draining (idempotent); a second signal stops at once. A first signal after a
        Worker.Drain is not a second one: it is how Kubernetes deletes the pod a planner drained
        (the preStop hook's SIGTERM), and the drain goes on."""
        by_signal = why.startswith("signal")
        if self._drain.is_set():
            if by_signal and self._drain_by_signal:
                log.warning("%s during the drain: stopping now", why)
                self._stop_now.set()
            self._drain_by_signal = self._drain_by_signal or by_signal
            return
        log.info("draining (%s)", why)
        self._drain_by_signal = by_signal
        self._drain.set()

    async def serve(self, loop, describe: str, agent=None, startup_s: dict | None = None,
                    drainer: Drainable | None = None, before_agent_closes=None) -> None:
        """A worker's whole life once its engine runs: ready, then wait for SIGTERM/SIGINT or
        Worker.Drain, drain through `drainer`, leave the pool (the lease goes), stop the engine
        `loop` (an engine.EngineLoop) and close the NIXL `agent` if there is one, in that order.
        `describe` names the worker in logs; `startup_s` (phase -> seconds) is logged with the time
        from process start to ready; `before_agent_closes` (a coroutine function) runs after the
        engine stops and before the agent closes (the decode worker's peers forget its agent)."""
        aio = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            aio.add_signal_handler(sig, self.request_drain, f"signal {signal.Signals(sig).name}")
        try:
            info = await self.start(loop.engine.pool.num_blocks, lambda: loop.stats,
                                    loop.engine.runner.max_model_len)
            log.info("%s serving on %s (%d blocks)", describe, info.address, info.num_blocks)
            phases = {**(startup_s or {}), **getattr(loop.engine.runner, "startup_s", {}),
                      "process_start_to_ready": round(process_age_s(), 3)}
            log.info("startup phases: %s", json.dumps(phases))
            await _first(self._drain.wait(), self._stop_now.wait())
            if drainer is not None and not self._stop_now.is_set():
                await self._run_drain(drainer)
        finally:
            log.info("%s stopping", describe)
            await self.close()
            loop.stop()
            if before_agent_closes is not None and not self._stop_now.is_set():
                try:
                    await asyncio.wait_for(before_agent_closes(), 5.0)
                except Exception as e:  # noqa: BLE001 - leaving goes on whatever the peers answer
                    log.warning("before closing the KV agent: %s", e)
            if agent is not None:
                agent.close()

    async def _run_drain(self, drainer: Drainable) -> None:
        timeout_s = self.cfg.drain_timeout_s
        start = time.monotonic()
        await self._set_state(WorkerState.DRAINING)
        drainer.begin_drain()
        n = drainer.num_in_flight()
        log.info("draining: %d request(s) in flight, up to %.0f s", n, timeout_s)
        if not await self._until_idle(drainer, start + timeout_s):
            given = drainer.give_back()
            log.warning("drain timeout (%.0f s): handed %d unfinished request(s) back to their senders, "
                        "which move them to other workers", timeout_s, given)
            await self._until_idle(drainer, time.monotonic() + GIVE_BACK_GRACE_S)
        drainer.end()
        await asyncio.sleep(0)                  # let the streams' last messages go out
        log.info("drained in %.1f s", time.monotonic() - start)

    async def _until_idle(self, drainer: Drainable, deadline: float) -> bool:
        while drainer.num_in_flight():
            if self._stop_now.is_set() or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def _set_state(self, state: WorkerState, **changes) -> None:
        self.state = state
        status = (health_pb2.HealthCheckResponse.SERVING if state == WorkerState.READY
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(WORKER_HEALTH_SERVICE, status)
        if self._lease is not None:
            await self._lease.update(state=str(state), **changes)

    async def close(self) -> None:
        self.state = WorkerState.STOPPED
        for t in self._tasks:
            t.cancel()
        if self._lease:
            await self._lease.close()
        await self.server.stop(grace=1.0)
        await self.redis.aclose()

    async def _publish_events(self) -> None:
        while True:
            batch = await self._events.get()
            while not self._events.empty():       # one XADD for everything queued meanwhile
                batch = batch + self._events.get_nowait()
            try:
                await self.publisher.publish(batch)
            except Exception as e:  # the router sees the gap and resyncs from our snapshot
                self._warn.warning("publish", "publishing KV events failed (the router resyncs from a "
                                   "snapshot once it sees the gap): %s", e)

    async def _sample(self, stats: Callable[[], object]) -> None:
        while True:
            self.metrics.observe(stats())
            await asyncio.sleep(1.0)


async def _first(*aws) -> None:
    """Wait until the first of `aws` completes; cancel the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()

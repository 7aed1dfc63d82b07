"""What every worker process hosts around its engine, whatever its role.

A gRPC server (health included) for the role's services, the worker's lease in Redis, the
KV-event publisher (fed from the engine thread, one XADD per batch of steps), and a /metrics
endpoint sampled from the engine's stats. The servers bind `host`; the lease carries the address
others reach them at (`advertised_host`: they differ behind Kubernetes services and NAT, and when
binding 0.0.0.0), the block size and the model's fingerprint, which frontends match. It knows
nothing about the engine itself: stats come from a callable, events through `events_sink`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import uuid
from typing import Callable

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from runtime.config import WorkerConfig
from runtime.discovery import Lease, WorkerInfo
from runtime.kv_events import KvEventPublisher
from runtime.metrics import WorkerMetrics, start_metrics_server
from runtime.model_config import model_fingerprint
from runtime.process import install_stop_handlers, process_age_s

log = logging.getLogger(__name__)


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


def make_worker_id(cfg: WorkerConfig) -> str:
    # unique per process: a restarted worker must not reuse its predecessor's KV-event numbering
    return f"{cfg.worker_id or cfg.role + '-' + socket.gethostname()}-{uuid.uuid4().hex[:6]}"


class StatusService(worker_pb2_grpc.WorkerServicer):
    """Worker.GetStatus and Worker.Snapshot, shared by every role (Session is the decode role's)."""

    def __init__(self, worker_id: str, role: str, block_size: int, stats: Callable[[], object],
                 publisher: KvEventPublisher) -> None:
        self.worker_id, self.role, self.block_size = worker_id, role, block_size
        self._stats, self.publisher = stats, publisher

    async def GetStatus(self, request, context):
        s = self._stats()
        return worker_pb2.WorkerStatus(
            worker_id=self.worker_id, role=self.role, num_total_blocks=s.num_total_blocks,
            num_free_blocks=s.num_free_blocks, num_running=s.num_running, num_waiting=s.num_waiting,
            block_size=self.block_size, num_prefix_hit_tokens=s.num_prefix_hit_tokens,
            num_prompt_tokens=s.num_prompt_tokens, num_waiting_prefill_tokens=s.num_waiting_prefill_tokens)

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
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                               ("grpc.max_send_message_length", 64 << 20)])
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._lease: Lease | None = None

    def events_sink(self, events) -> None:
        """Thread-safe: called on the engine thread with a step's KV events."""
        self._loop.call_soon_threadsafe(self._events.put_nowait, events)

    async def start(self, num_blocks: int, stats: Callable[[], object]) -> WorkerInfo:
        cfg = self.cfg
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        port = self.server.add_insecure_port(host_port(cfg.host, cfg.port))
        await self.server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        host = advertised_host(cfg)
        metrics_url = None
        if cfg.metrics_port is not None:
            mport = start_metrics_server(cfg.host, cfg.metrics_port, self.metrics.registry)
            metrics_url = f"http://{host_port(host, mport)}/metrics"
        info = WorkerInfo(worker_id=self.worker_id, role=cfg.role, address=host_port(host, port),
                          model=cfg.engine.model, block_size=cfg.engine.block_size, num_blocks=num_blocks,
                          metrics_url=metrics_url,
                          model_fingerprint=await asyncio.to_thread(model_fingerprint, cfg.engine.model))
        self._tasks = [asyncio.create_task(self._publish_events(), name="kv-event-publisher"),
                       asyncio.create_task(self._sample(stats), name="metrics-sampler")]
        self._lease = Lease(self.redis, cfg.redis.namespace, info, cfg.redis.lease_ttl_s)
        await self._lease.start()
        return info

    async def serve(self, loop, describe: str, agent=None, startup_s: dict | None = None) -> None:
        """A worker's whole life once its services are on `server`: take the lease, serve until
        SIGTERM/SIGINT, then leave the pool, stop the engine `loop` (an engine.EngineLoop) and close
        the NIXL `agent` if there is one, in that order. `describe` names the worker in logs;
        `startup_s` (phase -> seconds) is logged with the time from process start to the lease."""
        info = await self.start(loop.engine.pool.num_blocks, lambda: loop.stats)
        log.info("%s serving on %s (%d blocks)", describe, info.address, info.num_blocks)
        phases = {**(startup_s or {}), **getattr(loop.engine.runner, "startup_s", {}),
                  "process_start_to_lease": round(process_age_s(), 3)}
        log.info("startup phases: %s", json.dumps(phases))
        try:
            stop = asyncio.Event()
            install_stop_handlers(stop)
            await stop.wait()
        finally:
            log.info("%s stopping", describe)
            await self.close()
            loop.stop()
            if agent is not None:
                agent.close()

    async def close(self) -> None:
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
                log.warning("publishing KV events failed: %s", e)

    async def _sample(self, stats: Callable[[], object]) -> None:
        while True:
            self.metrics.observe(stats())
            await asyncio.sleep(1.0)

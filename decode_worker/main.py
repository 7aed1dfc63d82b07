"""Runs one worker process: loads the engine, serves the Worker gRPC service, holds a lease.

`role` is "aggregated" (prefills and decodes everything itself) or "decode". The engine loads
before the lease is taken, so a worker is never in a pool before it can serve.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from decode_worker.service import WorkerService
from engine.engine import Engine, EngineLoop
from proto.splitserve.v1 import worker_pb2_grpc
from runtime.config import WorkerConfig
from runtime.discovery import Lease, WorkerInfo
from runtime.kv_events import KvEventPublisher
from runtime.metrics import WorkerMetrics, start_metrics_server
from runtime.process import install_stop_handlers

log = logging.getLogger(__name__)


async def serve_worker(cfg: WorkerConfig, ready: asyncio.Event | None = None) -> None:
    # unique per process: a restarted worker must not reuse its predecessor's KV-event numbering
    worker_id = f"{cfg.worker_id or cfg.role + '-' + socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    engine = await asyncio.to_thread(Engine, cfg.engine)
    service = WorkerService(worker_id, cfg.role, cfg.engine.block_size)
    metrics = WorkerMetrics(worker_id)
    redis = aioredis.Redis.from_url(cfg.redis.url)
    events: asyncio.Queue = asyncio.Queue()
    service.publisher = KvEventPublisher(redis, cfg.redis.namespace, worker_id, track_blocks=True)
    aio_loop = asyncio.get_running_loop()
    loop = EngineLoop(engine, service.on_outputs,
                      on_events=lambda evs: aio_loop.call_soon_threadsafe(events.put_nowait, evs))
    service.attach(loop)
    loop.start()
    publisher_task = asyncio.create_task(_publish_events(events, service.publisher))

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)

    metrics_url = None
    if cfg.metrics_port is not None:
        mport = start_metrics_server(cfg.host, cfg.metrics_port, metrics.registry)
        metrics_url = f"http://{cfg.host}:{mport}/metrics"

    info = WorkerInfo(worker_id=worker_id, role=cfg.role, address=f"{cfg.host}:{port}",
                      model=cfg.engine.model, block_size=cfg.engine.block_size,
                      num_blocks=engine.pool.num_blocks, metrics_url=metrics_url)
    lease = Lease(redis, cfg.redis.namespace, info, cfg.redis.lease_ttl_s)
    await lease.start()
    log.info("worker %s serving on %s (%d blocks, max_model_len %d)", worker_id, info.address,
             engine.pool.num_blocks, engine.max_model_len)

    stop = asyncio.Event()
    install_stop_handlers(stop)
    if ready is not None:
        ready.set()
    sampler = asyncio.create_task(_sample_metrics(loop, metrics))
    try:
        await stop.wait()
    finally:
        log.info("worker %s stopping", worker_id)
        sampler.cancel()
        publisher_task.cancel()
        await lease.close()
        await server.stop(grace=1.0)
        loop.stop()
        await redis.aclose()


async def _publish_events(events: asyncio.Queue, publisher: KvEventPublisher) -> None:
    while True:
        batch = await events.get()
        while not events.empty():           # one XADD for everything queued meanwhile
            batch = batch + events.get_nowait()
        try:
            await publisher.publish(batch)
        except Exception as e:  # the router sees the gap and resyncs from our snapshot
            log.warning("publishing KV events failed: %s", e)


async def _sample_metrics(loop: EngineLoop, metrics: WorkerMetrics) -> None:
    while True:
        metrics.observe(loop.stats)
        await asyncio.sleep(1.0)

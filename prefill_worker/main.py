"""Runs one prefill worker process: engine + Prefill service + NIXL agent + lease + KV events."""

from __future__ import annotations

import asyncio

from engine.engine import Engine, EngineLoop
from kvstore.transfer import KvTransferAgent, nixl_available
from prefill_worker.service import PrefillService
from proto.splitserve.v1 import worker_pb2_grpc
from runtime.config import WorkerConfig
from runtime.worker_host import StatusService, WorkerHost, make_worker_id


async def serve_prefill_worker(cfg: WorkerConfig) -> None:
    if not nixl_available():
        raise SystemExit("a prefill worker needs NIXL (pip install 'splitserve[nixl]')")
    worker_id = make_worker_id(cfg)
    host = WorkerHost(cfg, worker_id)
    service = PrefillService(worker_id, host.metrics)
    worker_pb2_grpc.add_PrefillServicer_to_server(service, host.server)
    worker_pb2_grpc.add_WorkerServicer_to_server(
        StatusService(worker_id, "prefill", cfg.engine.block_size, lambda: loop.stats, host.publisher, host=host),
        host.server)
    await host.open()              # liveness and a `starting` lease while the model loads
    try:
        engine = await asyncio.to_thread(Engine, cfg.engine)
    except BaseException:
        await host.close()
        raise
    agent = KvTransferAgent(worker_id, engine.runner.kv_cache)
    loop = EngineLoop(engine, service.on_outputs, on_events=host.events_sink)
    service.attach(loop, agent)
    loop.start()
    await host.serve(loop, f"prefill worker {worker_id}", agent, drainer=service)

"""Runs one decode (or aggregated) worker process: engine + Session service + lease + events.

The gRPC server and the lease (as `starting`) come up before the engine loads, so probes and
operators see the worker from its first second; it turns `ready` (and frontends route to it) only
once the engine runs (runtime/lifecycle.py). With NIXL installed, the worker also opens a transfer
agent over its KV cache so that prefill workers can push prompts' KV into it.
"""

from __future__ import annotations

import asyncio
import time
import logging

from decode_worker.remote_prefill import RemotePrefillClient
from decode_worker.service import WorkerService
from engine.engine import Engine, EngineLoop
from engine.parallel.kv import open_endpoint
from kvstore.movers.transfer import nixl_available
from proto.splitserve.v1 import worker_pb2_grpc
from runtime.config import WorkerConfig
from runtime.process import process_age_s
from runtime.worker_host import WorkerHost, make_worker_id, worker_engine_config

log = logging.getLogger(__name__)


async def serve_worker(cfg: WorkerConfig) -> None:
    startup_s = {"process_start_to_main": round(process_age_s(), 3)}    # interpreter + imports
    worker_id = make_worker_id(cfg)
    host = WorkerHost(cfg, worker_id)
    service = WorkerService(worker_id, cfg.role, cfg.engine.block_size, lambda: loop.stats, host.publisher,
                            host=host)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, host.server)
    await host.open()              # liveness and a `starting` lease while the model loads
    t0 = time.perf_counter()
    try:
        engine = await asyncio.to_thread(Engine, worker_engine_config(cfg))
    except BaseException:
        await host.close()
        raise
    startup_s["engine"] = round(time.perf_counter() - t0, 3)
    agent = None
    if cfg.role == "decode" and nixl_available():
        t0 = time.perf_counter()
        agent = open_endpoint(worker_id, engine.runner)     # every rank's KV agent
        startup_s["nixl_agent"] = round(time.perf_counter() - t0, 3)
    remote: RemotePrefillClient | None = None
    # reservations only arise for Submits naming a prefill worker, which needs `remote` to exist
    loop = EngineLoop(engine, service.on_outputs, on_events=host.events_sink,
                      on_reservations=lambda rs: remote.on_reservations(rs))
    if agent is not None:
        remote = RemotePrefillClient(worker_id, agent, loop, cfg.engine.block_size, host.metrics,
                                     lease_s=cfg.prefill_lease_s)
    elif cfg.role == "decode":
        log.warning("NIXL is not installed: this decode worker prefills every request locally")
    service.attach(loop, remote)
    loop.start()
    await host.serve(loop, f"worker {worker_id} ({cfg.role}, max_model_len {engine.max_model_len})", agent,
                     startup_s, drainer=service,
                     before_agent_closes=None if remote is None else remote.disconnect_all)

"""Runs one prefill worker process: engine + Prefill service + NIXL agent + lease + KV events."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from engine.engine import Engine, EngineLoop
from engine.parallel.kv import open_endpoint
from kvstore.movers.transfer import nixl_available
from prefill_worker.service import PrefillService
from proto.splitserve.v1 import worker_pb2_grpc
from runtime.config import WorkerConfig
from runtime.process import process_age_s
from runtime.worker_host import StatusService, WorkerHost, make_worker_id, worker_engine_config


async def serve_prefill_worker(cfg: WorkerConfig) -> None:
    if not nixl_available():
        raise SystemExit("a prefill worker needs NIXL (pip install 'splitserve[nixl]')")
    if cfg.prefill_deadline_ms is not None and not cfg.prefill_deadline_ms > 0:
        raise SystemExit(f"--prefill-deadline-ms must be > 0, not {cfg.prefill_deadline_ms}")
    startup_s = {"process_start_to_main": round(process_age_s(), 3)}    # interpreter + imports
    worker_id = make_worker_id(cfg)
    host = WorkerHost(cfg, worker_id)
    service = PrefillService(worker_id, host.metrics)
    worker_pb2_grpc.add_PrefillServicer_to_server(service, host.server)
    worker_pb2_grpc.add_WorkerServicer_to_server(
        StatusService(worker_id, "prefill", cfg.engine.block_size, lambda: loop.stats, host.publisher, host=host),
        host.server)
    await host.open()              # liveness and a `starting` lease while the model loads
    t0 = time.perf_counter()
    try:
        # a prefill worker computes prompts and their first token, never a decode step: decode CUDA
        # graphs would cost start-up time and memory for nothing
        engine = await asyncio.to_thread(Engine, dataclasses.replace(worker_engine_config(cfg), cuda_graphs=False))
    except BaseException:
        await host.close()
        raise
    startup_s["engine"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    agent = open_endpoint(worker_id, engine.runner)       # every rank's KV agent
    startup_s["nixl_agent"] = round(time.perf_counter() - t0, 3)
    engine.scheduler.track_prefill_time = True      # each prompt's wait and compute, for the planner
    if cfg.prefill_deadline_ms is not None:
        engine.scheduler.order.deadline_s = cfg.prefill_deadline_ms / 1e3
    loop = EngineLoop(engine, service.on_outputs, on_events=host.events_sink)
    host.add_task(service.timings.publish(host.redis, cfg.redis.namespace), "prefill-timings")
    service.attach(loop, agent)
    loop.start()
    await host.serve(loop, f"prefill worker {worker_id}", agent, startup_s, drainer=service)

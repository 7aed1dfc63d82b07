"""`splitserve controller`: the pool controller and its admin API on their own, scaling the worker
Deployments of a Kubernetes namespace through the Kubernetes connector (pools/k8s_connector.py).

It starts from the Deployments' current replicas (a restarted controller resizes nothing), keeps
each pool at its desired size within --min/--max, and serves the admin API (`splitserve pools
scale|release|status`, `workers list|drain`) behind the admin token (--admin-token /
SPLITSERVE_ADMIN_TOKEN; without one it generates one and writes it to a file only its user can
read, as `serve` does). The SLA planner sets targets through the same admin API. Scale-down drains
the chosen pod through its Worker.Drain RPC, at the address its lease in discovery advertises.

In a pod it uses the pod's ServiceAccount (in-cluster config); --kube-api-url (with its token in
SPLITSERVE_KUBE_TOKEN) points it at another API server, e.g. a test's stand-in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import grpc

from pools.admin import start_admin_server
from pools.connector import HandleState
from pools.controller import PoolController
from pools.k8s_connector import KubernetesConnector
from pools.book import PoolBook, PoolName, PoolSpec
from proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from runtime.admin_auth import new_token, write_token_file
from runtime.config import ControllerComponentConfig
from runtime.grpc_links import cluster_metadata, worker_channel
from runtime.metrics import PoolMetrics, start_metrics_server

log = logging.getLogger("splitserve.controller")


def api_client(cfg: ControllerComponentConfig):
    from kubernetes import client, config
    k = cfg.kubernetes
    if k.api_url:
        c = client.Configuration()
        c.host = k.api_url
        if k.api_token:
            c.api_key = {"authorization": k.api_token}
            c.api_key_prefix = {"authorization": "Bearer"}
        return client.ApiClient(c)
    config.load_incluster_config()
    return client.ApiClient()


async def worker_drain_rpc(controller: PoolController, name: str) -> bool:
    """Worker.Drain on the worker `name` (its newest lease's address); False if it has none or refused."""
    row = next((r for r in controller.rows() if r.name == name and r.address), None)
    if row is None:
        return False
    try:
        async with worker_channel(row.address) as ch:
            await worker_pb2_grpc.WorkerStub(ch).Drain(worker_pb2.DrainRequest(), timeout=5.0,
                                                       metadata=cluster_metadata())
        return True
    except grpc.RpcError as e:
        log.warning("Worker.Drain on %s (%s) failed: %s", name, row.address, e.code().name)
        return False


async def run_controller(cfg: ControllerComponentConfig) -> int:
    k, c = cfg.kubernetes, cfg.controller
    deployments = {PoolName.DECODE: k.decode_deployment}
    if k.prefill_deployment:
        deployments[PoolName.PREFILL] = k.prefill_deployment
    roles = {PoolName.DECODE: "decode" if k.prefill_deployment else "aggregated", PoolName.PREFILL: "prefill"}
    holder: dict[str, PoolController] = {}
    connector = KubernetesConnector(k.namespace, deployments, lambda name: worker_drain_rpc(holder["c"], name),
                                    api_client(cfg))
    await connector.refresh()                 # the current replicas: where the pools start
    now: dict[PoolName, int] = {}
    for h in connector.list():
        now[h.pool] = now.get(h.pool, 0) + (h.state != HandleState.DRAINING)

    def spec(n: int, lo: int, hi: int) -> PoolSpec:
        return PoolSpec(min(max(n, lo), hi), lo, hi)
    decode = spec(now.get(PoolName.DECODE, 0), c.min_decode_workers, c.max_decode_workers)
    prefill = (spec(now.get(PoolName.PREFILL, 0), c.min_prefill_workers, c.max_prefill_workers) if k.prefill_deployment
               else PoolSpec(0, 0, 0, fixed="no prefill Deployment: the decode pool serves aggregated"))
    book = PoolBook({PoolName.DECODE: decode, PoolName.PREFILL: prefill})

    metrics = PoolMetrics()
    mport = start_metrics_server(cfg.metrics_host, cfg.metrics_port, metrics.registry)
    mhost = cfg.metrics_host
    if mhost in ("0.0.0.0", "::", ""):     # the frontends merge this /metrics: this pod's address
        mhost = os.environ.get("POD_IP") or "127.0.0.1"
    controller = PoolController(book, connector, roles, cfg.redis.url, cfg.redis.namespace, metrics,
                                metrics_url=f"http://{mhost}:{mport}/metrics", name="controller",
                                lease_ttl_s=cfg.redis.lease_ttl_s)
    holder["c"] = controller
    token = c.admin_token or new_token()
    try:
        admin, port = await start_admin_server(controller, c.admin_host, c.admin_port, token)
    except OSError as e:
        print(f"splitserve controller: the admin API {e}", file=sys.stderr)
        await controller.close()
        return 2
    token_path = None if c.admin_token else write_token_file(port, token)
    controller.admin_address = f"{c.admin_host}:{port}"
    controller.start()
    log.info("pool controller: %s in namespace %s (decode %d, prefill %d); admin API on %s (%s)",
             ", ".join(deployments.values()), k.namespace, decode.target, prefill.target, controller.admin_address,
             f"token in {token_path}" if token_path else "token: --admin-token / SPLITSERVE_ADMIN_TOKEN")
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping (the workers keep running; a new controller takes them over)")
    await controller.close()
    await admin.stop(grace=0.5)
    if token_path is not None:
        token_path.unlink(missing_ok=True)
    return 0

"""The admin API (proto/splitserve/v1/admin.proto) over a PoolController, behind the admin token.

Served by the process that owns the desired sizes (`splitserve serve`; a planner process hosting a controller later)
on --admin-host:--admin-port. Every call must carry `authorization: Bearer <token>`; the check is
an interceptor, so no method can forget it, and it compares in constant time
(runtime/admin_auth.py). The token is never logged; calls that change something are logged with
what they changed. Errors map to statuses in one place (`_call`): InvalidRequest -> INVALID_ARGUMENT,
NotFound -> NOT_FOUND, with messages written for the operator.
"""

from __future__ import annotations

import logging
import time

import grpc

from pools.controller import PoolController, PoolRow, WorkerRow
from proto.splitserve.v1 import admin_pb2, admin_pb2_grpc
from runtime.admin_auth import token_matches
from runtime.config_planner import HARD_MAX_WORKERS
from runtime.errors import InvalidRequest, SplitserveError
from runtime.grpc_links import server_options
from runtime.lifecycle import WorkerState

log = logging.getLogger(__name__)

MAX_DECISION_CHARS = 2000

STATE_TO_PB = {WorkerState.STARTING: admin_pb2.WORKER_STATE_STARTING, WorkerState.READY: admin_pb2.WORKER_STATE_READY,
               WorkerState.DRAINING: admin_pb2.WORKER_STATE_DRAINING,
               WorkerState.STOPPED: admin_pb2.WORKER_STATE_STOPPED, WorkerState.FAILED: admin_pb2.WORKER_STATE_FAILED}


class TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        assert token, "the admin API is never served without a token"
        self._token = token

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "the admin API needs `authorization: Bearer <admin token>` "
                                "(--admin-token / SPLITSERVE_ADMIN_TOKEN)")
        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        header = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        if not token_matches(header if isinstance(header, str) else None, self._token):
            return self._deny
        return await continuation(details)


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, controller: PoolController) -> None:
        self.c = controller

    async def GetStatus(self, request, context):
        return await _call(context, self._status)

    async def ScalePool(self, request, context):
        sizes = {p: getattr(request, p) for p in ("prefill", "decode") if request.HasField(p)}

        async def go():
            if not sizes:
                raise InvalidRequest("say which pool: --prefill N and/or --decode N")
            self.c.scale(sizes)
            return admin_pb2.ScalePoolResponse(pools=await self._pools())
        return await _call(context, go)

    async def ReleasePools(self, request, context):
        async def go():
            self.c.release(list(request.pools) or None)
            return admin_pb2.ReleasePoolsResponse(pools=await self._pools())
        return await _call(context, go)

    async def SetPoolLimits(self, request, context):
        async def go():
            spec = self.c.set_limits(request.pool, request.min if request.HasField("min") else None,
                                     request.max if request.HasField("max") else None)
            row = next(p for p in self.c.pools() if p.spec is spec)
            return admin_pb2.SetPoolLimitsResponse(pool=_pool_pb(row, {}))
        return await _call(context, go)

    async def DrainWorker(self, request, context):
        async def go():
            row = await self.c.drain_worker(request.worker_id.strip())
            return admin_pb2.DrainWorkerResponse(worker_id=row.worker_id or row.name,
                                                 message=f"{row.name} is draining")
        return await _call(context, go)

    async def SetPoolTargets(self, request, context):
        async def go():
            targets = list(request.targets)
            if not targets or len(targets) > len(self.c.book.pools):
                raise InvalidRequest(f"give one target per pool ({', '.join(self.c.book.pools)})")
            for t in targets:
                self.c.book.spec(t.pool)                      # NotFound for an unknown pool
                if not 0 <= t.desired <= HARD_MAX_WORKERS:
                    raise InvalidRequest(f"a target must be in [0, {HARD_MAX_WORKERS}] (got {t.desired})")
                if len(t.decision) > MAX_DECISION_CHARS:
                    raise InvalidRequest(f"a decision is at most {MAX_DECISION_CHARS} characters")
            for t in targets:
                self.c.set_target(t.pool, t.desired, t.decision)
            return admin_pb2.SetPoolTargetsResponse(pools=await self._pools())
        return await _call(context, go)

    async def _status(self) -> admin_pb2.GetStatusResponse:
        now = time.time()
        return admin_pb2.GetStatusResponse(pools=await self._pools(), controller=self.c.name,
                                           workers=[_worker_pb(r, now) for r in self.c.rows()])

    async def _pools(self) -> list[admin_pb2.PoolStatus]:
        latency = await self.c.latency()
        return [_pool_pb(p, latency.get(p.pool, {})) for p in self.c.pools()]


async def _call(context, fn):
    try:
        return await fn()
    except SplitserveError as e:
        await context.abort(e.grpc_code, e.message)


def _pool_pb(p: PoolRow, lat: dict) -> admin_pb2.PoolStatus:
    s = p.spec
    msg = admin_pb2.PoolStatus(pool=p.pool, role=p.role, desired=s.desired, min=s.min, max=s.max, ready=p.ready,
                               starting=p.starting, draining=p.draining, failed=p.failed, num_running=p.num_running,
                               num_waiting=p.num_waiting, degraded=p.degraded, last_decision=s.last_decision,
                               note=s.fixed or "",
                               kv_usage=p.used_blocks / p.total_blocks if p.total_blocks else 0.0)
    if s.override is not None:
        msg.override = s.override
    lt = msg.latency
    lt.num_requests, lt.window_s = int(lat.get("num_requests") or 0), float(lat.get("window_s") or 60.0)
    for key in ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90"):
        if lat.get(key) is not None:
            setattr(lt, key + "_ms", lat[key] * 1000.0)
    return msg


def _worker_pb(r: WorkerRow, now: float) -> admin_pb2.PoolWorker:
    return admin_pb2.PoolWorker(worker_id=r.worker_id, name=r.name, pool=r.pool, role=r.role,
                                state=STATE_TO_PB[r.state], address=r.address, num_running=r.num_running,
                                num_waiting=r.num_waiting, num_used_blocks=r.num_used_blocks,
                                num_total_blocks=r.num_total_blocks,
                                uptime_s=max(now - r.started_at, 0.0) if r.started_at else 0.0,
                                restarts=r.restarts, managed=r.managed, detail=r.detail, gpus=r.gpus,
                                tensor_parallel_size=r.tensor_parallel_size)


async def start_admin_server(controller: PoolController, host: str, port: int,
                             token: str) -> tuple[grpc.aio.Server, int]:
    """Serve the admin API; returns the server and its port. OSError if the port is taken."""
    server = grpc.aio.server(interceptors=[TokenInterceptor(token)],
                             options=[("grpc.max_receive_message_length", 1 << 20), ("grpc.so_reuseport", 0),
                                      *server_options()])      # a planner's channel pings it (runtime/grpc_links.py)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminService(controller), server)
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(target)
    except RuntimeError as e:          # grpc says "Failed to bind"
        raise OSError(f"cannot listen on {target}: {e}") from None
    if not bound:
        raise OSError(f"cannot listen on {target} (in use?)")
    await server.start()
    return server, bound

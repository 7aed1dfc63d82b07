"""The pool controller, the local-process connector and the admin API over real processes and a real
Redis: real `--mock` workers (the real worker, scheduler, block pool and lease; a timing model in
place of the GPU), started the way `splitserve serve` starts them (a config file each), so that
restarts and crash loops take seconds. A worker pointed at a model that does not exist is the
crash at every start. The same controller drives `serve`'s workers in tests/integration/test_pools.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from pools.admin import start_admin_server
from pools.controller import PoolController
from pools.local_connector import LocalProcessConnector
from pools.book import PoolBook, PoolName, PoolSpec
from pools.restarts import RestartPolicy
from proto.splitserve.v1 import admin_pb2, admin_pb2_grpc
from runtime.lifecycle import WorkerState
from runtime.metrics import PoolMetrics
from runtime.pool_record import read_pools
from runtime.config import EngineConfig, RedisConfig, WorkerConfig
from runtime.redis_embedded import EmbeddedRedis
from splitserve.models import resolve_model
from splitserve.serve import Cluster

pytestmark = pytest.mark.slow

# the decode pool's mock workers prefill their own prompts: what the controller does does not depend on KV moving
ROLES = {PoolName.DECODE: "aggregated", PoolName.PREFILL: "prefill"}
COMMANDS = {"aggregated": "decode-worker", "prefill": "prefill-worker"}
TOKEN = "admin-test-token-5d1e"
START_S = 60.0       # a mock worker's start-up on a busy 2-core machine (imports, the tiny model's config)


@pytest.fixture
def redis_url():
    with EmbeddedRedis() as r:
        yield r.url


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.stop(timeout_s=5)


def make(redis_url: str, cluster: Cluster, broken: frozenset[str] = frozenset(), decode=2, prefill=0,
         lease_ttl_s: float = 5.0):
    """A controller over real mock workers; the workers named in `broken` get a model that does not
    exist, so they exit with an error at every start."""
    model_dir = resolve_model("tiny")

    def spawn(pool, name, gpus=None):
        role = ROLES[pool]
        engine = EngineConfig(model="/nonexistent/model" if name in broken else model_dir, mock=True, device="cpu")
        cfg = WorkerConfig(engine=engine, redis=RedisConfig(url=redis_url, lease_ttl_s=lease_ttl_s), role=role,
                           host="127.0.0.1", worker_id=name, drain_timeout_s=5.0)
        return cluster.spawn_component(COMMANDS[role], name, cfg, dict(os.environ))

    metrics = PoolMetrics()
    connector = LocalProcessConnector(spawn, ROLES, RestartPolicy(backoff_s=0.1, crash_loop_restarts=2),
                                      on_restart=lambda p: metrics.restarts.labels(p).inc(),
                                      on_crash_loop=lambda p: metrics.crash_loops.labels(p).inc())
    book = PoolBook({PoolName.DECODE: PoolSpec(decode, 1, 3), PoolName.PREFILL: PoolSpec(prefill, 0, 2)})
    return PoolController(book, connector, ROLES, redis_url, "splitserve", metrics, tick_s=0.1,
                          lease_ttl_s=lease_ttl_s), connector


async def until(cond, timeout_s: float = START_S, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s} s"
        await asyncio.sleep(0.05)


def states(c: PoolController, pool: str = "decode") -> list[str]:
    return sorted(r.state for r in c.rows() if r.pool == pool)


async def test_pools_are_kept_at_size_crashes_restarted_and_a_crash_loop_reported(redis_url, cluster):
    c, connector = make(redis_url, cluster, broken=frozenset({"aggregated-1"}))      # aggregated-1 dies at every start
    c.start()
    try:
        await until(lambda: "ready" in states(c), what="a ready worker")
        await until(lambda: states(c) == ["failed", "ready"], what="aggregated-1's crash loop")
        row = next(r for r in c.rows() if r.name == "aggregated-1")
        assert row.restarts == 2 and "crash loop" in row.detail and "exit code 2" in row.detail   # a bad --model: exit 2
        assert c.metrics.crash_loops.labels("decode")._value.get() == 1
        record = await read_pools(c.redis, "splitserve")
        assert record.desired == {"decode": 2, "prefill": 0} and record.failed == {"decode": 1}

        # kill -9 of a healthy worker: restarted under the same name
        (healthy,) = [r for r in c.rows() if r.name == "aggregated-0"]
        os.kill(connector.pid("aggregated-0"), signal.SIGKILL)
        await until(lambda: any(r.name == "aggregated-0" and r.state == WorkerState.READY and r.worker_id != healthy.worker_id
                                for r in c.rows()), what="aggregated-0's replacement")
        assert next(r for r in c.rows() if r.name == "aggregated-0").restarts == 1

        # removing the failed worker lets a fresh one take its place; scaling down drains the surplus
        await c.drain_worker("aggregated-1")
        await until(lambda: states(c) == ["ready", "ready"], what="a fresh decode worker")
        c.scale({"decode": 1})
        await until(lambda: states(c) == ["ready"], what="the drained worker to leave")
        assert len([r for r in c.rows() if r.pool == "decode"]) == 1
    finally:
        await c.close()
        connector.kill_all()


async def test_the_admin_api_needs_the_token_and_refuses_sizes_beyond_the_limits(redis_url, cluster):
    c, connector = make(redis_url, cluster, decode=1, prefill=0)
    server, port = await start_admin_server(c, "127.0.0.1", 0, TOKEN)
    c.start()
    ok = [("authorization", f"Bearer {TOKEN}")]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = admin_pb2_grpc.AdminStub(ch)
            for md in ([], [("authorization", "Bearer wrong")], [("authorization", TOKEN)]):
                for call, req in ((stub.GetStatus, admin_pb2.GetStatusRequest()),
                                  (stub.ScalePool, admin_pb2.ScalePoolRequest(decode=2)),
                                  (stub.DrainWorker, admin_pb2.DrainWorkerRequest(worker_id="aggregated-0"))):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call(req, metadata=md, timeout=5)
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert c.book.spec("decode").desired == 1           # nothing changed
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ScalePool(admin_pb2.ScalePoolRequest(decode=9), metadata=ok, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "above the decode pool's max of 3" in \
                e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.DrainWorker(admin_pb2.DrainWorkerRequest(worker_id="nobody"), metadata=ok, timeout=5)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            r = await stub.ScalePool(admin_pb2.ScalePoolRequest(decode=2), metadata=ok, timeout=5)
            (decode,) = [p for p in r.pools if p.pool == "decode"]
            assert (decode.desired, decode.override) == (2, 2)
            await until(lambda: states(c) == ["ready", "ready"], what="two decode workers")
            st = await stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=ok, timeout=5)
            assert sorted(w.name for w in st.workers) == ["aggregated-0", "aggregated-1"]
            assert all(w.state == admin_pb2.WORKER_STATE_READY and w.managed for w in st.workers)
            lim = await stub.SetPoolLimits(admin_pb2.SetPoolLimitsRequest(pool="decode", max=2), metadata=ok, timeout=5)
            assert (lim.pool.min, lim.pool.max) == (1, 2)
            r = await stub.ReleasePools(admin_pb2.ReleasePoolsRequest(), metadata=ok, timeout=5)
            assert [p.desired for p in r.pools if p.pool == "decode"] == [1]
            await until(lambda: states(c) == ["ready"], what="the override's release")
    finally:
        await server.stop(0)
        await c.close()
        connector.kill_all()


class _SwallowsOneCancel(LocalProcessConnector):
    """A refresh that turns the first cancel into an ordinary return, as a gRPC call may turn it into
    its CANCELLED error (the controller's loop then went on, and close() waited for it: a CI hang)."""
    swallowed = 0

    async def refresh(self) -> None:
        if self.swallowed == 0:
            try:
                await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                self.swallowed += 1
                return
        await super().refresh()


async def test_close_returns_promptly_when_the_loops_cancel_is_swallowed(redis_url, cluster):
    c, connector = make(redis_url, cluster, decode=0, prefill=0)
    c.connector = connector = _SwallowsOneCancel(connector._spawn, ROLES)
    c.start()
    try:
        await asyncio.sleep(0.05)                  # inside the first refresh
        t0 = time.monotonic()
        await c.close()
        assert connector.swallowed == 1 and c._task.done() and time.monotonic() - t0 < 2.0
    finally:
        connector.kill_all()


async def test_after_a_redis_restart_the_pools_show_their_workers_as_they_last_were(cluster):
    """Redis comes back empty until the workers renew their leases: meanwhile `pools status` keeps
    showing them ready (it showed "0 ready, 2 starting" for seconds while both served)."""
    with EmbeddedRedis() as redis:
        c, connector = make(redis.url, cluster, decode=2, lease_ttl_s=2.0)
        c.start()
        try:
            await until(lambda: states(c) == ["ready", "ready"], what="two ready workers")
            await asyncio.to_thread(redis.restart)
            seen = set()
            deadline = time.monotonic() + 3.0           # beyond the workers' renewal (a third of 2 s)
            while time.monotonic() < deadline:
                seen.add(tuple(states(c)))
                await asyncio.sleep(0.01)
            assert seen == {("ready", "ready")}, seen
            from runtime.discovery import list_workers
            deadline = time.monotonic() + START_S
            while len(await list_workers(c.redis, "splitserve")) < 2:      # they do re-register
                assert time.monotonic() < deadline, "the workers did not re-register"
                await asyncio.sleep(0.1)
        finally:
            await c.close()
            connector.kill_all()

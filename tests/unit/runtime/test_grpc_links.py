"""The links inside a cluster, over real gRPC servers and channels on loopback: a client pinging as
hard as the cluster's clients do keeps its link (no GOAWAY too_many_pings) to a worker's server and
to the admin API for a while, streams and unary calls alike; a worker refuses calls without the
cluster token (gRPC health stays open) and serves those with it."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.splitserve.v1 import admin_pb2, admin_pb2_grpc, worker_pb2, worker_pb2_grpc
from runtime import grpc_links
from runtime.config import EngineConfig, RedisConfig, WorkerConfig
from runtime.worker_host import StatusService, WorkerHost

PING_MS = 200          # the cluster's 10 s, scaled down
HOLD_S = 9.0           # gRPC's default server policy broke such a link 3 s into each quiet spell
QUIET_S = 4.0


def worker_host() -> WorkerHost:
    """A real worker's host (its gRPC server as every worker builds it); Redis is never reached here."""
    return WorkerHost(WorkerConfig(engine=EngineConfig(model="unused"), redis=RedisConfig(url="redis://127.0.0.1:1/0")),
                      "decode-test")


async def hold_link(stream_call, unary_call) -> list[str]:
    """For HOLD_S, keep a server-streaming call open (if `stream_call`) and make a unary call every
    QUIET_S, no data in between; every failure but our own cancel, as 'CODE: details'."""
    failures: list[str] = []
    deadline = time.monotonic() + HOLD_S

    async def stream() -> None:
        while stream_call is not None and time.monotonic() < deadline:
            call = stream_call()
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    failures.append(f"stream {e.code().name}: {e.details()}")
            await asyncio.sleep(0.05)

    async def unary() -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(QUIET_S)               # quiet: no data, pings only
            try:
                await unary_call()
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
                    failures.append(f"unary {e.code().name}: {e.details()}")
    task = asyncio.create_task(stream())
    await unary()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return failures


async def test_a_workers_server_keeps_a_link_that_pings_as_hard_as_the_cluster_does(monkeypatch):
    monkeypatch.setattr(grpc_links, "PING_INTERVAL_MS", PING_MS)
    monkeypatch.delenv(grpc_links.TOKEN_ENV, raising=False)
    host = worker_host()
    port = host.server.add_insecure_port("127.0.0.1:0")
    await host.server.start()
    channel = grpc_links.worker_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        failures = await hold_link(
            lambda: stub.Watch(health_pb2.HealthCheckRequest(service="")),
            lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=5))
    finally:
        await channel.close()
        await host.server.stop(None)
    assert failures == []


async def test_the_admin_api_keeps_a_planners_link_that_pings(monkeypatch):
    from pools.admin import start_admin_server
    monkeypatch.setattr(grpc_links, "PING_INTERVAL_MS", PING_MS)
    server, port = await start_admin_server(SimpleNamespace(), "127.0.0.1", 0, "admin-token")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=grpc_links.client_options())
    stub = admin_pb2_grpc.AdminStub(channel)

    async def refused():                 # no token: answered at once, without a controller behind it
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=5)
        if e.value.code() != grpc.StatusCode.UNAUTHENTICATED:
            raise e.value
    try:
        failures = await hold_link(None, refused)
    finally:
        await channel.close()
        await server.stop(None)
    assert failures == []


def test_servers_accept_pings_at_twice_the_rate_clients_send_them():
    client, server = dict(grpc_links.client_options()), dict(grpc_links.server_options())
    assert server["grpc.http2.min_ping_interval_without_data_ms"] * 2 <= client["grpc.keepalive_time_ms"]
    assert server["grpc.keepalive_permit_without_calls"] == client["grpc.keepalive_permit_without_calls"] == 1


async def test_a_worker_refuses_calls_without_the_cluster_token_and_keeps_health_open(monkeypatch):
    monkeypatch.setenv(grpc_links.TOKEN_ENV, "cluster-token-3e9b")
    host = worker_host()
    stats = SimpleNamespace(num_total_blocks=8, num_free_blocks=8, num_running=0, num_waiting=0,
                            num_prefix_hit_tokens=0, num_prompt_tokens=0, num_waiting_prefill_tokens=0)
    worker_pb2_grpc.add_WorkerServicer_to_server(
        StatusService("decode-test", "decode", 16, lambda: stats, SimpleNamespace()), host.server)
    port = host.server.add_insecure_port("127.0.0.1:0")
    await host.server.start()
    channel = grpc_links.worker_channel(f"127.0.0.1:{port}")
    stub = worker_pb2_grpc.WorkerStub(channel)
    try:
        for md in ((), ((grpc_links.TOKEN_METADATA, "wrong"),), (("authorization", "Bearer cluster-token-3e9b"),)):
            for call in (lambda: stub.GetStatus(worker_pb2.WorkerStatusRequest(), metadata=md, timeout=5),
                         lambda: stub.Drain(worker_pb2.DrainRequest(), metadata=md, timeout=5)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, md
                assert "cluster-token-3e9b" not in (e.value.details() or "")
        st = await stub.GetStatus(worker_pb2.WorkerStatusRequest(), metadata=grpc_links.cluster_metadata(), timeout=5)
        assert st.num_total_blocks == 8
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await channel.close()
        await host.server.stop(None)


async def test_the_frontends_router_resyncs_and_polls_load_through_the_token(monkeypatch):
    """The frontend's calls beside the Session stream (a resync from a worker's snapshot, the load
    poll) carry the token too: a worker that requires it answers them."""
    from frontend.routing import FrontendRouter
    from kvstore.events import Tier
    from runtime.discovery import WorkerInfo
    monkeypatch.setenv(grpc_links.TOKEN_ENV, "cluster-token-77a1")
    host = worker_host()
    asked = []

    def stats():
        asked.append(1)
        return SimpleNamespace(num_total_blocks=8, num_free_blocks=5, num_running=1, num_waiting=0,
                               num_prefix_hit_tokens=0, num_prompt_tokens=0, num_waiting_prefill_tokens=32)
    publisher = SimpleNamespace(snapshot=lambda: (7, [(Tier.GPU, [(123, None), (456, 123)])]))
    worker_pb2_grpc.add_WorkerServicer_to_server(StatusService("decode-test", "decode", 16, stats, publisher),
                                                 host.server)
    port = host.server.add_insecure_port("127.0.0.1:0")
    await host.server.start()
    channel = grpc_links.worker_channel(f"127.0.0.1:{port}")
    router = FrontendRouter("kv")
    router.add_worker("decode-test", WorkerInfo("decode-test", "decode", f"127.0.0.1:{port}", "m", 16, 8),
                      worker_pb2_grpc.WorkerStub(channel))
    try:
        last_seq, entries = await router._resync("decode-test")
        assert last_seq == 7 and entries == [(Tier.GPU, [(123, None), (456, 123)])]
        poll = asyncio.create_task(router._poll_load(0.02))
        await asyncio.sleep(0.5)
        poll.cancel()
        assert asked                                  # GetStatus got through
    finally:
        await channel.close()
        await host.server.stop(None)

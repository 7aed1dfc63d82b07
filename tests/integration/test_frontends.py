"""`serve --frontends 2`: two frontend processes on one address, each routing with the fleet's load.

Both frontends bind the same HTTP and gRPC ports (SO_REUSEPORT); connections spread over them, and
a request through each is served. While streams run, each frontend's router counts the decodes the
other frontend sent to the workers (from the load the workers push on their session streams), as
its /metrics shows: own + others adds up to what runs on the worker.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import defaultdict

import grpc
import httpx
import pytest

from proto.splitserve.v1 import generation_pb2, generation_pb2_grpc
from runtime.pool_record import read_latencies
from tests.integration.cluster import own_cluster, until

pytestmark = pytest.mark.slow

STREAMS = 8
DECODES = re.compile(r'^splitserve_router_decodes\{frontend="(\w+)",source="(\w+)",worker="([^"]+)"\} (\S+)$', re.M)


def decodes_by_frontend(url: str) -> dict[str, dict[str, float]]:
    """One /metrics scrape on a fresh connection: {frontend id: {own, others}} summed over workers."""
    text = httpx.get(f"{url}/metrics", timeout=10, headers={"connection": "close"}).text
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"own": 0.0, "others": 0.0})
    for fid, source, _worker, value in DECODES.findall(text):
        out[fid][source] += float(value)
    return dict(out)


def test_two_frontends_share_the_ports_and_route_with_each_others_load():
    with own_cluster("--mock", "--prefill-workers", "0", "--decode-workers", "1", "--frontends", "2") as c:
        # connections spread over both processes: a request through each is served
        for _ in range(12):
            r = httpx.post(f"{c.url}/v1/completions", headers={"connection": "close"}, timeout=60,
                           json={"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        with grpc.insecure_channel(f"127.0.0.1:{c.grpc_port}") as ch:
            got = list(generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=[1, 2, 3]), sampling=generation_pb2.SamplingParams(
                    max_tokens=3, ignore_eos=True)), timeout=60))
            assert sum(len(m.token_ids) for m in got) == 3
        # each frontend publishes its arrivals every second: both served some of the 13
        until(lambda: sum(r.arrivals > 0 for r in asyncio.run(read_latencies_of(c.redis_url))) == 2 and
              sum(r.arrivals for r in asyncio.run(read_latencies_of(c.redis_url))) == 13,
              timeout_s=10, what="both frontends serving requests")

        # long streams on separate connections; each frontend must count the other's as `others`
        done = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{c.url}/v1/completions", timeout=120, headers={"connection": "close"},
                              json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True,
                                    "stream": True}) as r:
                for _ in r.iter_raw():
                    if done.is_set():
                        return
        threads = [threading.Thread(target=stream, daemon=True) for _ in range(STREAMS)]
        for t in threads:
            t.start()
        try:
            seen: dict[str, dict[str, float]] = {}

            def both_see_the_whole_fleet():
                seen.update(decodes_by_frontend(c.url))
                full = {f: v for f, v in seen.items() if v["own"] + v["others"] == STREAMS}
                return len(full) == 2 and all(v["own"] < STREAMS for v in full.values()) and full
            full = until(both_see_the_whole_fleet, timeout_s=60, interval_s=0.2,
                         what="both frontends counting all the worker's streams")
            assert sum(v["own"] for v in full.values()) == STREAMS
        finally:
            done.set()
            for t in threads:
                t.join(timeout=30)


async def read_latencies_of(redis_url: str):
    import redis.asyncio as aioredis
    client = aioredis.Redis.from_url(redis_url)
    try:
        return await read_latencies(client, "splitserve")
    finally:
        await client.aclose()

"""runtime/discovery.py on a real Redis: a worker's record carries its engine's context, and a record
written by a newer worker (a field this reader does not know) still lists the worker."""

from __future__ import annotations

import dataclasses
import json

import redis.asyncio as aioredis

from runtime.discovery import Lease, WorkerInfo, list_workers
from runtime.redis_embedded import EmbeddedRedis


async def test_records_round_trip_and_unknown_fields_are_skipped():
    with EmbeddedRedis() as server:
        client = aioredis.Redis.from_url(server.url)
        try:
            info = WorkerInfo("w1", "decode", "127.0.0.1:1", "tiny", 16, 2, max_model_len=2048)
            lease = Lease(client, "ns", info, ttl_s=30)
            await lease.start()
            newer = {**dataclasses.asdict(info), "worker_id": "w2", "a_newer_field": [1]}
            await client.set("ns:worker:w2", json.dumps(newer))
            await client.set("ns:worker:w3", "not json")
            listed = await list_workers(client, "ns")
            assert [w.worker_id for w in listed] == ["w1", "w2"]
            assert listed[0] == info and listed[1].max_model_len == 2048
            await lease.close()
        finally:
            await client.aclose()

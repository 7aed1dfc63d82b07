"""This frontend's TTFT and ITL over the last minute, per pool, published for the pool controller.

The decode pool's figures cover every request (each one streams from a decode worker); the prefill
pool's TTFT covers the prompts a prefill worker computed. Every `interval_s` the histograms' counts
go to Redis under this frontend's own key (runtime/pool_record.py), expiring if the frontend dies;
`splitserve pools status` shows percentiles of the sum over every frontend.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import redis.asyncio as aioredis

from runtime.latency import RollingHistogram
from runtime.logging import Throttled
from runtime.pool_record import LatencyRecord, write_latency

log = logging.getLogger(__name__)


class LatencyPublisher:
    def __init__(self, redis: aioredis.Redis, namespace: str, interval_s: float = 2.0,
                 window_s: float = 60.0) -> None:
        self._redis, self._namespace, self._interval_s = redis, namespace, interval_s
        self.frontend_id = uuid.uuid4().hex[:12]
        self.window_s = window_s
        self.ttft = {"decode": RollingHistogram(window_s), "prefill": RollingHistogram(window_s)}
        self.itl = {"decode": RollingHistogram(window_s)}
        self._warn = Throttled(log)

    def first_token(self, ttft_s: float, prefilled_remotely: bool) -> None:
        now = time.monotonic()
        self.ttft["decode"].add(ttft_s, now)
        if prefilled_remotely:
            self.ttft["prefill"].add(ttft_s, now)

    def inter_token(self, itl_s: float) -> None:
        self.itl["decode"].add(itl_s, time.monotonic())

    def record(self) -> LatencyRecord:
        now = time.monotonic()
        return LatencyRecord(self.window_s, {p: h.counts(now) for p, h in self.ttft.items()},
                             {p: h.counts(now) for p, h in self.itl.items()})

    async def run(self) -> None:
        while True:
            try:
                await write_latency(self._redis, self._namespace, self.frontend_id, self.record())
                self._warn.clear("write")
            except Exception as e:
                self._warn.warning("write", "publishing latency figures failed: %s", e)
            await asyncio.sleep(self._interval_s)

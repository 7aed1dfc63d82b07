"""This frontend's TTFT and ITL over the last minute, per pool, published for the pool controller.

The decode pool's figures cover every request (each one streams from a decode worker); the prefill
pool's TTFT covers the prompts a prefill worker computed. Every `interval_s` the histograms' counts
go to Redis under this frontend's own key (runtime/pool_record.py), expiring if the frontend dies;
`splitserve pools status` shows percentiles of the sum over every frontend.

For the SLA planner it adds the load: a running count of arrivals, the running sum and count of
inter-token gaps (so that the planner takes the mean ITL of its own interval from differences), and
the last requests that finished with their lengths (arrival time, prompt, output and cached tokens,
each with a sequence number, so that the planner takes each one once), and the last arrivals' times
(the newest is arrival number `arrivals`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque

import redis.asyncio as aioredis

from runtime.latency import RollingHistogram
from runtime.logging import Throttled
from runtime.pool_record import LatencyRecord, write_latency

log = logging.getLogger(__name__)

RECENT_REQUESTS = 512        # finished requests each record carries (the planner reads every second)
RECENT_ARRIVALS = 2048       # arrival times each record carries


class LatencyPublisher:
    def __init__(self, redis: aioredis.Redis, namespace: str, interval_s: float = 1.0,
                 window_s: float = 60.0) -> None:
        self._redis, self._namespace, self._interval_s = redis, namespace, interval_s
        self.frontend_id = uuid.uuid4().hex[:12]
        self.window_s = window_s
        self.ttft = {"decode": RollingHistogram(window_s), "prefill": RollingHistogram(window_s)}
        self.itl = {"decode": RollingHistogram(window_s)}
        self._warn = Throttled(log)
        self.arrivals = 0
        self.itl_sum_s = 0.0
        self.itl_count = 0
        self._seq = 0
        self._recent: deque[list[float]] = deque(maxlen=RECENT_REQUESTS)
        self._arrival_times: deque[float] = deque(maxlen=RECENT_ARRIVALS)

    def arrival(self) -> None:
        self.arrivals += 1
        self._arrival_times.append(round(time.time(), 3))

    def done(self, arrived_at: float, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> None:
        self._seq += 1
        self._recent.append([self._seq, round(arrived_at, 3), prompt_tokens, output_tokens, cached_tokens])

    def first_token(self, ttft_s: float, prefilled_remotely: bool) -> None:
        now = time.monotonic()
        self.ttft["decode"].add(ttft_s, now)
        if prefilled_remotely:
            self.ttft["prefill"].add(ttft_s, now)

    def inter_token(self, itl_s: float) -> None:
        self.inter_tokens([itl_s])

    def inter_tokens(self, itls_s: list[float]) -> None:
        """A batch of inter-token gaps (a request's last few tokens')."""
        self.itl["decode"].add_many(itls_s, time.monotonic())
        self.itl_sum_s += sum(itls_s)
        self.itl_count += len(itls_s)

    def record(self) -> LatencyRecord:
        now = time.monotonic()
        return LatencyRecord(self.window_s, {p: h.counts(now) for p, h in self.ttft.items()},
                             {p: h.counts(now) for p, h in self.itl.items()}, self.frontend_id, self.arrivals,
                             self.itl_sum_s, self.itl_count, list(self._recent), list(self._arrival_times))

    async def run(self) -> None:
        while True:
            try:
                await write_latency(self._redis, self._namespace, self.frontend_id, self.record())
                self._warn.clear("write")
            except Exception as e:
                if asyncio.current_task().cancelling():   # a client library turned the cancel into
                    raise asyncio.CancelledError() from e  # its own error: the task still ends
                self._warn.warning("write", "publishing latency figures failed: %s", e)
            await asyncio.sleep(self._interval_s)

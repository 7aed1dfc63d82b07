"""A prefill worker's last prompts' queue wait and compute time, published for the SLA planner.

The engine (engine/scheduler.py, `track_prefill_time`) reports with each prompt's first token the
seconds from its arrival at the engine to the first step that computed part of it (the wait) and
its share, by tokens, of the wall time of the steps that computed it (the compute). Every
`interval_s` the last RECENT_PROMPTS of them go to Redis under this worker's key
(runtime/pool_record.py), expiring if the worker dies. The planner (planner/live.py) compares them
with its profile's prefill time and its queueing model's wait: its two prefill corrections.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import redis.asyncio as aioredis

from runtime.logging import Throttled
from runtime.pool_record import PrefillTimingRecord, write_prefill_timing

log = logging.getLogger(__name__)

RECENT_PROMPTS = 512         # prompts each record carries (the planner reads every second)


class PrefillTimings:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._seq = 0
        self._recent: deque[list[float]] = deque(maxlen=RECENT_PROMPTS)
        self._warn = Throttled(log)

    def record(self, prompt_tokens: int, cached_tokens: int, wait_s: float, compute_s: float) -> None:
        self._seq += 1
        self._recent.append([self._seq, prompt_tokens, max(cached_tokens, 0), round(wait_s, 6), round(compute_s, 6)])

    def snapshot(self) -> PrefillTimingRecord:
        return PrefillTimingRecord(self.worker_id, [list(p) for p in self._recent])

    async def publish(self, redis: aioredis.Redis, namespace: str, interval_s: float = 1.0) -> None:
        """Write the record every `interval_s` until cancelled, empty ones too: the planner counts a
        worker's prompts from the first record it sees, so a worker is seen before its first prompt."""
        while True:
            try:
                await write_prefill_timing(redis, namespace, self.snapshot())
                self._warn.clear("publish")
            except Exception as e:  # Redis away: the planner's corrections wait, serving does not
                self._warn.warning("publish", "publishing prefill timings failed: %s", e)
            await asyncio.sleep(interval_s)

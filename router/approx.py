"""Approximate prefix index for workers that publish no KV events.

The router assumes that a prompt it routed to a worker is cached there for ``ttl_s`` seconds
(refreshed each time the same block is routed there again) and forgets it afterwards. It is a
guess: a worker may evict sooner or keep longer; it is still far better than ignoring reuse.

Entries expire lazily, on the next ``record`` or ``overlaps`` call, in routing order: with one
TTL, the oldest recorded route always expires first, so a FIFO of routes suffices.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Sequence

from router.index import PrefixIndex


class ApproxIndex:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        assert ttl_s > 0
        self._ttl_s = ttl_s
        self._clock = clock
        self._index = PrefixIndex(clock=clock)
        self._expiry: dict[str, dict[int, float]] = {}   # worker -> block hash -> expiry time
        self._routes: deque[tuple[float, str, Sequence[int]]] = deque()

    def record(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        """The router sent this prompt to ``worker_id``: assume its blocks are cached there."""
        now = self._clock()
        self._expire(now)
        if not block_hashes:
            return
        expiry = now + self._ttl_s
        mine = self._expiry.setdefault(worker_id, {})
        for h in block_hashes:
            mine[h] = expiry
        self._index.store(worker_id, block_hashes)
        self._routes.append((expiry, worker_id, block_hashes))

    def overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        self._expire(self._clock())
        return self._index.overlaps(block_hashes)

    def remove_worker(self, worker_id: str) -> None:
        self._expiry.pop(worker_id, None)
        self._index.remove_worker(worker_id)

    def num_hashes(self) -> int:
        return self._index.num_hashes()

    def _expire(self, now: float) -> None:
        routes = self._routes
        while routes and routes[0][0] <= now:
            expiry, worker_id, hashes = routes.popleft()
            mine = self._expiry.get(worker_id)
            if mine is None:
                continue   # worker removed
            # A block routed again later carries a later expiry: keep it.
            gone = [h for h in hashes if mine.get(h) == expiry]
            for h in gone:
                del mine[h]
            self._index.remove(worker_id, gone)

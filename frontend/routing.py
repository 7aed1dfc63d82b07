"""Adapter between the frontend's worker pool and a routing policy.

Until the KV-aware router lands this holds the least-loaded policy: the worker with the fewest
requests this frontend has in flight there (ties: round robin).
"""

from __future__ import annotations

import itertools

from runtime.errors import Unavailable


class LeastLoadedRouter:
    def __init__(self) -> None:
        self._load: dict[str, int] = {}
        self._of: dict[str, str] = {}
        self._rr = itertools.count()

    def add_worker(self, worker_id: str, info) -> None:
        self._load.setdefault(worker_id, 0)

    def remove_worker(self, worker_id: str) -> None:
        self._load.pop(worker_id, None)

    def route(self, request_id: str, block_hashes: list[int], num_prompt_tokens: int,
              candidates: list[str]) -> tuple[str, int]:
        if not candidates:
            raise Unavailable("no workers are available")
        turn = next(self._rr)
        best = min(candidates, key=lambda w: (self._load.get(w, 0), (hash(w) + turn) % len(candidates)))
        self.finished(request_id)
        self._load[best] = self._load.get(best, 0) + 1
        self._of[request_id] = best
        return best, 0

    def finished(self, request_id: str) -> None:
        w = self._of.pop(request_id, None)
        if w is not None and w in self._load:
            self._load[w] -= 1

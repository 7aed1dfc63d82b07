"""Session affinity: requests that name the same key go where the key's last request went.

The key is a client's routing hint: OpenAI's ``prompt_cache_key`` (or ``user`` when that is absent),
meaning "these requests share context". For each key the router remembers one pin: the worker its
last request went to, that request's id and its prompt's block hashes. A new request with the key
shares with that prompt its longest common prefix, found by bisection (hashes are chained, so equal
hashes at position i mean equal prefixes up to i).

The pin is a hint about the cache, not a rule: the router adds the common prefix to the pinned
worker's overlap only while the index cannot know better, i.e. while the key's last request is
still queued for prefill there (its blocks are not computed yet, so no KV event has announced them).
After that the index is authoritative (the blocks are there, or were evicted). Among workers of
equal cost the pinned one wins. So a session stays on its worker while load allows — while the
worker's queue costs less than recomputing the context elsewhere — and moves (and the pin with it)
when it does not.

Pins are kept for the ``max_keys`` most recently used keys. Pure; no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence


@dataclass(slots=True, frozen=True)
class Pin:
    worker_id: str
    request_id: str
    block_hashes: Sequence[int]

    def common_prefix(self, block_hashes: Sequence[int]) -> int:
        """Leading blocks this pin's prompt shares with ``block_hashes``."""
        a, b = self.block_hashes, block_hashes
        lo, hi = 0, min(len(a), len(b))       # a[:lo] == b[:lo]; a[hi] != b[hi] if hi < len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if a[mid - 1] == b[mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        return lo


class SessionAffinity:
    def __init__(self, max_keys: int = 65_536) -> None:
        assert max_keys > 0
        self._max_keys = max_keys
        self._pins: OrderedDict[str, Pin] = OrderedDict()

    def get(self, key: str) -> Pin | None:
        return self._pins.get(key)

    def record(self, key: str, worker_id: str, request_id: str, block_hashes: Sequence[int]) -> None:
        self._pins[key] = Pin(worker_id, request_id, block_hashes)
        self._pins.move_to_end(key)
        if len(self._pins) > self._max_keys:
            self._pins.popitem(last=False)

    def remove_worker(self, worker_id: str) -> None:
        for key in [k for k, p in self._pins.items() if p.worker_id == worker_id]:
            del self._pins[key]

    def __len__(self) -> int:
        return len(self._pins)

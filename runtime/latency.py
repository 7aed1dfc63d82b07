"""Latency over the last minute, in a form that merges across processes: log-spaced histograms.

Each frontend adds its TTFT and ITL samples to a `RollingHistogram` (a ring of sub-windows, so a
sample leaves the window within one sub-window of a minute) and publishes the window's counts to
Redis every few seconds (frontend/latency_publisher.py). The pool controller sums the counts of
every frontend and reads percentiles off the sum (`quantile_s`): percentiles of one frontend cannot
be combined, bucket counts can. Buckets grow by 10%, so a percentile is exact to within 5%, from
0.1 ms to ~10 minutes in 160 buckets. Pure: no I/O, an injected clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

MIN_S = 1e-4
RATIO = 1.1
NUM_BUCKETS = 160
_LOG_RATIO = math.log(RATIO)

Counts = dict[int, int]          # bucket index -> samples


def bucket_of(value_s: float) -> int:
    """Bucket i holds values in (MIN_S * RATIO**(i-1), MIN_S * RATIO**i]; 0 holds everything below."""
    if value_s <= MIN_S:
        return 0
    return min(math.ceil(math.log(value_s / MIN_S) / _LOG_RATIO - 1e-9), NUM_BUCKETS - 1)


def bucket_mid_s(index: int) -> float:
    """A value that stands for bucket `index`: the geometric middle of its edges."""
    return MIN_S if index == 0 else MIN_S * RATIO ** (index - 0.5)


class RollingHistogram:
    """Samples of the last `window_s` seconds, kept as `num_slots` histograms of window_s/num_slots each."""

    def __init__(self, window_s: float = 60.0, num_slots: int = 12) -> None:
        self.window_s, self._slot_s = window_s, window_s / num_slots
        self._slots: list[tuple[int, Counts]] = []      # (slot number, counts), oldest first

    def add(self, value_s: float, now: float) -> None:
        self.add_many((value_s,), now)

    def add_many(self, values_s: Iterable[float], now: float) -> None:
        slot = int(now // self._slot_s)
        if not self._slots or self._slots[-1][0] != slot:
            self._expire(now)
            self._slots.append((slot, {}))
        counts = self._slots[-1][1]
        for value_s in values_s:
            b = bucket_of(value_s)
            counts[b] = counts.get(b, 0) + 1

    def counts(self, now: float) -> Counts:
        """The window's samples, summed over its slots."""
        self._expire(now)
        return merge(c for _, c in self._slots)

    def _expire(self, now: float) -> None:
        oldest = int(now // self._slot_s) - int(round(self.window_s / self._slot_s)) + 1
        while self._slots and self._slots[0][0] < oldest:
            self._slots.pop(0)


def merge(many: Iterable[Mapping[int, int]]) -> Counts:
    out: Counts = {}
    for counts in many:
        for b, n in counts.items():
            out[int(b)] = out.get(int(b), 0) + int(n)
    return out


def total(counts: Mapping[int, int]) -> int:
    return sum(counts.values())


def quantile_s(counts: Mapping[int, int], q: float) -> float | None:
    """The q-quantile (0 < q <= 1) of the samples in `counts`, in seconds; None without samples."""
    n = total(counts)
    if n == 0:
        return None
    rank = q * n
    seen = 0
    for b in sorted(counts):
        seen += counts[b]
        if seen >= rank:
            return bucket_mid_s(b)
    return bucket_mid_s(max(counts))

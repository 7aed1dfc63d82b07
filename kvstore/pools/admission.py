"""Frequency-aware admission to the disk tier: a block seen once is not worth a disk write.

Why: most blocks of a prompt are used by one request only (the tail of a question, a one-off
document), and the disk is the narrowest pipe of the three tiers (~1.3 GB/s on the H100 machine,
against ~5 GB/s of KV an 8B model produces while prefilling at 40k tokens/s). Writing every block
would spend that bandwidth, and the disk's capacity, on blocks that never come back, and evict
those that do. A block that has been *used* twice (computed once and looked up again, or looked up
twice) has shown it recurs; that is the admission rule (TinyLFU's "admit what is more frequent",
reduced to its simplest threshold, which needs no victim comparison and so suits a tier that
evicts in LRU order).

How: a count-min sketch of block-hash sightings (``depth`` rows of ``width`` saturating 4-bit
counts kept in bytes; an estimate is the minimum over the rows, so it can only overestimate, by
collisions). Every ``10 * width`` sightings all counts are halved, so popularity fades and the
sketch stays meaningful on an endless stream. Width 2^16 x depth 4 is 256 KiB.

The caller decides what a sighting is: the tier manager records one per block of a request's
prompt when the request is admitted (once per request, not per scheduling attempt).

Plain numpy, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

# odd 64-bit multipliers, one per row (the hashes are already xxh3 values; this only decorrelates rows)
_MULTIPLIERS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                         0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x94D049BB133111EB, 0xBF58476D1CE4E5B9],
                        dtype=np.uint64)
_MAX_COUNT = 15


class FrequencySketch:
    def __init__(self, width: int = 1 << 16, depth: int = 4, reset_every: int | None = None) -> None:
        assert width > 0 and width & (width - 1) == 0, "width must be a power of two"
        assert 1 <= depth <= len(_MULTIPLIERS)
        self.width = width
        self.depth = depth
        self._shift = np.uint64(64 - (width.bit_length() - 1))
        self._mult = _MULTIPLIERS[:depth, None]
        self._rows = np.arange(depth)[:, None]
        self._counts = np.zeros((depth, width), dtype=np.uint8)
        self.reset_every = reset_every or 10 * width
        self._since_reset = 0
        self.version = 0          # bumped by every change of the counts

    @staticmethod
    def for_capacity(num_blocks: int) -> FrequencySketch:
        """A sketch sized for a tier of ``num_blocks`` (width = 4x the blocks, 4096 to 2^22)."""
        width = 1 << max(12, min(22, (4 * max(num_blocks, 1) - 1).bit_length()))
        return FrequencySketch(width)

    def add(self, hashes: Iterable[int]) -> None:
        """One sighting of each hash (a request's chained hashes are distinct, so no repeats)."""
        idx = self._index(hashes)
        if idx is None:
            return
        self.version += 1
        cur = self._counts[self._rows, idx]
        self._counts[self._rows, idx] = np.minimum(cur + 1, _MAX_COUNT)
        self._since_reset += idx.shape[1]
        if self._since_reset >= self.reset_every:
            self._counts >>= 1
            self._since_reset = 0

    def estimate(self, h: int) -> int:
        idx = self._index((h,))
        return int(self._counts[self._rows, idx].min())

    def estimates(self, hashes: Iterable[int]) -> np.ndarray:
        idx = self._index(hashes)
        return np.zeros(0, np.uint8) if idx is None else self._counts[self._rows, idx].min(axis=0)

    def _index(self, hashes: Iterable[int]) -> np.ndarray | None:
        h = np.fromiter(hashes, dtype=np.uint64)
        if h.size == 0:
            return None
        with np.errstate(over="ignore"):
            return ((h[None, :] * self._mult) >> self._shift).astype(np.intp)   # (depth, n)


class SecondHitAdmission:
    """Admit a block to disk once it has been sighted ``min_count`` times (2: the second use)."""

    def __init__(self, sketch: FrequencySketch, min_count: int = 2) -> None:
        self.sketch = sketch
        self.min_count = min_count

    def record(self, hashes: Iterable[int]) -> None:
        self.sketch.add(hashes)

    def admits(self, h: int) -> bool:
        return self.sketch.estimate(h) >= self.min_count

    def admitted(self, hashes: list[int]) -> np.ndarray:
        """``admits`` of many hashes at once (one numpy pass: what a per-step scan can afford)."""
        return self.sketch.estimates(hashes) >= self.min_count

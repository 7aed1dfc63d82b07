"""The pooled-cache oracle: how much prefix reuse one cache with the whole fleet's capacity gets.

The yardstick of issue 20. Feed it a workload's prompts in arrival order, as block hashes at the
workers' block size; it keeps ONE LRU of ``workers x blocks per worker`` blocks and counts, per
prompt, the leading blocks it already holds (a hole ends the run, as on a worker). Placement,
timing and load do not exist for it, so it is the right scale for what a router could reach, not a
strict upper bound: a router whose workers evict the globally least recently used blocks would
match it; a cache smarter than LRU, or reuse inside a burst that one LRU would have evicted, can
beat it.

What it counts, so that its figures compare with the workers':
- a hit is capped as the engine caps it: at least the prompt's last token is computed, so at most
  ``(num_tokens - 1) // block_size`` blocks hit;
- after the lookup every full block of the prompt is used: new ones are inserted, held ones move to
  the most recently used end, the prompt's head last (a worker frees a request's blocks last-first,
  so its tail is evicted before its head);
- output tokens are not inserted (no prompt of these workloads reuses them), so the oracle has a
  little more room than a fleet whose workers also cache their outputs.

Tiers: the cache is a list of levels, fastest first (``OracleTier``: a name and a capacity in
blocks). A block lives in exactly one level; a used block moves to the top; a level that overflows
demotes its least recently used blocks to the next level, and the last level drops them. A prompt's
run of leading blocks may span levels; ``observe`` returns the hit tokens found on each level.
With one level (the GPU tier) it is the plain pooled LRU; host and disk tiers are one
``OracleTier`` each when the fleet has them.

Pure Python, no I/O; it knows nothing of routers or workers.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True, slots=True)
class OracleTier:
    """One level of the pooled cache: the whole fleet's capacity on that tier, in blocks."""
    name: str
    num_blocks: int


@dataclass(slots=True)
class OracleTotals:
    """Running totals: prompt tokens seen, and hit tokens per level (the pooled cache) and with an
    unbounded cache (every block ever seen stays: the workload's own ceiling)."""
    prompt_tokens: int = 0
    hit_tokens: list[int] = field(default_factory=list)
    unbounded_hit_tokens: int = 0

    def hit_rate(self) -> float:
        return sum(self.hit_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0

    def unbounded_hit_rate(self) -> float:
        return self.unbounded_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PooledCacheOracle:
    def __init__(self, block_size: int, tiers: Sequence[OracleTier]) -> None:
        assert block_size > 0 and tiers and all(t.num_blocks > 0 for t in tiers)
        self.block_size = block_size
        self.tiers = tuple(tiers)
        self._levels: list[OrderedDict[int, None]] = [OrderedDict() for _ in tiers]
        self._seen: set[int] = set()
        self.totals = OracleTotals(hit_tokens=[0] * len(tiers))

    @classmethod
    def for_fleet(cls, block_size: int, num_workers: int, blocks_per_worker: int) -> PooledCacheOracle:
        """The GPU-only oracle of ``num_workers`` workers of ``blocks_per_worker`` blocks each."""
        return cls(block_size, [OracleTier("gpu", num_workers * blocks_per_worker)])

    def observe(self, block_hashes: Sequence[int], num_tokens: int) -> list[int]:
        """Look up one prompt, then use its blocks. Returns the hit tokens found on each level."""
        assert len(block_hashes) <= num_tokens // self.block_size
        max_hit = min(len(block_hashes), max(0, (num_tokens - 1) // self.block_size))
        hits = [0] * len(self._levels)
        for h in block_hashes[:max_hit]:
            level = self._level_of(h)
            if level < 0:
                break
            hits[level] += self.block_size
        unbounded = 0
        for h in block_hashes[:max_hit]:
            if h not in self._seen:
                break
            unbounded += self.block_size
        self._seen.update(block_hashes)
        self._use(block_hashes)
        t = self.totals
        t.prompt_tokens += num_tokens
        t.unbounded_hit_tokens += unbounded
        for i, n in enumerate(hits):
            t.hit_tokens[i] += n
        return hits

    def summary(self, prefix: str = "oracle_") -> dict:
        """The totals as JSON fields (hit rates rounded to 4 places)."""
        t = self.totals
        out = {f"{prefix}hit_rate": round(t.hit_rate(), 4),
               f"{prefix}unbounded_hit_rate": round(t.unbounded_hit_rate(), 4),
               f"{prefix}capacity_blocks": {tier.name: tier.num_blocks for tier in self.tiers}}
        if len(self.tiers) > 1:
            out[f"{prefix}hit_rate_by_tier"] = {
                tier.name: round(n / t.prompt_tokens, 4) if t.prompt_tokens else 0.0
                for tier, n in zip(self.tiers, t.hit_tokens)}
        return out

    # ---- internals -------------------------------------------------------------------------

    def _level_of(self, h: int) -> int:
        for i, level in enumerate(self._levels):
            if h in level:
                return i
        return -1

    def _use(self, block_hashes: Sequence[int]) -> None:
        top = self._levels[0]
        for h in reversed(block_hashes):        # the head ends up most recently used
            if h in top:
                top.move_to_end(h)
                continue
            for level in self._levels[1:]:
                level.pop(h, None)
            top[h] = None
        self._demote(0)

    def _demote(self, i: int) -> None:
        level, cap = self._levels[i], self.tiers[i].num_blocks
        if len(level) <= cap:
            return
        below = self._levels[i + 1] if i + 1 < len(self._levels) else None
        while len(level) > cap:
            h, _ = level.popitem(last=False)
            if below is not None:
                below[h] = None
        if below is not None:
            self._demote(i + 1)

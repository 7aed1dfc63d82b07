"""KV cache events: what a worker tells the fleet about the blocks it holds.

A worker's block pools emit these as blocks become reusable (stored), are evicted (removed) or
are all dropped (cleared). Each worker numbers its event batches 1, 2, 3, ...; a consumer that
sees a gap knows it missed something and resyncs from the worker's snapshot.

Plain data only: transport (Redis streams) lives in runtime/, consumption in router/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class Tier(IntEnum):
    """Where a block lives. Lower is faster."""
    GPU = 1    # G1: the paged device pool (host memory when the engine runs on the CPU)
    HOST = 2   # G2: pinned host RAM
    DISK = 3   # G3: local disk


@dataclass(slots=True, frozen=True)
class BlockStored:
    """Full blocks became reusable, in chain order; ``parent_hash`` precedes the first (None = root)."""
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    tier: Tier = Tier.GPU


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """Blocks are no longer reusable on this tier."""
    block_hashes: tuple[int, ...]
    tier: Tier = Tier.GPU


@dataclass(slots=True, frozen=True)
class AllCleared:
    """Every block on this tier is gone (restart, reset)."""
    tier: Tier = Tier.GPU


KvEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(slots=True)
class KvEventBatch:
    """One worker's events in order, numbered by a per-worker sequence number starting at 1."""
    worker_id: str
    seq: int
    events: list[KvEvent] = field(default_factory=list)

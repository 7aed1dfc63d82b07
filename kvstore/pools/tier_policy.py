"""Load or recompute: the cost model that decides how much of a lower-tier prefix hit to onboard.

Pure: numbers in, a decision out; no clocks, no I/O (the tier manager feeds it measured rates).

A request's prompt has ``g1`` leading blocks in the device pool, then a run of blocks each found
in the host tier (G2) or on disk (G3): ``hit_tiers``. Loading must be a prefix (the KV of block i
is only usable with blocks 0..i-1), so the choice is how many of the run to load, k; the rest of
the prompt is recomputed. Per block of the run:

    load_s(block)      = block_bytes / rate(G2 -> G1)                               (a host hit)
                       = block_bytes / rate(G3 -> G2) + block_bytes / rate(G2 -> G1) (a disk hit)
    recompute_s(block) = block_size / prefill_tokens_per_s
                         + attn_pair_s * block_size * (start + block_size / 2)

plus one fixed latency per load, by the slowest tier it reads (``TierRates.host_load_s`` /
``disk_load_s``): what a load costs beyond its bytes, end to end (a disk read's set-up, the I/O
thread's hand-off, the step-loop round trips before the request runs). It decides short hits: on the
H100 an fp8 1k-token prefix from disk was predicted by bandwidth alone to load in less than its
25.7 ms of recompute and took 63 ms (docs/kv_tiers.md). ``auto`` picks the k with
the smallest load_s(k) - saved_s(k) (ties: fewer loaded: loading must win to be chosen), so a hit
is loaded only when loading is predicted to be faster than recomputing it. ``always`` loads every
hit (so CPU tests drive every path). The attention term matters: prefill slows as the context
grows (perf/profile.py's CurveTiming has per_attn_pair_s = 1.3 ns for an 8B on an H100), which
is where a slow disk starts to pay.

Rates are ``PathRate``s kept by ``RateMeter``s: seeded by a short probe at start-up and refined by
every transfer that completes (an exponentially weighted mean of observed bytes/s), with totals of
bytes and seconds that the worker exports as metrics. The per-load latencies are ``LatencyMeter``s:
seeded by the probes' one-block latencies and refined by every load that completes (its wall time
from start to landing, less what the bandwidths account for).

Example (8B bf16 on the H100: 2 MiB blocks, prefill 40k tok/s): recomputing a block costs 0.4 ms;
loading it from pinned host RAM at 55 GB/s costs 0.04 ms (10x faster); from a 1.3 GB/s disk
1.6 ms + 0.04 ms, so a disk hit pays only where prefill is slower than ~1/4 of that speed (long
contexts, a busier GPU, or a faster disk).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvstore.events import Tier


class OnboardMode(Enum):
    AUTO = "auto"        # load a hit only when predicted faster than recomputing it
    ALWAYS = "always"    # load every hit (tests)


class TierPath(Enum):
    """A direction between two tiers; the ``path`` label of the bytes/seconds metrics."""
    G1_TO_G2 = "g1_to_g2"
    G2_TO_G1 = "g2_to_g1"
    G2_TO_G3 = "g2_to_g3"
    G3_TO_G2 = "g3_to_g2"


@dataclass(frozen=True, slots=True)
class PathRate:
    bytes_per_s: float
    latency_s: float = 0.0      # fixed cost of one transfer on this path

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s if nbytes else 0.0


@dataclass(slots=True)
class RateMeter:
    """One path's measured rate: a probe's figure refined by completed transfers (EWMA of bytes/s),
    plus the totals the metrics export."""
    rate: PathRate
    alpha: float = 0.2
    min_bytes: int = 1 << 20          # smaller transfers are latency, not bandwidth: count, don't fit
    total_bytes: int = 0
    total_s: float = 0.0
    count: int = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        self.total_bytes += nbytes
        self.total_s += seconds
        self.count += 1
        if nbytes >= self.min_bytes and seconds > 0:
            bw = self.alpha * (nbytes / seconds) + (1 - self.alpha) * self.rate.bytes_per_s
            self.rate = PathRate(bw, self.rate.latency_s)


@dataclass(slots=True)
class LatencyMeter:
    """One tier's fixed cost of a load (seconds beyond bytes / bandwidth): a probe's seed refined by
    the loads that complete (an exponentially weighted mean of their excess wall time)."""
    seconds: float
    alpha: float = 0.3
    samples: int = 0

    def seed(self, seconds: float) -> None:
        """A start-up figure; ignored once loads have been measured."""
        if self.samples == 0:
            self.seconds = seconds

    def observe(self, wall_s: float, bandwidth_s: float) -> None:
        """A load took ``wall_s`` of which the bandwidths account for ``bandwidth_s``."""
        self.seconds = (1 - self.alpha) * self.seconds + self.alpha * max(0.0, wall_s - bandwidth_s)
        self.samples += 1


@dataclass(frozen=True, slots=True)
class PrefillSpeed:
    """How fast the engine computes KV (the engine supplies it; a profile or a running mean)."""
    tokens_per_s: float
    attn_pair_s: float = 0.0     # seconds per (query, key) pair, for the cost that grows with context

    def seconds(self, start: int, num_tokens: int) -> float:
        return num_tokens / self.tokens_per_s + self.attn_pair_s * num_tokens * (start + num_tokens / 2)


@dataclass(frozen=True, slots=True)
class OnboardDecision:
    num_load: int                  # leading blocks of the hit run to load; the rest is recomputed
    load_s: float                  # predicted seconds to load them
    recompute_s: float             # predicted seconds to recompute those same blocks instead
    num_host: int = 0              # of num_load, blocks coming from the host tier
    num_disk: int = 0              # ... from disk


@dataclass(frozen=True, slots=True)
class TierRates:
    g2_to_g1: PathRate
    g3_to_g2: PathRate | None = None
    host_load_s: float | None = None   # fixed cost of one load from host RAM (None: the path latency)
    disk_load_s: float | None = None   # ... of one that reads disk (None: both paths' latencies)

    def load_latency_s(self, tier: Tier) -> float:
        """The fixed cost of one load whose slowest source is ``tier``."""
        if tier == Tier.DISK:
            assert self.g3_to_g2 is not None, "a disk hit without a disk rate"
            return self.disk_load_s if self.disk_load_s is not None else \
                self.g3_to_g2.latency_s + self.g2_to_g1.latency_s
        return self.host_load_s if self.host_load_s is not None else self.g2_to_g1.latency_s

    def block_load_s(self, tier: Tier, block_bytes: int) -> float:
        """Bandwidth part of loading one block from ``tier`` (the latency is per load)."""
        s = block_bytes / self.g2_to_g1.bytes_per_s
        if tier == Tier.DISK:
            assert self.g3_to_g2 is not None, "a disk hit without a disk rate"
            s += block_bytes / self.g3_to_g2.bytes_per_s
        return s


def decide_onboard(hit_tiers: Sequence[Tier], first_block: int, block_bytes: int, block_size: int,
                   rates: TierRates, prefill: PrefillSpeed, mode: OnboardMode) -> OnboardDecision:
    """How many of the hit run's leading blocks to load (see the module docstring).

    ``hit_tiers[j]`` is where block ``first_block + j`` of the prompt is (HOST or DISK); blocks
    before ``first_block`` are already in the device pool.
    """
    best_k, best_net = 0, 0.0
    load = recompute = 0.0
    slowest = Tier.HOST
    loads, recomputes = [0.0], [0.0]
    for j, tier in enumerate(hit_tiers):
        load += rates.block_load_s(tier, block_bytes)
        if tier == Tier.DISK:
            slowest = Tier.DISK
        recompute += prefill.seconds((first_block + j) * block_size, block_size)
        loads.append(load + rates.load_latency_s(slowest))
        recomputes.append(recompute)
        net = loads[-1] - recompute
        if net < best_net:
            best_k, best_net = j + 1, net
    k = len(hit_tiers) if mode == OnboardMode.ALWAYS else best_k
    num_disk = sum(1 for t in hit_tiers[:k] if t == Tier.DISK)
    return OnboardDecision(k, loads[k], recomputes[k], k - num_disk, num_disk)


@dataclass(slots=True)
class OnboardCounters:
    """Both choices, in blocks, by the tier the hit was in (the metrics' labels)."""
    loaded: dict[Tier, int] = field(default_factory=lambda: {Tier.HOST: 0, Tier.DISK: 0})
    recomputed: dict[Tier, int] = field(default_factory=lambda: {Tier.HOST: 0, Tier.DISK: 0})
    requests_loaded: int = 0
    requests_recomputed: int = 0    # requests with a lower-tier hit that loaded none of it

    def count(self, hit_tiers: Sequence[Tier], decision: OnboardDecision) -> None:
        for j, t in enumerate(hit_tiers):
            (self.loaded if j < decision.num_load else self.recomputed)[t] += 1
        if hit_tiers:
            if decision.num_load:
                self.requests_loaded += 1
            else:
                self.requests_recomputed += 1

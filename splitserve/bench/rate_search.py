"""The search behind `splitserve bench goodput`: which request rate to try next, and when to stop.

A pure state machine over (rate, passed) observations, where "passed" means the share of requests
that met both latency targets at that rate reached the goal. Attainment falls as the rate rises, so
the search first brackets the goodput — doubling the rate from the start while it passes, halving
it while it fails — then bisects the bracket [highest passing rate, lowest failing rate] until it
is narrower than `precision` times its lower end. It stops, with its reason, when:

- `converged`: the bracket is that narrow; the goodput is its lower end;
- `max_rate`: the rate passed at `max_rate` (the goodput is at least that);
- `min_rate`: even `min_rate` failed (the goodput is below it; reported as 0);
- `max_probes`: the probe budget ran out (the goodput is the highest rate that passed so far).

It knows nothing of servers, requests or clocks; the command (goodput.py) measures each rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class StopReason(str, Enum):
    CONVERGED = "converged"
    MAX_RATE = "max_rate"
    MIN_RATE = "min_rate"
    MAX_PROBES = "max_probes"
    TIME_BUDGET = "time_budget"       # set by the command, which owns the clock
    UNATTAINABLE = "unattainable"     # set by the command: an idle server already misses the targets


@dataclass(frozen=True, slots=True)
class SearchLimits:
    start_rate: float          # requests/s of the first probe
    min_rate: float            # halving stops here
    max_rate: float            # doubling stops here
    precision: float = 0.1     # stop when (fail - pass) <= precision * pass
    max_probes: int = 12

    def __post_init__(self) -> None:
        rates = (self.start_rate, self.min_rate, self.max_rate)
        if not all(math.isfinite(r) and r > 0 for r in rates):
            raise ValueError(f"request rates must be finite and > 0, got {rates}")
        if self.min_rate > self.max_rate:
            raise ValueError(f"the minimum rate {self.min_rate} exceeds the maximum {self.max_rate}")
        if not 0 < self.precision < 1:
            raise ValueError(f"the precision must lie in (0, 1), got {self.precision}")
        if self.max_probes < 1:
            raise ValueError(f"at least one probe is needed, got {self.max_probes}")


def _round(rate: float) -> float:
    """Four significant digits: rates in the JSON read cleanly, and a bisection step is never lost."""
    return float(f"{rate:.4g}")


class RateSearch:
    """Doubling / halving to a bracket, then bisection (see the module docstring)."""

    def __init__(self, limits: SearchLimits) -> None:
        self.limits = limits
        self.passed: float | None = None      # the highest rate that passed
        self.failed: float | None = None      # the lowest rate that failed
        self.tried: list[tuple[float, bool]] = []
        self.stop_reason: StopReason | None = None

    @property
    def goodput(self) -> float:
        """The highest rate that passed (0 when none did)."""
        return self.passed or 0.0

    def next_rate(self) -> float | None:
        """The next rate to probe, or None once the search has stopped (see `stop_reason`)."""
        if self.stop_reason is not None:
            return None
        lim = self.limits
        if not self.tried:
            return _round(min(max(lim.start_rate, lim.min_rate), lim.max_rate))
        if len(self.tried) >= lim.max_probes:
            return self._stop(StopReason.MAX_PROBES)
        lo, hi = self.passed, self.failed
        if hi is None:
            return self._stop(StopReason.MAX_RATE) if lo >= lim.max_rate else _round(min(2 * lo, lim.max_rate))
        if lo is None:
            return self._stop(StopReason.MIN_RATE) if hi <= lim.min_rate else _round(max(hi / 2, lim.min_rate))
        mid = _round((lo + hi) / 2)
        if hi - lo <= lim.precision * lo or mid in (lo, hi):
            return self._stop(StopReason.CONVERGED)
        return mid

    def record(self, rate: float, passed: bool) -> None:
        """What the probe at `rate` found. Every rate `next_rate` gives lies outside the bracket on
        its open side or inside it, so observations never contradict one another."""
        self.tried.append((rate, passed))
        if passed:
            self.passed = rate if self.passed is None else max(self.passed, rate)
        else:
            self.failed = rate if self.failed is None else min(self.failed, rate)

    def stop(self, reason: StopReason) -> None:
        """End the search for a reason the command owns (its time budget, an unattainable target)."""
        self.stop_reason = reason

    def _stop(self, reason: StopReason) -> None:
        self.stop_reason = reason
        return None

"""Correction factors: how far observed latencies are from what the model predicted.

A `Correction` is the geometric running mean of observed / predicted over the intervals that
carried enough signal, clamped to [low, high] (beyond that the model is wrong, not off). Both
sides are compared to the *uncorrected* model, so the factor is a plain weighted mean of the
ratios and converges to their typical value when it is stable: weight w forgets an old interval
by (1 - w) each step (w = 0.2: half the weight is on the last 3 intervals).

`floor` regularises ratios of small numbers: (observed + floor) / (predicted + floor), so waits far
below anything that matters pull the factor back to 1 instead of to noise.

A `MissLift` is the other kind of correction: not of a latency the model predicts, but of the
misses a pool is observed to cause, which lift the pool whatever the model says (its docstring).

It knows nothing of what it corrects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

CORRECTION_WEIGHT = 0.2
CORRECTION_BOUNDS = (0.25, 4.0)


@dataclass(slots=True)
class Correction:
    weight: float = CORRECTION_WEIGHT
    low: float = CORRECTION_BOUNDS[0]
    high: float = CORRECTION_BOUNDS[1]
    value: float = 1.0
    updates: int = 0

    def update(self, observed: float, predicted: float, floor: float = 0.0) -> float:
        """Fold in one interval's observed and predicted value; returns the new factor."""
        if not (math.isfinite(observed) and math.isfinite(predicted)):
            return self.value
        num, den = observed + floor, predicted + floor
        if num <= 0 or den <= 0:
            return self.value
        ratio = min(max(num / den, self.low), self.high)
        log = (1 - self.weight) * math.log(self.value) + self.weight * math.log(ratio)
        self.value = min(max(math.exp(log), self.low), self.high)
        self.updates += 1
        return self.value


# ---- the closed loop on misses ------------------------------------------------------------------

LIFT_STEP = 0.25        # each interval of significant misses raises a pool's lift by a quarter ...
LIFT_MAX = 4.0          # ... up to 4x its planned load
LIFT_DECAY = 0.2        # an agreeing interval takes a fifth of the lift above 1 back (half in about 3)
LIFT_MIN_GAIN = 0.25    # a lift that more workers served must cut the miss share by a quarter to rise again
MISS_Z = 2.0            # misses count when above the allowance by two binomial standard deviations


def significant_misses(num: int, missed: int, allowance: float) -> bool:
    """More misses among `num` requests than a pool meeting its allowed share would show, beyond
    noise: above num * a + MISS_Z sqrt(num * a (1 - a)), and at least two."""
    expected = num * allowance
    return missed >= 2 and missed > expected + MISS_Z * math.sqrt(expected * (1 - allowance))


@dataclass(slots=True)
class MissLift:
    """A pool's closed loop on the misses it is observed to cause.

    The sizing model can be wrong in ways the latency corrections do not see (a wait it does not
    model, a burst shorter than a start-up). When an interval's observed misses of the pool's
    target are significantly above its allowance, the pool is lifted whatever the model says: its
    planned load is multiplied by `value` (raised by LIFT_STEP), and it may not go below one more
    worker than served that interval (`floor`). The lift is undone only when the model's own
    prediction agrees again: in an interval where the pool met its target and the model, without
    the lift, predicted that it would at the load and the workers it had, `value` loses LIFT_DECAY
    of its excess over 1 and the floor goes. An interval where the model predicts misses the pool
    did not have leaves the lift as it is (the model asks for more workers anyway).

    A lift must earn the next one: when the misses go on while more workers serve each request
    judged than at the last lift (more workers, not just more load), and their share has not
    fallen by LIFT_MIN_GAIN of what it was then, more workers are not what removes them (prompts
    that miss behind one another whatever the pool's size, a wait in another pool), and the lift
    stays where it is instead of rising (`futile` counts those intervals). In a burst the load
    rises with the pool, and the lift keeps rising with it."""
    value: float = 1.0
    floor: int = 0
    lifts: int = 0
    judge_gain: bool = True     # whether a lift must cut the misses to rise again (below)
    futile: int = 0
    _share: float = -1.0        # the miss share of the last lift in this run of misses (-1: none)
    _served: float = 0.0        # the workers that served then, per request judged

    def observe(self, num: int, missed: int, allowance: float, served: int, model_meets: Callable[[], bool],
                min_records: int) -> None:
        """One interval: `num` requests judged, `missed` of them missed, `served` ready workers;
        `model_meets()` asks the model (asked only when the pool met its target)."""
        if num < min_records:
            return
        if significant_misses(num, missed, allowance):
            share, per_request = missed / num, served / num
            more_workers = self._share >= 0 and per_request > self._served
            if self.judge_gain and more_workers and share > self._share * (1 - LIFT_MIN_GAIN):
                self.futile += 1
                return
            self.value = min(self.value * (1 + LIFT_STEP), LIFT_MAX)
            self.floor = max(self.floor, served + 1)
            self.lifts += 1
            self._share, self._served = share, per_request
            return
        self._share = -1.0
        if model_meets():
            self.relax()

    def relax(self) -> None:
        """One interval's undoing: `value` loses LIFT_DECAY of its excess over 1, the floor goes."""
        self._share = -1.0
        self.value = 1 + (self.value - 1) * (1 - LIFT_DECAY)
        if self.value < 1.01:
            self.value = 1.0
        self.floor = 0

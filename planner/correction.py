"""Correction factors: how far observed latencies are from what the model predicted.

A `Correction` is the geometric running mean of observed / predicted over the intervals that
carried enough signal, clamped to [low, high] (beyond that the model is wrong, not off). Both
sides are compared to the *uncorrected* model, so the factor is a plain weighted mean of the
ratios and converges to their typical value when it is stable: weight w forgets an old interval
by (1 - w) each step (w = 0.2: half the weight is on the last 3 intervals).

`floor` regularises ratios of small numbers: (observed + floor) / (predicted + floor), so waits far
below anything that matters pull the factor back to 1 instead of to noise.

It knows nothing of what it corrects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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

"""Load predictors: the next intervals' arrival count, as a mean and a spread.

Each predictor eats one number per planner interval (requests that arrived in it) and forecasts
`steps` intervals ahead as a `Forecast(mean, sd)`; the planner sizes on a quantile of it. All share
one error model: the spread at h steps ahead is an exponentially weighted mean of the squared
errors of the forecasts it made h steps ahead, each error counted at most ERROR_CAP spreads (a
lone burst's error, squared, would otherwise hold the spread, and the planned rate, at several
times the level for ten intervals: the prefill pool's swings, docs/planner.md "When the planner
misses"), never below the one-step spread nor the Poisson spread of the forecast count (variance
= mean). A burst that recurs keeps widening it, three spreads at a time. Measured, not
extrapolated: each model's own
formula for how the spread grows (Hyndman et al., "Forecasting with Exponential Smoothing",
ch. 6) assumes the series moves the way the model does, so on a series whose one-step errors are
mostly sampling noise (which does not add up over the horizon) it widens the far forecasts for
nothing. The formula only bridges the horizons without 1 / ERROR_WEIGHT errors of their own
(from the farthest one that has them):

- `ConstantPredictor`: the last count (a random walk): sd_h = sd * sqrt(h).
- `EwmaPredictor(alpha)`: simple exponential smoothing: sd_h = sd * sqrt(1 + (h - 1) alpha^2).
- `HoltPredictor(alpha, beta, phi)`: level + damped trend (Gardner & McKenzie):
  mean_h = level + (phi + ... + phi^h) trend;
  sd_h^2 = sd^2 (1 + sum_{j<h} (alpha (1 + beta (phi + ... + phi^j)))^2).

`warm_start(history)` runs a predictor over past counts (from a trace, or the previous run), so
the first decisions start from a level, a trend and an error scale. `backtest` replays a series
and measures what the planner relies on (docs/planner.md has the table and the choice).

It knows nothing of requests, pools or time: one number per interval.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import NormalDist
from typing import Callable, Protocol, Sequence

from runtime.config_planner import DEFAULT_PREDICTOR, PredictorKind

ERROR_WEIGHT = 0.1   # the squared-error EWMA: the spread follows about the last 10 intervals
MEASURED_STEPS = 8   # horizons whose spread is measured (the planner's is 2 to 3 intervals)
ERROR_CAP = 3.0      # an error counts at most this many spreads (Poisson's at least) in the EWMA


@dataclass(frozen=True, slots=True)
class Forecast:
    mean: float
    sd: float

    def quantile(self, q: float) -> float:
        return max(self.mean + NormalDist().inv_cdf(q) * self.sd, 0.0)


class Predictor(Protocol):
    name: str

    def observe(self, count: float) -> None:
        """The count of the interval that just ended."""

    def forecast(self, steps: int = 1) -> Forecast:
        """The count `steps` intervals after the last observed one (steps >= 1)."""

    def warm_start(self, history: Sequence[float]) -> None:
        """Observe past counts, oldest first."""


class _Base:
    """The shared error model; subclasses define _point(steps), _update(x) and _spread(steps)."""

    name = "base"

    def __init__(self) -> None:
        self._n = 0
        # the forecasts made after each of the last MEASURED_STEPS points, for 1..MEASURED_STEPS ahead
        self._made: deque[tuple[float, ...]] = deque(maxlen=MEASURED_STEPS)
        self._sq_err = [0.0] * (MEASURED_STEPS + 1)   # [h]: mean squared error h steps ahead
        self._errors = [0] * (MEASURED_STEPS + 1)     # [h]: how many errors it has seen

    def observe(self, count: float) -> None:
        x = max(float(count), 0.0)
        # the forecast made h points ago for this one was its h-step forecast
        for h, made in enumerate(reversed(self._made), start=1):
            err = x - made[h - 1]
            self._errors[h] += 1
            # the running mean of the squared errors until there are 1 / ERROR_WEIGHT of them, then
            # the EWMA: seeding the EWMA with its first error would give that one error (made by a
            # smoother with no trend yet) ten times the weight of any later one for ten intervals
            weight = max(ERROR_WEIGHT, 1 / self._errors[h])
            if self._errors[h] * ERROR_WEIGHT > 1:
                # one error counts at most ERROR_CAP spreads: a lone burst would otherwise hold the
                # spread (and the planned rate) at several times its level for ten intervals
                cap = ERROR_CAP * ERROR_CAP * max(self._sq_err[h], made[h - 1], 1.0)
                err = math.copysign(math.sqrt(min(err * err, cap)), err)
            self._sq_err[h] = (1 - weight) * self._sq_err[h] + weight * err * err
        self._update(x)
        self._n += 1
        self._made.append(tuple(self._point(h) for h in range(1, MEASURED_STEPS + 1)))

    def warm_start(self, history: Sequence[float]) -> None:
        for x in history:
            self.observe(x)

    def forecast(self, steps: int = 1) -> Forecast:
        assert steps >= 1
        if not self._n:
            return Forecast(0.0, 0.0)
        mean = max(self._point(steps), 0.0)
        var1 = max(self._sq_err[1], mean)          # never tighter than Poisson
        # the farthest horizon up to `steps` with errors enough of its own, grown from there by
        # the model's formula (from one step while no other has enough)
        m = next((h for h in range(min(steps, MEASURED_STEPS), 1, -1)
                  if self._errors[h] * ERROR_WEIGHT >= 1), 1)
        var_m = max(self._sq_err[m], var1)         # nor tighter than one step ahead
        return Forecast(mean, math.sqrt(var_m * self._spread(steps) / self._spread(m)))

    def _point(self, steps: int) -> float:
        raise NotImplementedError

    def _update(self, x: float) -> None:
        raise NotImplementedError

    def _spread(self, steps: int) -> float:
        raise NotImplementedError


class ConstantPredictor(_Base):
    name = "constant"

    def __init__(self) -> None:
        super().__init__()
        self._last = 0.0

    def _point(self, steps: int) -> float:
        return self._last

    def _update(self, x: float) -> None:
        self._last = x

    def _spread(self, steps: int) -> float:
        return float(steps)


class EwmaPredictor(_Base):
    def __init__(self, alpha: float = 0.5) -> None:
        super().__init__()
        assert 0 < alpha <= 1
        self.alpha = alpha
        self.name = f"ewma({alpha:g})"
        self._level = 0.0

    def _point(self, steps: int) -> float:
        return self._level

    def _update(self, x: float) -> None:
        self._level = x if not self._n else self.alpha * x + (1 - self.alpha) * self._level

    def _spread(self, steps: int) -> float:
        return 1.0 + (steps - 1) * self.alpha ** 2


class HoltPredictor(_Base):
    def __init__(self, alpha: float = 0.5, beta: float = 0.2, phi: float = 0.9) -> None:
        super().__init__()
        assert 0 < alpha <= 1 and 0 <= beta <= 1 and 0 < phi <= 1
        self.alpha, self.beta, self.phi = alpha, beta, phi
        self.name = f"holt({alpha:g},{beta:g},{phi:g})"
        self._level = self._trend = 0.0

    def _damp(self, steps: int) -> float:
        """phi + phi^2 + ... + phi^steps."""
        phi = self.phi
        return float(steps) if phi == 1 else phi * (1 - phi ** steps) / (1 - phi)

    def _point(self, steps: int) -> float:
        return self._level + self._damp(steps) * self._trend

    def _update(self, x: float) -> None:
        if not self._n:
            self._level = x
            return
        prev = self._level
        self._level = self.alpha * x + (1 - self.alpha) * (prev + self.phi * self._trend)
        self._trend = self.beta * (self._level - prev) + (1 - self.beta) * self.phi * self._trend

    def _spread(self, steps: int) -> float:
        a, b = self.alpha, self.beta
        return 1.0 + sum((a * (1 + b * self._damp(j))) ** 2 for j in range(1, steps))


PREDICTORS: dict[PredictorKind, Callable[[], Predictor]] = {
    PredictorKind.CONSTANT: ConstantPredictor,
    PredictorKind.EWMA: EwmaPredictor,
    PredictorKind.HOLT: HoltPredictor,
}
assert set(PREDICTORS) == set(PredictorKind)


def make_predictor(name: str = DEFAULT_PREDICTOR) -> Predictor:
    """A predictor by name (a PredictorKind: constant, ewma, holt), or with parameters: ewma(0.3),
    holt(0.5,0.2,0.9). ValueError for anything else."""
    if not isinstance(name, str):
        raise ValueError(f"a predictor is a name, got {type(name).__name__} {name!r}")
    base, _, params = name.partition("(")
    try:
        factory = PREDICTORS[PredictorKind(base.strip())]
    except ValueError:
        raise ValueError(f"unknown predictor {name!r}; use one of {', '.join(PREDICTORS)}") from None
    if not params:
        return factory()
    try:
        args = [float(x) for x in params.rstrip(")").split(",") if x.strip()]
        return factory(*args)
    except (TypeError, ValueError, AssertionError):
        raise ValueError(f"bad predictor parameters in {name!r}") from None


# ---- backtest ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class BacktestResult:
    predictor: str
    points: int
    mae_1: float          # mean |error| one interval ahead, relative to the series mean
    mae_h: float          # the same `horizon` intervals ahead
    peak_coverage: float  # share of times the planned count covered the peak of the next h
    overprovision: float  # mean planned count / realised peak - 1, over the same windows
    pinball: float        # quantile loss of the plan against the realised peak, / the series mean:
                          # what the default is chosen by (it weighs a shortfall q / (1 - q) times
                          # an excess, as planning on the q quantile means)


def backtest(series: Sequence[float], make: Callable[[], Predictor], horizon: int,
             warmup: int = 4, quantile: float = 0.9) -> BacktestResult:
    """Replay `series` (counts per interval): after `warmup` points, at every point forecast 1 and
    `horizon` intervals ahead, and plan as the planner does (the worst quantile over 1..horizon)."""
    p = make()
    p.warm_start(series[:warmup])
    err1, errh, covered, over, loss = [], [], [], [], []
    for t in range(warmup, len(series)):
        err1.append(abs(p.forecast(1).mean - series[t]))
        if t + horizon - 1 < len(series):
            errh.append(abs(p.forecast(horizon).mean - series[t + horizon - 1]))
            plan = max(p.forecast(h).quantile(quantile) for h in range(1, horizon + 1))
            peak = max(series[t:t + horizon])
            covered.append(plan >= peak)
            loss.append(quantile * (peak - plan) if peak > plan else (1 - quantile) * (plan - peak))
            if peak > 0:
                over.append(plan / peak - 1)
        p.observe(series[t])
    mean = sum(series) / len(series) if series else 1.0

    def avg(xs: list) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    return BacktestResult(p.name, len(err1), avg(err1) / mean, avg(errh) / mean, avg(covered), avg(over),
                          avg(loss) / mean)

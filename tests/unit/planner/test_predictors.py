"""Load predictors: sane forecasts on series whose answer is known, and the backtest's arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.predictors import (MEASURED_STEPS, ConstantPredictor, EwmaPredictor, HoltPredictor, backtest,
                                make_predictor)


@pytest.mark.parametrize("name", ["constant", "ewma", "holt", "ewma(0.3)", "holt(0.4,0.1,0.95)"])
def test_a_flat_series_is_forecast_flat_with_at_least_poisson_spread(name):
    p = make_predictor(name)
    p.warm_start([100.0] * 30)
    for h in (1, 4):
        f = p.forecast(h)
        assert f.mean == pytest.approx(100.0)
        assert f.sd >= math.sqrt(100.0) - 1e-9          # never tighter than Poisson
    assert p.forecast(4).sd >= p.forecast(1).sd        # spread grows with the horizon
    assert p.forecast(1).quantile(0.9) > 100.0


def test_the_trend_model_follows_a_ramp_that_the_level_models_lag():
    ramp = [100.0 + 10 * t for t in range(40)]
    holt, ewma, const = HoltPredictor(0.5, 0.2, 1.0), EwmaPredictor(0.5), ConstantPredictor()
    for p in (holt, ewma, const):
        p.warm_start(ramp)
    truth = 100.0 + 10 * 43                              # 4 intervals after the last point
    assert abs(holt.forecast(4).mean - truth) < 2
    assert abs(ewma.forecast(4).mean - truth) > 40
    assert const.forecast(4).mean == ramp[-1]


def test_damping_bounds_the_trend():
    p = HoltPredictor(0.5, 0.2, 0.5)
    p.warm_start([100.0 + 10 * t for t in range(40)])
    assert p.forecast(50).mean - p.forecast(4).mean < 15   # the damped sum converges


def test_warm_start_is_observing_in_order():
    a, b = make_predictor("holt"), make_predictor("holt")
    series = [50, 60, 55, 80, 90, 70]
    a.warm_start(series)
    for x in series:
        b.observe(x)
    assert a.forecast(3) == b.forecast(3)


def test_names_and_bad_names():
    assert make_predictor("ewma(0.25)").name == "ewma(0.25)"
    for bad in ("prophet", "ewma(2)", "holt(a)"):
        with pytest.raises(ValueError):
            make_predictor(bad)


def test_backtest_on_a_known_series():
    flat = backtest([100.0] * 20, ConstantPredictor, horizon=3, warmup=4)
    assert (flat.mae_1, flat.mae_h, flat.peak_coverage) == (0.0, 0.0, 1.0)
    assert flat.overprovision > 0                        # the p90 plan sits above the mean
    step = backtest([100.0] * 10 + [200.0] * 10, ConstantPredictor, horizon=1, warmup=4)
    assert step.points == 16
    assert step.mae_1 == pytest.approx(100.0 / 16 / 150.0)   # one miss of 100 in 16, over the mean


def test_one_burst_does_not_hold_the_spread_open(monkeypatch):
    """A lone burst's error counts at most ERROR_CAP spreads: ten intervals after it the spread is
    within a few of the noise's, where the squared error itself held it at more than ten."""
    import planner.predictors as predictors

    rng = np.random.default_rng(2)
    series = list(1000 + rng.normal(0, 30, 60)) + [3000.0] + list(1000 + rng.normal(0, 30, 10))
    quiet = make_predictor("ewma(0.5)")
    quiet.warm_start(series[:60])

    def after_burst() -> float:
        p = make_predictor("ewma(0.5)")
        p.warm_start(series)
        return p.forecast(1).sd

    capped = after_burst()
    monkeypatch.setattr(predictors, "ERROR_CAP", math.inf)
    assert capped < 3 * quiet.forecast(1).sd < after_burst() / 3


def test_the_error_model_starts_as_a_running_mean():
    """Until there are 1 / ERROR_WEIGHT errors each counts alike: one large error at the start (a
    trace that ramps up in its first interval) must not dominate the spread for ten intervals."""
    p = make_predictor("constant")
    p.warm_start([0.0, 100.0] + [100.0] * 9)        # errors: 100, then nine zeros
    assert p.forecast(1).sd == pytest.approx(math.sqrt(100.0 * 100.0 / 10))


@pytest.mark.parametrize("name", ["constant", "ewma", "holt"])
def test_the_spread_ahead_is_measured_not_extrapolated(name):
    """Sampling noise does not add up over the horizon; a random walk's moves do. The spread h
    steps ahead follows the errors made h steps ahead, not the model's formula, once there are
    enough of them, and grows by the formula from the farthest measured horizon beyond that."""
    rng = np.random.default_rng(1)
    noise = list(1000 + rng.normal(0, 100, 300))
    walk = list(1000 + np.cumsum(rng.normal(0, 100, 300)))
    flat, moving = make_predictor(name), make_predictor(name)
    flat.warm_start(noise)
    moving.warm_start(walk)
    assert flat.forecast(3).sd == pytest.approx(flat.forecast(1).sd)   # floored at one step ahead
    assert moving.forecast(3).sd > 1.6 * moving.forecast(1).sd
    ratio = make_predictor(name)._spread(12) / make_predictor(name)._spread(MEASURED_STEPS)
    assert flat.forecast(12).sd == pytest.approx(flat.forecast(MEASURED_STEPS).sd * math.sqrt(ratio))
    early = make_predictor(name)
    early.warm_start(noise[:8])              # 7 one-step errors, 6 two-step: the formula bridges
    assert early.forecast(2).sd == pytest.approx(early.forecast(1).sd * math.sqrt(early._spread(2)))

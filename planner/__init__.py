"""SLA planner: sizes the prefill and decode pools from load, a profile and latency targets.

The core (planner/core.py) is pure: `Planner.decide(Observation) -> Decision`. The live loop, the
simulator (sim/plan) and the tests all drive it the same way.
"""

from planner.config import PlannerConfig, PoolLimits
from planner.core import Planner
from planner.decision import (Bound, DecodeStats, Decision, LoadEstimate, Observation, Outcomes, Pool, PoolDecision,
                              PoolState, PrefillRecord, RequestSample)
from planner.predictors import DEFAULT_PREDICTOR, Forecast, Predictor, backtest, make_predictor

__all__ = ["Bound", "DEFAULT_PREDICTOR", "DecodeStats", "Decision", "Forecast", "LoadEstimate", "Observation", "Outcomes",
           "Planner", "PlannerConfig", "Pool", "PoolDecision", "PoolLimits", "PoolState", "PrefillRecord",
           "Predictor", "RequestSample", "backtest", "make_predictor"]

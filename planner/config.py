"""The planner's configuration: targets, limits and the few constants of its control loop.

Plain frozen data; `splitserve bench plan` (and later `splitserve planner`) mirror its fields as
flags. The default of every constant is argued in docs/planner.md, none fitted to a trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.predictors import DEFAULT_PREDICTOR
from runtime.config import PLANNER_INTERVAL_S
from perf.profile import DEFAULT_STARTUP_S


@dataclass(frozen=True, slots=True)
class PoolLimits:
    min_workers: int = 1
    max_workers: int = 64


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    ttft_target_s: float
    itl_target_s: float                   # the target for each request's mean inter-token latency
    attainment_goal: float = 0.99         # share of requests that meet both targets
    interval_s: float = PLANNER_INTERVAL_S  # one decision per interval
    startup_s: float = DEFAULT_STARTUP_S  # a new worker's start-to-ready: the planning horizon
    prefill: PoolLimits = field(default_factory=PoolLimits)
    decode: PoolLimits = field(default_factory=PoolLimits)
    gpu_budget: int | None = None         # workers of both pools, draining ones included
    predictor: str = DEFAULT_PREDICTOR
    arrival_quantile: float = 0.9         # plan on this quantile of the predicted arrivals
    hysteresis: float = 0.1               # scale down only to what load * (1 + this) needs
    prefill_down_delay_s: float = 0.0     # ... and was needed all along this window: prefill (none: the
    #                                       margin alone; docs/planner.md "The core" step 5 says why) ...
    decode_down_delay_s: float | None = None  # ... and decode (None: startup_s)
    num_samples: int = 4096               # recent requests that make the length distribution
    min_records: int = 20                 # fewer observations than this leave a correction alone
    prefill_deadline: bool = True         # prefill workers queue in deadline order (as the planner's
    #                                       clusters run them: WorkerConfig.prefill_deadline_ms), else FIFO

    def __post_init__(self) -> None:
        if self.ttft_target_s <= 0 or self.itl_target_s <= 0 or self.interval_s <= 0:
            raise ValueError("targets and the interval must be positive")
        if not 0 < self.attainment_goal < 1 or not 0.5 <= self.arrival_quantile < 1:
            raise ValueError("attainment_goal must be in (0, 1) and arrival_quantile in [0.5, 1)")
        if (self.startup_s < 0 or self.hysteresis < 0 or self.prefill_down_delay_s < 0
                or (self.decode_down_delay_s or 0) < 0):
            raise ValueError("startup_s, hysteresis and the down delays must be >= 0")
        for limits in (self.prefill, self.decode):
            if not 0 <= limits.min_workers <= limits.max_workers:
                raise ValueError(f"bad pool limits {limits}")
        if self.gpu_budget is not None and self.gpu_budget < self.prefill.min_workers + self.decode.min_workers:
            raise ValueError("the GPU budget is below the pools' minimums")

    @property
    def pool_goal(self) -> float:
        """Each pool's share of the goal: the two may miss different requests, so each gets half
        of the allowed misses (1 - goal)."""
        return 1 - (1 - self.attainment_goal) / 2

    def down_delay(self, decode: bool) -> float:
        """Seconds a lower requirement must last before the pool shrinks. Decode's default is one
        start-up, the ski-rental break-even (idling a worker that long costs what restarting it
        would): a decode worker's sequences stay on it to their last token, so a drop the load
        takes back a decision later costs the drained tail, a start-up and the ITL of every
        sequence the survivors carry meanwhile. Prefill's default is none: a prefill worker holds
        nothing beyond a queue that clears within the TTFT target, and the hysteresis margin with
        the N/(N-1) share keeps it from flipping at a step boundary."""
        if not decode:
            return self.prefill_down_delay_s
        return self.startup_s if self.decode_down_delay_s is None else self.decode_down_delay_s

"""The planner core's configuration: the operator's planner settings in the units the core works in.

The settings are declared once, in runtime/config_planner.py (`SlaConfig`: targets in milliseconds,
flags, help, defaults; `PoolLimitsConfig`: the pools' bounds). `PlannerConfig` is their view for
the core: targets in seconds, the start-up time resolved against the profile, each pool's limits
as the controller (or `bench plan`) sets them, the prefill order as a flag. Its defaults are read
from those declarations, never written a second time; `PlannerConfig.from_settings` is the one
conversion, used by the live loop and `bench plan` alike. Plain frozen data: it knows nothing of
flags, files or the controller.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from perf.profile import DEFAULT_STARTUP_S
from planner.predictors import make_predictor
from runtime.config_planner import DEFAULT_POOL_LIMITS, PoolLimits, PoolLimitsConfig, ServingMode, SlaConfig

_DECLARED = SlaConfig()          # the declared defaults


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    ttft_target_s: float
    itl_target_s: float                   # the target for each request's mean inter-token latency
    attainment_goal: float = _DECLARED.attainment_goal    # share of requests that meet both targets
    interval_s: float = _DECLARED.interval_s              # one decision per interval
    startup_s: float = DEFAULT_STARTUP_S  # a new worker's start-to-ready: the planning horizon
    prefill: PoolLimits = field(default_factory=lambda: DEFAULT_POOL_LIMITS.prefill)
    decode: PoolLimits = field(default_factory=lambda: DEFAULT_POOL_LIMITS.decode)
    gpu_budget: int | None = _DECLARED.gpu_budget         # GPUs of both pools' workers, draining ones included
    predictor: str = _DECLARED.predictor
    arrival_quantile: float = _DECLARED.arrival_quantile  # plan on this quantile of the predicted arrivals
    hysteresis: float = _DECLARED.hysteresis              # scale down only to what load * (1 + this) needs
    prefill_down_delay_s: float = _DECLARED.prefill_down_delay_s   # ... and was needed all along this
    #                                       window: prefill (0: the margin alone; docs/planner.md "The core"
    #                                       step 5 says why) ...
    decode_down_delay_s: float | None = _DECLARED.decode_down_delay_s   # ... and decode (None: startup_s)
    num_samples: int = _DECLARED.num_samples   # recent requests that make the length distribution
    min_records: int = _DECLARED.min_records   # fewer observations than this leave a correction alone
    prefill_deadline: bool = _DECLARED.deadline_ordered   # prefill workers queue in deadline order (as the
    #                                       planner's clusters run them: WorkerConfig.prefill_deadline_ms), else FIFO
    mode: ServingMode = _DECLARED.mode    # disaggregated, aggregated (a prefill pool of 0) or auto (planner/mode.py)
    mode_switch_intervals: int = _DECLARED.mode_switch_intervals   # auto: decisions in a row the other mode must win
    prefill_gpus: int = 1                 # GPUs one prefill worker holds (its tensor-parallel size) ...
    decode_gpus: int = 1                  # ... and one decode worker: what each costs against gpu_budget

    @classmethod
    def from_settings(cls, sla: SlaConfig, profile_startup_s: float,
                      limits: PoolLimitsConfig | None = None, gpus_per_worker: tuple[int, int] = (1, 1)) -> "PlannerConfig":
        """The core's config from the declared settings: milliseconds to seconds, an unset start-up
        time to the profile's, the pools' limits (none: the declared defaults), the GPUs a prefill and
        a decode worker hold (the profile's TP sizes). ValueError for a setting the core cannot plan with."""
        limits = limits or DEFAULT_POOL_LIMITS
        return cls(
            ttft_target_s=sla.ttft_ms / 1e3, itl_target_s=sla.itl_ms / 1e3,
            attainment_goal=sla.attainment_goal, interval_s=sla.interval_s,
            startup_s=profile_startup_s if sla.startup_s is None else sla.startup_s,
            prefill=limits.prefill, decode=limits.decode, gpu_budget=sla.gpu_budget, predictor=sla.predictor,
            arrival_quantile=sla.arrival_quantile, hysteresis=sla.hysteresis,
            prefill_down_delay_s=sla.prefill_down_delay_s, decode_down_delay_s=sla.decode_down_delay_s,
            num_samples=sla.num_samples, min_records=sla.min_records,
            prefill_deadline=sla.deadline_ordered, mode=sla.mode, mode_switch_intervals=sla.mode_switch_intervals,
            prefill_gpus=gpus_per_worker[0], decode_gpus=gpus_per_worker[1])

    def __post_init__(self) -> None:
        if self.ttft_target_s <= 0 or self.itl_target_s <= 0 or self.interval_s <= 0:
            raise ValueError("targets and the interval must be positive")
        if not 0 < self.attainment_goal < 1 or not 0.5 <= self.arrival_quantile < 1:
            raise ValueError("attainment_goal must be in (0, 1) and arrival_quantile in [0.5, 1)")
        if (self.startup_s < 0 or self.hysteresis < 0 or self.prefill_down_delay_s < 0
                or (self.decode_down_delay_s or 0) < 0):
            raise ValueError("startup_s, hysteresis and the down delays must be >= 0")
        if self.num_samples < 1 or self.min_records < 1:
            raise ValueError("num_samples and min_records must be >= 1")
        for limits in (self.prefill, self.decode):
            if not 0 <= limits.min_workers <= limits.max_workers:
                raise ValueError(f"bad pool limits {limits}")
        if self.mode is not ServingMode.DISAGGREGATED and self.prefill.min_workers > 0:
            raise ValueError(f"--planner-mode {self.mode} needs the prefill pool's minimum at 0 (got "
                             f"{self.prefill.min_workers}): aggregated serving has no prefill worker")
        if self.mode_switch_intervals < 1:
            raise ValueError("mode_switch_intervals must be >= 1")
        if self.prefill_gpus < 1 or self.decode_gpus < 1:
            raise ValueError("a worker holds at least one GPU")
        if self.gpu_budget is not None and self.gpu_budget < self.min_gpus:
            raise ValueError(f"the GPU budget ({self.gpu_budget}) is below the GPUs of the pools' minimums "
                             f"({self.min_gpus})")
        make_predictor(self.predictor)        # ValueError naming the predictors for an unknown one

    @property
    def min_gpus(self) -> int:
        """The GPUs the pools' minimum sizes hold."""
        return self.prefill.min_workers * self.prefill_gpus + self.decode.min_workers * self.decode_gpus

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

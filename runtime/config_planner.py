"""The SLA planner's settings and the pools' size limits, declared once.

Every planner setting is one `arg()` field here, with its unit in its name, its default and its
help. From these declarations come the flags of `serve --planner`, `splitserve planner` and
`splitserve bench plan` (runtime/cli_args.py), the JSON config (runtime/config_file.py), the Helm
chart's `planner.config` values (tests/deploy/test_values_mirror.py keeps them equal) and the
planner core's `PlannerConfig` (planner/config.py: the same settings in seconds, its defaults read
from here). The pool limits are declared once too (`PoolLimitsConfig`), used by the pool
controller, `serve`, the chart, the planner core and `bench plan`; HARD_MAX_WORKERS bounds them all.

Pure declarations: no I/O, nothing that runs the planner. It does not know how a predictor
forecasts (planner/predictors.py) or how the core sizes a pool (planner/core.py); the defaults
are argued in docs/planner.md, none fitted to one trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from runtime.config_fields import ConfigError, arg

PLANNER_INTERVAL_S = 20.0   # one planner decision per interval (docs/planner.md "The decision interval")
HARD_MAX_WORKERS = 256      # no pool size or limit above this is accepted (bounded input)


class PrefillOrder(StrEnum):
    """The order prefill workers take their queued prompts in, which the planner sizes them for."""
    DEADLINE = "deadline"   # the oldest prompt that can still meet the TTFT target first
    FIFO = "fifo"           # arrival order


class ServingMode(StrEnum):
    """Which serving modes the planner may choose between (docs/planner.md "Aggregated or
    disaggregated"). Aggregated serving is a prefill pool of 0: every decode worker computes its
    own prompts in its decode steps."""
    DISAGGREGATED = "disaggregated"   # a prefill pool and a decode pool, each sized for its target
    AGGREGATED = "aggregated"         # no prefill pool; the decode pool sized for both targets
    AUTO = "auto"                     # whichever of the two needs fewer GPUs, switched with hysteresis


MAX_MODE_SWITCH_INTERVALS = 1000    # bounded input: a switch that waits longer than this never comes


class PredictorKind(StrEnum):
    """The load predictors (planner/predictors.py); a predictor setting is one of these names,
    optionally with parameters: `ewma(0.3)`, `holt(0.5,0.2,0.9)`."""
    CONSTANT = "constant"
    EWMA = "ewma"
    HOLT = "holt"


# Chosen by the backtest in docs/planner.md (the horizon error and the peak coverage on the Azure,
# Mooncake and a synthetic series together), not by one trace.
DEFAULT_PREDICTOR = PredictorKind.HOLT


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """One pool's bounds: no decision takes it below min_workers or above max_workers."""
    min_workers: int
    max_workers: int


@dataclass(frozen=True, slots=True)
class PoolLimitsConfig:
    """pools: the bounds each pool's size stays in"""
    min_prefill_workers: int = arg(0, "the prefill pool never shrinks below this")
    max_prefill_workers: int = arg(8, "the prefill pool never grows above this")
    min_decode_workers: int = arg(1, "the decode pool never shrinks below this")
    max_decode_workers: int = arg(8, "the decode pool never grows above this (`pools scale` beyond it is refused)")

    def __post_init__(self) -> None:
        for pool, limits in (("prefill", self.prefill), ("decode", self.decode)):
            if not 0 <= limits.min_workers <= limits.max_workers <= HARD_MAX_WORKERS:
                raise ConfigError(f"{pool} pool limits must satisfy 0 <= min <= max <= {HARD_MAX_WORKERS} "
                                  f"(got min {limits.min_workers}, max {limits.max_workers})")

    @property
    def prefill(self) -> PoolLimits:
        return PoolLimits(self.min_prefill_workers, self.max_prefill_workers)

    @property
    def decode(self) -> PoolLimits:
        return PoolLimits(self.min_decode_workers, self.max_decode_workers)


DEFAULT_POOL_LIMITS = PoolLimitsConfig()


@dataclass(frozen=True, slots=True)
class SlaConfig:
    """sla: the SLA planner's targets and control loop (planner/; docs/planner.md)"""
    ttft_ms: float = arg(1000.0, "time-to-first-token target, milliseconds")
    itl_ms: float = arg(50.0, "target for each request's mean inter-token latency, milliseconds")
    attainment_goal: float = arg(0.99, "share of requests that must meet both targets")
    interval_s: float = arg(PLANNER_INTERVAL_S, "one planner decision per interval", flag="--planner-interval-s")
    profile: str | None = arg(None, "JSON performance profile the planner sizes pools with (format 2, "
                              "`splitserve profile`); none: the shipped H100 Llama-3.1-8B one",
                              flag="--planner-profile")
    startup_s: float | None = arg(None, "a new worker's start-to-ready, the planning horizon; none: the "
                                  "profile's", flag="--planner-startup-s")
    predictor: str = arg(DEFAULT_PREDICTOR.value, "load predictor: constant, ewma[(a)] or holt[(a,b,phi)] "
                         "(holt: damped Holt)")
    arrival_quantile: float = arg(0.9, "plan on this quantile of the predicted arrivals")
    hysteresis: float = arg(0.1, "scale down only to what the load times (1 + this) needs")
    prefill_down_delay_s: float = arg(0.0, "the prefill pool scales down only to what was needed all along this "
                                      "window; 0: the hysteresis margin alone")
    decode_down_delay_s: float | None = arg(None, "the decode pool scales down only to what was needed all along "
                                            "this window; none: the start-up time")
    gpu_budget: int | None = arg(None, "GPUs the workers of both pools may hold at most (draining ones "
                                 "included; a worker holds its tensor-parallel size, from the profile); none: "
                                 "`serve` on GPUs, its GPU inventory; otherwise only the pools' limits")
    prefill_order: PrefillOrder = arg(PrefillOrder.DEADLINE, "the prefill workers' queue order the planner sizes "
                                      "for: deadline (the oldest prompt that can still meet the TTFT target first; "
                                      "serve, Ray and the Helm chart start them so with the planner) or fifo "
                                      "(arrival order; serve then starts them so)")
    mode: ServingMode = arg(ServingMode.DISAGGREGATED, "the serving mode the planner sizes for: disaggregated "
                            "(prefill and decode pools), aggregated (no prefill pool: the decode workers "
                            "compute their own prompts) or auto (whichever needs fewer GPUs, with hysteresis; "
                            "aggregated and auto need the prefill pool's minimum at 0)", flag="--planner-mode")
    mode_switch_intervals: int = arg(3, "with --planner-mode auto, switch only after the other mode has been "
                                     "cheaper at this many decisions in a row", flag="--planner-mode-switch-intervals")
    num_samples: int = arg(4096, "recent requests whose lengths make the length distribution the pools are "
                           "sized for", flag="--planner-num-samples")
    min_records: int = arg(20, "a correction (prefill compute, prefill wait, decode step against the profile) "
                           "moves only on at least this many observations in an interval",
                           flag="--planner-min-records")

    def __post_init__(self) -> None:     # a choice given as its string (code, tests) is held as the enum
        object.__setattr__(self, "prefill_order", PrefillOrder(self.prefill_order))
        object.__setattr__(self, "mode", ServingMode(self.mode))
        if not 1 <= self.mode_switch_intervals <= MAX_MODE_SWITCH_INTERVALS:
            raise ConfigError(f"mode_switch_intervals must be in 1..{MAX_MODE_SWITCH_INTERVALS} "
                              f"(got {self.mode_switch_intervals})")

    @property
    def deadline_ordered(self) -> bool:
        """The planner sizes prefill workers that queue in deadline order (and serve starts them so)."""
        return self.prefill_order is PrefillOrder.DEADLINE

    def targets(self) -> str:
        """What the planner keeps, for the startup log of serve, Ray and `splitserve planner`."""
        return (f"TTFT {self.ttft_ms:.0f} ms, ITL {self.itl_ms:.0f} ms, a decision every {self.interval_s:.0f} s, "
                f"prefill queues in {self.prefill_order} order, {self.mode} serving")

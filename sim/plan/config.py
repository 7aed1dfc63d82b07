"""The planner simulator's settings and what one run returns: plain data.

The live system's own settings (when a prompt goes to a prefill worker, how long a prefill worker
may take) default to the declared defaults in runtime/config.py, so that the simulator and a
cluster started without flags behave alike.

It knows nothing of how a run is carried out (sim/plan/simulator.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from planner import Decision
from runtime.config import FrontendConfig, WorkerConfig
from runtime.config_planner import PLANNER_INTERVAL_S
from perf.profile import DEFAULT_STARTUP_S


# TTFT beyond the prefill worker's compute in a remote prefill, on the H100 with the 8B model: the KV
# push (0.96-1.38 ms for 512-8,192 tokens) and the decode worker's first step (7.4-8.2 ms),
# bench/results/disagg_handoff-h100-run2-contiguous.jsonl (docs/disaggregation.md)
DEFAULT_HANDOFF_S = 0.009


def _default(cls, name: str):
    return next(f.default for f in fields(cls) if f.name == name)


@dataclass(frozen=True, slots=True)
class SimConfig:
    ttft_target_s: float
    itl_target_s: float
    interval_s: float = PLANNER_INTERVAL_S
    startup_s: float = DEFAULT_STARTUP_S
    seed: int = 0
    prefill_deadline_s: float | None = None    # prefill workers' queue order: None = arrival, else deadline
    # a remote prefill's first token reaches the client this long after its prefill worker computed
    # it: the KV push, the Prefill call's answer and the decode worker's first output
    handoff_s: float = DEFAULT_HANDOFF_S
    # conditional disaggregation (frontend/generate.py): a prompt goes to a prefill worker only with
    # at least this many tokens to compute and while the chosen prefill worker has at most
    # max_prefill_queue_tokens queued; otherwise its decode worker computes it
    remote_prefill_min_tokens: int = _default(FrontendConfig, "remote_prefill_min_tokens")
    max_prefill_queue_tokens: int = _default(FrontendConfig, "max_prefill_queue_tokens")
    # ... but a prompt past that gate waits at the prefill worker when computing it on the decode
    # worker would slow a step past the ITL target (perf/itl_guard.py; on in `serve --planner`)
    itl_guard: bool = True
    # the guard's rule: "step" (one step with the prompt's chunk past the target) or "budget" (local
    # prefills metered to the decode workers' slack under a mean-ITL target; perf/itl_guard.py)
    itl_guard_mode: str = "step"
    # a prefill worker refuses a prompt it expects to finish later than this (prefill_worker/admission.py)
    prefill_lease_s: float = _default(WorkerConfig, "prefill_lease_s")

    def __post_init__(self) -> None:
        if self.ttft_target_s <= 0 or self.itl_target_s <= 0 or self.interval_s <= 0:
            raise ValueError("targets and the interval must be positive")
        if self.handoff_s < 0 or self.prefill_lease_s <= 0 or self.max_prefill_queue_tokens < 0:
            raise ValueError("handoff_s and max_prefill_queue_tokens must be >= 0, prefill_lease_s > 0")


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    t_s: float
    arrivals: int
    plan_rate_rps: float
    prefill_ready: int
    prefill_active: int             # ready + starting
    decode_ready: int
    decode_active: int
    ttft_p90_s: float               # of the first tokens out in the interval (nan: none)
    itl_mean_s: float               # of the requests finished in the interval (nan: none)
    local_prefills: int = 0         # prompts of the interval's arrivals computed on a decode worker
    decode_waiting: int = 0         # requests waiting for a decode worker's KV at the interval's end


@dataclass(slots=True)
class SimResult:
    ttft_s: np.ndarray
    itl_s: np.ndarray               # mean ITL per request; nan: one output token (no ITL)
    first_token_s: np.ndarray
    cached_tokens: np.ndarray
    end_s: float
    gpu_s: float
    local_prefill: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    decode_wait_s: np.ndarray = field(default_factory=lambda: np.zeros(0))   # arrival -> a decode worker's KV
    gave_up: bool = False           # stopped early: more misses than max_misses
    scaling_actions: int = 0
    workers_started: int = 0
    max_workers: int = 0
    decisions: list[Decision] = field(default_factory=list)
    timeline: list[TimelinePoint] = field(default_factory=list)

    def ttft_ok(self, target_s: float) -> np.ndarray:
        return self.ttft_s <= target_s

    def itl_ok(self, target_s: float) -> np.ndarray:
        return np.isnan(self.itl_s) | (self.itl_s <= target_s)

    def attainment(self, ttft_s: float, itl_s: float) -> float:
        n = len(self.ttft_s)
        return float((self.ttft_ok(ttft_s) & self.itl_ok(itl_s)).mean()) if n else math.nan

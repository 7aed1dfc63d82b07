"""The planner core's plain-data boundary: what it is told every interval, and what it answers.

`Observation` goes in (built by the live loop from Redis and worker metrics, by the simulator from
its virtual pools, by tests by hand); `Decision` comes out, carrying its reasons, so that every
caller can log it (`Decision.summary()`), export it (`Decision.metrics()`) and show the last one
in `pools status`. All frozen dataclasses of numbers and enums: no live objects cross.

It knows nothing of how observations are gathered or how decisions are carried out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from runtime.config_planner import ServingMode


class Pool(Enum):
    PREFILL = "prefill"
    DECODE = "decode"


# ---- in -----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RequestSample:
    """One request that arrived in the interval: when, and its lengths in tokens. `cached_tokens`
    is its prefix-cache hit on the worker that prefilled it (0 if not known yet)."""
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PrefillRecord:
    """One prefill that finished in the interval: its queue wait and its compute time."""
    prompt_tokens: int
    cached_tokens: int
    wait_s: float
    compute_s: float


@dataclass(frozen=True, slots=True)
class DecodeStats:
    """The decode pool's steps in the interval, step-weighted over its workers."""
    num_steps: float = 0.0
    mean_batch: float = 0.0        # sequences per step
    mean_context: float = 0.0      # tokens attended per sequence
    mean_step_s: float = 0.0       # = the inter-token latency the sequences saw


@dataclass(frozen=True, slots=True)
class Outcomes:
    """The requests whose latency became known in the interval, against the targets: the closed
    loop's evidence (planner/core.py "Misses lift a pool"). TTFT is counted when the first token is
    out, among the requests whose own prefill fits the target (no pool saves the others); of its
    misses, `ttft_missed_decode` are the decode pool's to fix, not the prefill pool's: prompts a
    decode worker computed itself, and those that waited longer for a decode worker's KV than at
    a prefill worker. ITL is counted when the last token is out,
    among those with more than one output token."""
    ttft_count: int = 0
    ttft_missed: int = 0
    ttft_missed_decode: int = 0
    itl_count: int = 0
    itl_missed: int = 0


@dataclass(frozen=True, slots=True)
class PoolState:
    ready: int = 0
    starting: int = 0
    draining: int = 0              # still hold a GPU, take no new work

    @property
    def active(self) -> int:
        """Workers the pool will have once the starting ones are ready: what a decision sizes."""
        return self.ready + self.starting


@dataclass(frozen=True, slots=True)
class Observation:
    """What happened in (now_s - interval_s, now_s]. `requests` may be a sample of the arrivals;
    `num_arrivals` counts them all."""
    now_s: float
    interval_s: float
    num_arrivals: int
    prefill: PoolState
    decode: PoolState
    requests: tuple[RequestSample, ...] = ()
    prefills: tuple[PrefillRecord, ...] = ()
    decode_stats: DecodeStats = field(default_factory=DecodeStats)
    # the interval's arrival times (all, or a uniform sample), when `requests` are not the
    # interval's arrivals (live: they are the requests that finished in it); None: theirs
    arrival_times: tuple[float, ...] | None = None
    outcomes: Outcomes = field(default_factory=Outcomes)   # latencies against the targets


# ---- out ----------------------------------------------------------------------------------------

class Bound(Enum):
    """What set a pool's desired size, when it is not simply what the model requires."""
    MODEL = "model"                # the sizing model's answer at the planned load
    HYSTERESIS = "hysteresis"      # held: the load is not far enough below the next step down
    DOWN_DELAY = "down_delay"      # held: a higher requirement was seen within the down delay
    MIN = "min"
    MAX = "max"
    BUDGET = "budget"              # cut to fit the GPU budget
    LIFT = "lift"                  # held above the model by observed misses (planner/correction.py MissLift)
    MODE = "mode"                  # set by the serving mode: aggregated serving's prefill pool of 0 (planner/mode.py)
    NO_DATA = "no_data"            # nothing observed yet: keep what there is


@dataclass(frozen=True, slots=True)
class PoolDecision:
    pool: Pool
    current: int                   # ready + starting when deciding
    required: int                  # the model's answer at the planned load
    required_down: int             # its answer at the planned load * (1 + hysteresis)
    hysteresis: float              # the margin used for required_down
    desired: int
    bound: Bound
    correction: float              # the latency correction applied (1 = the profile as is)
    predicted: float               # prefill: TTFT attainment; decode: ITL (s), at `desired`
    per_worker: float              # prefill: utilisation; decode: sequences per worker
    limit: str = ""                # decode: what bounds the pool (itl | max_num_seqs: the batch; kv: the KV held)
    lift: float = 1.0              # the observed misses' lift of the planned load (1 = none)

    @property
    def delta(self) -> int:
        return self.desired - self.current


@dataclass(frozen=True, slots=True)
class LoadEstimate:
    """The load a decision planned for."""
    predictor: str
    rate_rps: float                # the predictor's mean for the next interval
    plan_rate_rps: float           # the quantile planned on, worst over the horizon
    horizon_s: float
    num_samples: int               # requests in the length distribution
    prompt_p50: float
    prompt_p90: float
    prefix_hit_rate: float         # cached / prompt tokens over the samples
    output_p50: float
    output_p90: float
    burst_prefill: float           # index of dispersion of arrivals (1 = Poisson) ...
    burst_decode: float            # ... at the prefill and decode time scales


class ModeReason(Enum):
    """Why a decision serves in its mode (planner/mode.py)."""
    FIXED = "fixed"                # the configured mode (--planner-mode disaggregated or aggregated)
    FIRST = "first"                # auto: the cheaper mode at the first decision with requests to size
    SWITCH = "switch"              # auto: the other mode won enough decisions in a row
    HOLD = "hold"                  # auto: the mode in force, the other not cheaper by the margin for long enough
    NO_DATA = "no_data"            # auto: nothing to size yet


@dataclass(frozen=True, slots=True)
class ModeDecision:
    """The serving mode a decision sizes the pools for, and the GPUs each mode needs at the planned
    load (None: not sized, e.g. the aggregated mode when the mode is fixed to disaggregated)."""
    mode: ServingMode              # AGGREGATED or DISAGGREGATED
    reason: ModeReason
    disaggregated_gpus: int | None = None   # P * prefill_gpus + D * decode_gpus
    aggregated_gpus: int | None = None      # n * decode_gpus
    streak: int = 0                # decisions in a row the other mode has been cheaper by the margin

    def summary(self) -> str:
        costs = (f", GPUs disagg {self.disaggregated_gpus} / agg {self.aggregated_gpus}"
                 if self.disaggregated_gpus is not None and self.aggregated_gpus is not None else "")
        streak = f", other cheaper {self.streak}x" if self.streak else ""
        return f"mode {self.mode.value} ({self.reason.value}{costs}{streak})"


FIXED_DISAGGREGATED = ModeDecision(ServingMode.DISAGGREGATED, ModeReason.FIXED)


@dataclass(frozen=True, slots=True)
class Decision:
    now_s: float
    prefill: PoolDecision
    decode: PoolDecision
    load: LoadEstimate
    wait_correction: float         # observed / modelled prefill queue wait
    mode: ModeDecision = FIXED_DISAGGREGATED

    @property
    def desired_prefill(self) -> int:
        return self.prefill.desired

    @property
    def desired_decode(self) -> int:
        return self.decode.desired

    def summary(self) -> str:
        """One line for logs and `pools status`."""
        def pool(d: PoolDecision) -> str:
            why = d.bound.value + (f"/{d.limit}" if d.limit else "")
            lift = f", lift {d.lift:.2f}" if d.lift != 1.0 else ""
            return (f"{d.pool.value} {d.current}->{d.desired} (req {d.required}, {why}, "
                    f"corr {d.correction:.2f}{lift})")
        ld = self.load
        return (f"t={self.now_s:.0f}s {pool(self.prefill)}; {pool(self.decode)}; "
                f"rate {ld.rate_rps:.2f} plan {ld.plan_rate_rps:.2f} req/s ({ld.predictor}), "
                f"prompt p50/p90 {ld.prompt_p50:.0f}/{ld.prompt_p90:.0f} hit {ld.prefix_hit_rate:.2f}, "
                f"ttft attain {self.prefill.predicted:.3f}, itl {self.decode.predicted * 1e3:.1f} ms"
                + ("" if self.mode == FIXED_DISAGGREGATED else f"; {self.mode.summary()}"))

    def metrics(self) -> dict[str, float]:
        """Flat gauges (Prometheus names without the splitserve_planner_ prefix)."""
        out: dict[str, float] = {"rate_rps": self.load.rate_rps, "plan_rate_rps": self.load.plan_rate_rps,
                                 "prefix_hit_rate": self.load.prefix_hit_rate,
                                 "wait_correction": self.wait_correction}
        for d in (self.prefill, self.decode):
            p = d.pool.value
            out |= {f"{p}_desired": d.desired, f"{p}_required": d.required, f"{p}_current": d.current,
                    f"{p}_correction": d.correction, f"{p}_lift": d.lift, f"{p}_predicted": d.predicted,
                    f"{p}_per_worker": d.per_worker}
        out["mode_aggregated"] = float(self.mode.mode is ServingMode.AGGREGATED)
        for name, gpus in (("disaggregated_gpus", self.mode.disaggregated_gpus),
                           ("aggregated_gpus", self.mode.aggregated_gpus)):
            if gpus is not None:
                out[name] = gpus
        return out

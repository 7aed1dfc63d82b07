"""The pool controller's decision core: desired sizes, and what to start or drain to reach them.

Pure (no I/O, no clock): the live loop (pools/controller.py), the tests and the planner's
simulator drive the same object. Per pool it holds

    target     the size without an operator's word: the start size, or what the planner decided
    override   an operator's size (`splitserve pools scale`), held until released
    min, max   bounds no decision crosses (`splitserve pools limits`), never above HARD_MAX_WORKERS

and desired = override if set, else target, within [min, max]. `plan(workers)` compares desired with
the workers a connector runs (their states joined from discovery, `WorkerView`) and returns actions:
start a worker per missing one; drain (or stop) the surplus, choosing failed ones first, then
starting ones, then the least loaded ready ones, youngest first. Draining workers are on their way
out and count for nothing; a failed worker (crash loop) keeps its place, so that a pool that cannot
start does not start ever more workers: it stays degraded until someone removes the failed one
(`splitserve workers drain ID`) or changes the size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from runtime.config_planner import HARD_MAX_WORKERS
from runtime.errors import InvalidRequest, NotFound
from runtime.lifecycle import WorkerState


class PoolName(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(slots=True)
class PoolSpec:
    target: int
    min: int                            # the limits: from ControllerConfig (runtime/config_planner.py
    max: int                            # declares their defaults), then `pools limits`
    override: int | None = None
    fixed: str | None = None            # why this pool's size cannot change (e.g. aggregated serving)
    last_decision: str = ""             # the planner's, for `pools status`

    @property
    def desired(self) -> int:
        n = self.override if self.override is not None else self.target
        return max(self.min, min(self.max, n))


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the controller sees it: a connector's handle joined with its lease."""
    name: str                            # the connector's handle (what it was launched as)
    pool: PoolName
    state: WorkerState
    load: int = 0                        # requests running + queued
    age_s: float = 0.0
    managed: bool = True                 # run by this controller's connector


@dataclass(frozen=True, slots=True)
class Start:
    pool: PoolName


@dataclass(frozen=True, slots=True)
class Drain:
    name: str


@dataclass(frozen=True, slots=True)
class Stop:
    name: str


Action = Start | Drain | Stop

_VICTIM_ORDER = {WorkerState.FAILED: 0, WorkerState.STARTING: 1, WorkerState.READY: 2}
COUNTED = frozenset(_VICTIM_ORDER)       # states that hold a place in the pool


@dataclass(slots=True)
class PoolBook:
    pools: dict[PoolName, PoolSpec] = field(default_factory=dict)

    def spec(self, pool: str) -> PoolSpec:
        try:
            return self.pools[PoolName(pool)]
        except (ValueError, KeyError):
            raise NotFound(f"no pool {pool!r} (pools: {', '.join(self.pools)})") from None

    # ---- what operators and the planner change -------------------------------------------
    def scale(self, sizes: dict[str, int]) -> None:
        """Set overrides; every size is checked before any is applied (all or nothing)."""
        specs = {pool: self.spec(pool) for pool in sizes}
        for pool, n in sizes.items():
            s = specs[pool]
            if not 0 <= n <= HARD_MAX_WORKERS:
                raise InvalidRequest(f"a pool's size is a number of workers from 0 to {HARD_MAX_WORKERS} "
                                     f"(got {n} for the {pool} pool)")
            if s.fixed and n != s.desired:
                raise InvalidRequest(f"the {pool} pool cannot be scaled: {s.fixed}")
            if n > s.max:
                raise InvalidRequest(f"{n} {pool} workers is above the {pool} pool's max of {s.max} "
                                     f"(raise it first: splitserve pools limits --{pool}-max N)")
            if n < s.min:
                raise InvalidRequest(f"{n} {pool} workers is below the {pool} pool's min of {s.min} "
                                     f"(lower it first: splitserve pools limits --{pool}-min N)")
        for pool, n in sizes.items():
            specs[pool].override = n

    def release(self, pools: list[str] | None = None) -> None:
        for pool in pools or list(self.pools):
            self.spec(pool).override = None

    def set_limits(self, pool: str, min_: int | None = None, max_: int | None = None) -> PoolSpec:
        s = self.spec(pool)
        lo = s.min if min_ is None else min_
        hi = s.max if max_ is None else max_
        if s.fixed and (lo, hi) != (s.min, s.max):
            raise InvalidRequest(f"the {pool} pool's limits cannot change: {s.fixed}")
        if not 0 <= lo <= hi <= HARD_MAX_WORKERS:
            raise InvalidRequest(f"{pool} pool limits must satisfy 0 <= min <= max <= {HARD_MAX_WORKERS} "
                                 f"(got min {lo}, max {hi})")
        if s.override is not None and not lo <= s.override <= hi:
            raise InvalidRequest(f"the {pool} pool is held at {s.override} by an override, outside min {lo} / "
                                 f"max {hi}: scale it into them or release it first (splitserve pools release)")
        s.min, s.max = lo, hi
        return s

    def set_target(self, pool: str, n: int, decision: str = "") -> None:
        """The planner's size (an override, if any, still wins)."""
        s = self.spec(pool)
        s.target = max(0, min(n, HARD_MAX_WORKERS))
        if decision:
            s.last_decision = decision

    # ---- what the connector must do ------------------------------------------------------
    def plan(self, workers: list[WorkerView]) -> list[Action]:
        actions: list[Action] = []
        for pool, spec in self.pools.items():
            mine = [w for w in workers if w.managed and w.pool == pool and w.state in COUNTED]
            missing = spec.desired - len(mine)
            if missing > 0:
                actions += [Start(pool)] * missing
            elif missing < 0:
                victims = sorted(mine, key=lambda w: (_VICTIM_ORDER[w.state], w.load, w.age_s))[:-missing]
                actions += [Stop(w.name) if w.state == WorkerState.FAILED else Drain(w.name) for w in victims]
        return actions

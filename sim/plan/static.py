"""The static baseline: the cheapest fixed prefill/decode split that reaches a given attainment,
searched with the same simulator the planner runs in.

A request meets its TTFT target or not according to the prefill pool alone (prefill is upstream
of decode), and its ITL almost only according to the decode pool (decode sees prefill only
through when first tokens come out). So the search runs the pools apart:

1. prefill only, for P workers: which requests meet the TTFT target. P_min, the least P whose
   misses fit in the allowed (1 - target) share, by doubling up from a hint and bisection;
2. decode only, fed the first-token times of the P_min run: which requests meet the ITL target.
   D_min likewise;
3. splits in order of cost P + D from P_min - 1 + D_min, each run with both pools together
   (giving up as soon as its misses exceed the allowance): the first that reaches the target
   wins. P_min - 1 is tried too because the prefill pool is not alone in deciding TTFT on the
   live request path: when it saturates, the decode workers compute the overflow, so a split one
   prefill worker short of the prefill-only bound can reach the target together (Azure x14:
   4 + 3 at 0.9983, where 4 prefill workers alone missed more than the 0.996 asked; the search
   returned 5 + 3). Further below is not searched.

`aggregated` searches the other mode: N workers and no prefill pool, each computing its prompts
in its own decode steps (the frontend's behaviour without prefill workers), the least N whose
joint run reaches the target.

A run gives up as soon as its misses exceed the allowance, so the failing probes of a bisection
cost a fraction of a run. Assumes more workers never make a pool worse (true of these pools up
to routing noise, which the final joint run checks).

It knows nothing of the planner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from perf.profile import Profile
from sim.plan.simulator import SimConfig, Simulation
from sim.workload import Workload

MAX_WORKERS = 1024


@dataclass(frozen=True, slots=True)
class StaticResult:
    prefill: int
    decode: int
    attainment: float      # of the joint run
    runs: int              # simulator runs the search took (given-up ones included)

    @property
    def workers(self) -> int:
        return self.prefill + self.decode


class StaticSearch:
    def __init__(self, workload: Workload, profile: Profile, config: SimConfig, target: float,
                 progress: bool = False) -> None:
        self.w, self.profile, self.cfg, self.target = workload, profile, config, target
        self.allowed = int(math.floor((1 - target) * len(workload) + 1e-9))
        self.progress = progress
        self.runs = 0
        self._ttft: dict[int, np.ndarray | None] = {}   # P -> TTFT met per request (None: gave up)
        self._itl: dict[int, np.ndarray | None] = {}
        self._aggregated: dict[int, float | None] = {}  # N aggregated workers -> attainment (None: short)
        self._first_token: dict[int, np.ndarray] = {}  # P -> first-token times of its run
        self._entries: np.ndarray | None = None

    def run(self, hint: tuple[int, int] = (1, 1)) -> StaticResult | None:
        p_min = self._least(self._ttft_ok, max(hint[0], 1), self._ttft)
        if p_min is None:
            return None
        self._entries = self._first_token[p_min]
        d_min = self._least(self._itl_ok, max(hint[1], 1), self._itl)
        if d_min is None:
            return None
        p_lo = max(p_min - 1, 1)
        for cost in range(p_lo + d_min, p_min + d_min + 8):
            for p in range(p_lo, cost - d_min + 1):
                d = cost - p
                joint = self._simulate(("prefill", "decode"), p, d, self.allowed)
                if joint.gave_up:
                    continue
                ok = joint.ttft_ok(self.cfg.ttft_target_s) & joint.itl_ok(self.cfg.itl_target_s)
                if ok.mean() >= self.target:
                    return StaticResult(p, d, float(ok.mean()), self.runs)
        return None

    def both_modes(self, hint: tuple[int, int] = (1, 1)) -> tuple[StaticResult | None, StaticResult | None]:
        """The cheapest split (`run`) and the fewest aggregated workers (`aggregated`, its search
        starting at the split's size, else at the hint's), either None where none reaches the target."""
        split = self.run(hint)
        return split, self.aggregated(split.workers if split else sum(hint))

    def aggregated(self, hint: int = 1) -> StaticResult | None:
        """The fewest aggregated workers (no prefill pool: each decode worker computes its prompts
        in its own steps, as the frontend does without prefill workers) whose joint run reaches the
        target: doubling up from `hint`, then bisection (None: not within MAX_WORKERS)."""
        n = self._least(self._aggregated_ok, max(hint, 1), self._aggregated)
        return None if n is None else StaticResult(0, n, self._aggregated[n], self.runs)

    def _least(self, ok, hint: int, known: dict) -> int | None:
        """The least n for which ok(n) is not None: doubling up from `hint`, then bisection
        between the largest known failure (or 0) and the smallest success. `known`: the results
        `ok` keeps (n -> None for a failure)."""
        hi = hint
        while ok(hi) is None:
            if hi >= MAX_WORKERS:
                return None
            hi = min(hi * 2, MAX_WORKERS)
        lo = max((n for n, r in known.items() if r is None and n < hi), default=0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid) is None:
                lo = mid
            else:
                hi = mid
        return hi

    def _ttft_ok(self, p: int) -> np.ndarray | None:
        if p not in self._ttft:
            r = self._simulate(("prefill",), p, 0, self.allowed)
            self._ttft[p] = None if r.gave_up else r.ttft_ok(self.cfg.ttft_target_s)
            if not r.gave_up:
                self._first_token[p] = r.first_token_s
        return self._ttft[p]

    def _itl_ok(self, d: int) -> np.ndarray | None:
        if d not in self._itl:
            r = self._simulate(("decode",), 0, d, self.allowed, entries=self._entries)
            self._itl[d] = None if r.gave_up else r.itl_ok(self.cfg.itl_target_s)
        return self._itl[d]

    def _aggregated_ok(self, n: int) -> float | None:
        if n not in self._aggregated:
            r = self._simulate(("prefill", "decode"), 0, n, self.allowed)
            met = None if r.gave_up else float((r.ttft_ok(self.cfg.ttft_target_s)
                                                & r.itl_ok(self.cfg.itl_target_s)).mean())
            self._aggregated[n] = met if met is not None and met >= self.target else None
        return self._aggregated[n]

    def _simulate(self, stages, p: int, d: int, max_misses: int | None, entries=None):
        self.runs += 1
        desc = f"static P={p}" if stages == ("prefill",) else f"static D={d}" if stages == ("decode",) \
            else f"static P={p} D={d}"
        sim = Simulation(self.w, self.profile, self.cfg, prefill_workers=p, decode_workers=d, stages=stages,
                         decode_entry_s=entries, max_misses=max_misses, progress=self.progress, desc=desc)
        return sim.run()

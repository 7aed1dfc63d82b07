"""The simulator's side of the planner: what each interval shows the planner core, and its
decisions carried out on the simulated pools.

Every `interval_s` the simulation builds the `Observation` the live loop would: the arrivals
(their lengths and prefix hits), the prefill workers' queue waits and compute times, the decode
pool's step statistics (the step time includes any prompt a decode worker prefilled locally, as
the inter-token gaps a frontend measures do) and the interval's outcomes against the targets (the
closed loop's evidence); then it resizes the pools to the decision. It also keeps the timeline
(`TimelinePoint`) a plot or a report reads.

It knows nothing of how requests move (sim/plan/simulator.py); it is a base of `Simulation`.
"""

from __future__ import annotations

import math

import numpy as np

from planner import Decision, DecodeStats, Observation, Outcomes, PoolState, PrefillRecord, RequestSample
from router import WorkerRole
from sim.plan.config import TimelinePoint
from sim.plan.decode import DecodeWorker, Kind
from sim.plan.workers import State
from sim.workload import ideal_cached_tokens


class PlannerTicks:
    """Mixed into `Simulation`, whose state (planner, pools, per-request arrays, result) it reads."""

    def _init_ticks(self, prefill_workers: int, decode_workers: int) -> None:
        self._initial = (prefill_workers, decode_workers)
        self._tick_requests: list[RequestSample] = []
        self._tick_prefills: list[PrefillRecord] = []
        self._tick_ttft: list[float] = []
        self._tick_itl: list[float] = []
        self._tick_local = 0
        self._outcome = [0, 0, 0, 0, 0]      # Outcomes' fields, in order
        self._decode_stats_seen = (0.0, 0.0, 0.0, 0.0)

    # ---- what the requests tell ------------------------------------------------------------------

    def _note_arrival(self, rid: int, kind: Kind) -> None:
        self._tick_local += kind is Kind.LOCAL
        if self.planner is not None:
            self._tick_requests.append(RequestSample(float(self.arrival[rid]), self.prompt[rid],
                                                     self.output[rid], int(self.cached[rid])))

    def _note_prefill(self, rid: int, start: float, done: float) -> None:
        queued_at = self._submitted.pop(rid, start)
        if self.planner is not None:
            self._tick_prefills.append(PrefillRecord(self.prompt[rid], int(self.cached[rid]),
                                                     start - queued_at, done - start))

    def _note_first_token(self, rid: int, ttft: float) -> None:
        self._tick_ttft.append(ttft)
        target = self.cfg.ttft_target_s
        if self.profile.prefill_s(self.prompt[rid], int(self.cached[rid])) + self.cfg.handoff_s >= target:
            return                                   # no pool can save it
        o = self._outcome
        o[0] += 1
        if ttft > target:
            o[1] += 1
            # the decode pool's: a prompt its decode worker computed for a reason of its own (too
            # short to send, or longer than any prefill queue may hold), or one that waited longer
            # for a decode worker's KV than for its prefill
            wait = float(self.decode_wait[rid])
            o[2] += bool(self.decode_owned[rid]) or (not self.local[rid] and wait > ttft - wait)

    def _note_itl(self, itl: float) -> None:
        self._tick_itl.append(itl)
        self._outcome[3] += 1
        self._outcome[4] += itl > self.cfg.itl_target_s

    # ---- the planner ---------------------------------------------------------------------------

    def _warm_start(self) -> Decision:
        """Prime the planner with the history before t = 0 and take its first decision."""
        interval = self.cfg.interval_s
        h = self.history
        if h is None or not len(h):
            obs = Observation(0.0, interval, 0, PoolState(), PoolState())
        else:
            k = np.floor(h.arrival_s / interval).astype(int)        # -1 = the last interval
            counts = np.bincount(k - k.min(), minlength=-k.min()).tolist()
            cached = ideal_cached_tokens(h)
            samples = [RequestSample(float(t), int(p), int(o), int(c))
                       for t, p, o, c in zip(h.arrival_s, h.prompt, h.output, cached)]
            last = k == -1
            self.planner.warm_start(counts[:-1], [s for s, m in zip(samples, last) if not m])
            obs = Observation(0.0, interval, counts[-1], PoolState(), PoolState(),
                              tuple(s for s, m in zip(samples, last) if m))
        first = self.planner.decide(obs)
        self.result.decisions.append(first)
        return first

    def _tick(self, t: float) -> None:
        obs_pools = {role: self._pool_state(pool) for role, pool in
                     ((WorkerRole.PREFILL, self.prefill), (WorkerRole.DECODE, self.decode))}
        stats = self._decode_stats(t)
        plan_rate = math.nan
        if self.planner is not None:
            obs = Observation(t, self.cfg.interval_s, len(self._tick_requests), obs_pools[WorkerRole.PREFILL],
                              obs_pools[WorkerRole.DECODE], tuple(self._tick_requests),
                              tuple(self._tick_prefills), stats, outcomes=Outcomes(*self._outcome))
            decision = self.planner.decide(obs)
            self.result.decisions.append(decision)
            plan_rate = decision.load.plan_rate_rps
            for role, d in ((WorkerRole.PREFILL, decision.prefill), (WorkerRole.DECODE, decision.decode)):
                if d.desired != obs_pools[role].active:
                    self.result.scaling_actions += 1
                    self._resize(role, d.desired, t)
        pre, dec = self._pool_state(self.prefill), self._pool_state(self.decode)
        self.result.timeline.append(TimelinePoint(
            t, len(self._tick_requests) if self.planner is not None else self._arrivals_between(t),
            plan_rate, pre.ready, pre.active, dec.ready, dec.active,
            float(np.percentile(self._tick_ttft, 90)) if self._tick_ttft else math.nan,
            float(np.mean(self._tick_itl)) if self._tick_itl else math.nan,
            self._tick_local, sum(len(w.waiting) for w in self.decode.values())))
        alive = sum(1 for w in self.all_workers if w.state is not State.STOPPED)
        self.result.max_workers = max(self.result.max_workers, alive)
        self._tick_requests, self._tick_prefills, self._tick_ttft, self._tick_itl = [], [], [], []
        self._tick_local, self._outcome = 0, [0, 0, 0, 0, 0]
        if self._outstanding > 0:
            self._push(t + self.cfg.interval_s, self._tick_kind, 0, 0)

    def _arrivals_between(self, t: float) -> int:
        lo, hi = np.searchsorted(self.arrival, [t - self.cfg.interval_s, t], side="right")
        return int(hi - lo)

    @staticmethod
    def _pool_state(pool: dict) -> PoolState:
        counts = [0, 0, 0, 0]
        for w in pool.values():
            counts[w.state] += 1
        return PoolState(ready=counts[State.READY], starting=counts[State.STARTING], draining=counts[State.DRAINING])

    def _decode_stats(self, t: float) -> DecodeStats:
        for w in self.decode.values():
            w.advance(t)
        total = [0.0, 0.0, 0.0, 0.0]
        for w in self.all_workers:
            if isinstance(w, DecodeWorker):
                total[0] += w.stat_steps
                total[1] += w.stat_batch
                total[2] += w.stat_ctx
                total[3] += w.stat_busy_s
        seen, self._decode_stats_seen = self._decode_stats_seen, tuple(total)
        steps, batch, ctx, busy = (a - b for a, b in zip(total, seen))
        if steps <= 0 or batch <= 0:
            return DecodeStats()
        return DecodeStats(steps, batch / steps, ctx / batch, busy / steps)

"""The planner simulator: a workload replayed on a virtual clock through simulated pools, sized
either by the planner core (the same `Planner.decide` the live loop calls) or statically.

Event-driven: the clock jumps from one event to the next (an arrival, a prefill done, a decode
sequence done, a worker ready, a planner tick); nothing is stepped per token (plansim/pools.py
says how decode advances between events). One request's life:

1. It arrives; the real router (router.Router, KV policy) picks a READY prefill worker by
   prefix overlap and queued prefill work; it waits there (in arrival order, or with
   `prefill_deadline_s` in deadline order: plansim/pools.py), then prefills the part not cached
   on that worker for the profile's time. Its first token is out: TTFT = done - arrival.
2. The worker caches the prompt's full prefix blocks (LRU, the profile's KV capacity) and tells
   the router's index, as KV events do in production.
3. The router picks a decode worker (the same cost: with remote prefill no decode worker holds
   the prefix, so it is the least loaded by KV blocks); the KV transfer is taken as instant (~850
   GB/s measured: ~2 ms for 10k tokens). It decodes the rest of the output (or waits for KV room).
   Its mean ITL = (last token - first token) / (output - 1); a one-token output meets any ITL.

Prefix blocks: the router and the caches work in the trace's 512-token blocks, with the trace's
hash ids as block hashes (ids are already prefix-unique: equal id = equal prefix). One trace block
stands for the 32 engine blocks of 16 tokens it covers, which share or differ all together, so
overlaps are the same in tokens; only a partial last block (< 512 tokens, shared only when the
ids say so) is never counted as cached: the engine could reuse up to 496 more tokens of it.
Arrivals with no ids (Azure) share nothing.

Pools start READY at t = 0 with the planner's first decision (warm-started from the history
before t = 0) or the static sizes. A new worker is READY `startup_s` after the decision that asked
for it; a removed worker is cancelled if still starting (newest first), else drained (least
loaded first): it leaves the router at once and stops when its last request is done. GPU time is
counted from a worker's start to its stop (or the end of the run), starting and draining included.

Stages: both (the normal run), prefill only (TTFT of each request; for the static search), or
decode only (requests enter decode at given first-token times).

It knows nothing of argument parsing, JSON or plots (splitserve/bench/plan.py).
"""

from __future__ import annotations

import heapq
import math
import sys
from dataclasses import dataclass, field

import numpy as np

from kvstore.events import KvEventBatch
from planner import (Decision, DecodeStats, Observation, Planner, PoolState, PrefillRecord,
                     RequestSample)
from router import NoWorkerAvailable, Router, RouterConfig, WorkerRole
from runtime.config_planner import PLANNER_INTERVAL_S
from perf.profile import DEFAULT_STARTUP_S, Profile
from sim.plan.workers import DecodeWorker, PrefillWorker, State
from sim.workload import TRACE_BLOCK_TOKENS, Workload, ideal_cached_tokens

_READY, _PREFILL_DONE, _DECODE, _TICK = range(4)
_PROGRESS_EVERY = 2048


@dataclass(frozen=True, slots=True)
class SimConfig:
    ttft_target_s: float
    itl_target_s: float
    interval_s: float = PLANNER_INTERVAL_S
    startup_s: float = DEFAULT_STARTUP_S
    seed: int = 0
    prefill_deadline_s: float | None = None    # prefill workers' queue order: None = arrival, else deadline


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    t_s: float
    arrivals: int
    plan_rate_rps: float
    prefill_ready: int
    prefill_active: int             # ready + starting
    decode_ready: int
    decode_active: int
    ttft_p90_s: float               # of the prefills done in the interval (nan: none)
    itl_mean_s: float               # of the requests finished in the interval (nan: none)


class _GaveUp(Exception):
    pass


@dataclass(slots=True)
class SimResult:
    ttft_s: np.ndarray
    itl_s: np.ndarray               # mean ITL per request; nan: one output token (no ITL)
    first_token_s: np.ndarray
    cached_tokens: np.ndarray
    end_s: float
    gpu_s: float
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


class Simulation:
    def __init__(self, workload: Workload, profile: Profile, config: SimConfig, *,
                 planner: Planner | None = None, history: Workload | None = None,
                 prefill_workers: int = 0, decode_workers: int = 0,
                 stages: tuple[str, ...] = ("prefill", "decode"),
                 decode_entry_s: np.ndarray | None = None, max_misses: int | None = None,
                 progress: bool = False, desc: str = "") -> None:
        assert set(stages) <= {"prefill", "decode"} and stages
        assert "prefill" in stages or decode_entry_s is not None
        self.w, self.profile, self.cfg = workload, profile, config
        self.planner, self.history = planner, history
        self.stages = stages
        self.decode_entry_s = decode_entry_s
        self.progress, self.desc = progress, desc
        self.now = 0.0
        # the production router's KV policy, costed with the same profile the simulated workers run on
        self.router = Router(RouterConfig(timing=profile.timing, chunk_tokens=profile.max_num_batched_tokens),
                             block_size=TRACE_BLOCK_TOKENS, seed=config.seed, clock=lambda: self.now)
        self.heap: list[tuple] = []
        self._seq = 0
        self.prefill: dict[str, PrefillWorker] = {}      # alive (not stopped)
        self.decode: dict[str, DecodeWorker] = {}
        self.all_workers: list = []
        self._num_workers = 0
        self._step_fn = profile.decode_step_fn(profile.max_num_seqs)
        self._cache_blocks = max(profile.kv_capacity_tokens // TRACE_BLOCK_TOKENS, 1)
        self._prefill_s: dict[tuple[int, int], float] = {}
        self._pending: dict[WorkerRole, list[int]] = {WorkerRole.PREFILL: [], WorkerRole.DECODE: []}
        n = len(workload)
        self.ttft = np.full(n, np.nan)
        self.itl = np.full(n, np.nan)
        self.first_token = np.full(n, np.nan) if decode_entry_s is None else decode_entry_s.astype(float)
        self.cached = np.zeros(n, dtype=np.int64)
        self.arrival = workload.arrival_s
        self.prompt = workload.prompt.tolist()
        self.output = workload.output.tolist()
        self.hashes = workload.hashes
        self._outstanding = n
        self._done = 0
        self._end = 0.0                  # the last completion
        self.result = SimResult(self.ttft, self.itl, self.first_token, self.cached, 0.0, 0.0)
        # what the current planner interval saw
        self._tick_requests: list[RequestSample] = []
        self._tick_prefills: list[PrefillRecord] = []
        self._tick_ttft: list[float] = []
        self._tick_itl: list[float] = []
        self._decode_stats_seen = (0.0, 0.0, 0.0, 0.0)
        self._initial = (prefill_workers, decode_workers)
        self._max_misses = max_misses                # give up once more requests than this miss
        self._misses = 0

    # ---- the loop -----------------------------------------------------------------------------

    def run(self) -> SimResult:
        from tqdm import tqdm

        self._start_pools()
        if "prefill" in self.stages:
            src_t, src_order = self.arrival, None
        else:
            src_order = np.argsort(self.first_token, kind="stable")
            src_t = self.first_token[src_order]
        src_t = src_t.tolist()
        src_order = src_order.tolist() if src_order is not None else None
        self._push(self.cfg.interval_s, _TICK, 0, 0)
        bar = tqdm(total=len(src_t), desc=self.desc or "simulate", unit="req", file=sys.stderr,
                   mininterval=0.5, disable=not self.progress, leave=False)
        heap, i, n = self.heap, 0, len(src_t)
        last_done = 0
        on_arrival = self._arrive if src_order is None else self._enter_decode
        try:
            while True:
                t_src = src_t[i] if i < n else math.inf
                if heap and heap[0][0] <= t_src:
                    t, _, kind, x, y = heapq.heappop(heap)
                    self.now = t
                    if kind == _DECODE:
                        self._decode_event(t, x, y)
                    elif kind == _PREFILL_DONE:
                        self._prefill_done(t, x, y)
                    elif kind == _TICK:
                        self._tick(t)
                    else:
                        self._ready(t, x)
                elif i < n:
                    self.now = t_src
                    on_arrival(t_src, i if src_order is None else src_order[i])
                    i += 1
                else:
                    break
                if self._done - last_done >= _PROGRESS_EVERY:
                    bar.update(self._done - last_done)
                    last_done = self._done
        except _GaveUp:
            self.result.gave_up = True
        bar.update(self._done - last_done)
        bar.close()
        return self._finish()

    def _miss(self) -> None:
        self._misses += 1
        if self._max_misses is not None and self._misses > self._max_misses:
            raise _GaveUp

    def _push(self, t: float, kind: int, x, y) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, kind, x, y))

    # ---- prefill ------------------------------------------------------------------------------

    def _arrive(self, t: float, rid: int) -> None:
        try:
            d = self.router.route(rid, self.hashes[rid] if self.hashes is not None else (),
                                  self.prompt[rid], WorkerRole.PREFILL)
        except NoWorkerAvailable:
            self._pending[WorkerRole.PREFILL].append(rid)
            return
        self._start_prefill(t, rid, d.worker_id, d.overlap_blocks)

    def _start_prefill(self, t: float, rid: int, wid: str, overlap_blocks: int) -> None:
        prompt = self.prompt[rid]
        cached = min(overlap_blocks * TRACE_BLOCK_TOKENS, prompt - 1)
        key = (prompt, cached)
        service = self._prefill_s.get(key)
        if service is None:
            service = self._prefill_s[key] = self.profile.prefill_s(prompt, cached)
        w = self.prefill[wid]
        self.cached[rid] = cached
        if self.planner is not None:
            self._tick_requests.append(RequestSample(float(self.arrival[rid]), prompt, self.output[rid], cached))
        started = w.submit(t, rid, float(self.arrival[rid]), service)
        if started is not None:
            self._begin_prefill(wid, *started)

    def _begin_prefill(self, wid: str, rid: int, start: float, done: float) -> None:
        self._push(done, _PREFILL_DONE, rid, wid)
        if self.planner is not None:
            self._tick_prefills.append(PrefillRecord(self.prompt[rid], int(self.cached[rid]),
                                                     start - float(self.arrival[rid]), done - start))

    def _prefill_done(self, t: float, rid: int, wid: str) -> None:
        w = self.prefill.get(wid)
        self.router.finished(rid, wid)
        if w is not None:
            w.in_flight -= 1
            started = w.next(t)
            if started is not None:
                self._begin_prefill(wid, *started)
            if self.hashes is not None:
                full = self.hashes[rid][: self.prompt[rid] // TRACE_BLOCK_TOKENS]
                events = w.store(full)
                if events and w.state is not State.DRAINING:
                    w.seq += 1
                    self.router.apply_events(KvEventBatch(wid, w.seq, events))
            if w.state is State.DRAINING and not w.in_flight:
                self._stop(w, t)
        self.ttft[rid] = ttft = t - self.arrival[rid]
        self.first_token[rid] = t
        self._tick_ttft.append(ttft)
        if ttft > self.cfg.ttft_target_s:
            self._miss()
        if self.output[rid] > 1 and "decode" in self.stages:
            self._enter_decode(t, rid)
        else:
            self._complete(rid)

    # ---- decode -------------------------------------------------------------------------------

    def _enter_decode(self, t: float, rid: int) -> None:
        if self.output[rid] <= 1:
            self._complete(rid)
            return
        try:
            d = self.router.route(rid, (), self.prompt[rid], WorkerRole.DECODE)
        except NoWorkerAvailable:
            self._pending[WorkerRole.DECODE].append(rid)
            return
        w = self.decode[d.worker_id]
        w.advance(t)
        w.offer(rid, self.prompt[rid], self.output[rid])
        self._schedule(w)

    def _schedule(self, w: DecodeWorker) -> None:
        t = w.next_finish_s()
        if t is not None:
            self._push(t, _DECODE, w.wid, w.version)

    def _decode_event(self, t: float, wid: str, version: int) -> None:
        w = self.decode.get(wid)
        if w is None or w.version != version:
            return
        w.advance(t)
        for rid in w.finish_due():
            self.itl[rid] = itl = (t - self.first_token[rid]) / (self.output[rid] - 1)
            self._tick_itl.append(itl)
            self.router.finished(rid, wid)
            self._complete(rid)
            if itl > self.cfg.itl_target_s and not self.ttft[rid] > self.cfg.ttft_target_s:
                self._miss()                  # a request that missed its TTFT is counted once
        if w.state is State.DRAINING and w.idle:
            self._stop(w, t)
        else:
            self._schedule(w)

    def _complete(self, rid: int) -> None:
        self._outstanding -= 1
        self._done += 1
        self._end = self.now

    # ---- workers ------------------------------------------------------------------------------

    def _start_pools(self) -> None:
        p, d = self._initial
        if self.planner is not None:
            first = self._warm_start()
            p, d = first.desired_prefill, first.desired_decode
        if "prefill" in self.stages:
            for _ in range(p):
                self._add(WorkerRole.PREFILL, 0.0, ready=True)
        if "decode" in self.stages:
            for _ in range(d):
                self._add(WorkerRole.DECODE, 0.0, ready=True)

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

    def _add(self, role: WorkerRole, now: float, ready: bool) -> None:
        self._num_workers += 1
        ready_s = now if ready else now + self.cfg.startup_s
        if role is WorkerRole.PREFILL:
            w = PrefillWorker(f"p{self._num_workers}", now, ready_s, self._cache_blocks,
                              self.cfg.prefill_deadline_s)
            self.prefill[w.wid] = w
        else:
            w = DecodeWorker(f"d{self._num_workers}", now, ready_s, self._step_fn,
                             self.profile.max_num_seqs, self.profile.kv_capacity_tokens)
            w.t0 = now
            self.decode[w.wid] = w
        self.all_workers.append(w)
        self.result.workers_started += 1
        if ready:
            self._ready(now, w.wid)
        else:
            self._push(ready_s, _READY, w.wid, 0)

    def _ready(self, t: float, wid: str) -> None:
        w = self.prefill.get(wid) or self.decode.get(wid)
        if w is None or w.state is State.STOPPED:
            return                                      # cancelled while starting
        w.state = State.READY
        role = WorkerRole.PREFILL if isinstance(w, PrefillWorker) else WorkerRole.DECODE
        self.router.add_worker(wid, role)
        pending, self._pending[role] = self._pending[role], []
        for rid in pending:
            (self._arrive if role is WorkerRole.PREFILL else self._enter_decode)(t, rid)

    def _stop(self, w, t: float) -> None:
        w.stop(t)
        (self.prefill if isinstance(w, PrefillWorker) else self.decode).pop(w.wid, None)

    def _resize(self, role: WorkerRole, desired: int, t: float) -> None:
        pool = self.prefill if role is WorkerRole.PREFILL else self.decode
        active = [w for w in pool.values() if w.state in (State.STARTING, State.READY)]
        if desired > len(active):
            for _ in range(desired - len(active)):
                self._add(role, t, ready=False)
            return
        surplus = len(active) - desired
        starting = sorted((w for w in active if w.state is State.STARTING), key=lambda w: -w.start_s)
        for w in starting[:surplus]:
            self._stop(w, t)
        surplus -= min(surplus, len(starting))
        ready = [w for w in active if w.state is State.READY]
        ready.sort(key=(lambda w: w.backlog_s) if role is WorkerRole.PREFILL else (lambda w: w.load))
        for w in ready[:surplus]:
            self.router.remove_worker(w.wid)
            w.state = State.DRAINING
            idle = (not w.in_flight) if role is WorkerRole.PREFILL else w.idle
            if idle:
                self._stop(w, t)

    # ---- planner ticks ------------------------------------------------------------------------

    def _tick(self, t: float) -> None:
        obs_pools = {role: self._pool_state(pool) for role, pool in
                     ((WorkerRole.PREFILL, self.prefill), (WorkerRole.DECODE, self.decode))}
        stats = self._decode_stats(t)
        plan_rate = math.nan
        if self.planner is not None:
            obs = Observation(t, self.cfg.interval_s, len(self._tick_requests), obs_pools[WorkerRole.PREFILL],
                              obs_pools[WorkerRole.DECODE], tuple(self._tick_requests),
                              tuple(self._tick_prefills), stats)
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
            float(np.mean(self._tick_itl)) if self._tick_itl else math.nan))
        alive = sum(1 for w in self.all_workers if w.state is not State.STOPPED)
        self.result.max_workers = max(self.result.max_workers, alive)
        self._tick_requests, self._tick_prefills, self._tick_ttft, self._tick_itl = [], [], [], []
        if self._outstanding > 0:
            self._push(t + self.cfg.interval_s, _TICK, 0, 0)

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

    # ---- the end ------------------------------------------------------------------------------

    def _finish(self) -> SimResult:
        r = self.result
        r.end_s = self._end
        r.gpu_s = sum(w.gpu_s(self._end) for w in self.all_workers)
        return r

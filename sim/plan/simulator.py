"""The planner simulator: a workload replayed on a virtual clock through simulated pools, sized
either by the planner core (the same `Planner.decide` the live loop calls) or statically.

Event-driven: the clock jumps from one event to the next (an arrival, a prefill done, a KV handoff
done, a decode worker's next finish, a worker ready, a planner tick); nothing is stepped per token
(sim/plan/decode.py says how decode advances between events). One request's life follows the
live system's (docs/architecture.md, the request lifecycle):

1. It arrives; the real router (router.Router, KV policy) picks a READY decode worker D, then, as
   the frontend's conditional disaggregation does, a prefill worker P by prefix overlap and queued
   prefill work. The prompt stays on D (LOCAL) when it has fewer than `remote_prefill_min_tokens`
   to compute, when there is no prefill worker, or when P has more than
   `max_prefill_queue_tokens` queued (the router's count, as the frontend reads it), unless
   computing it on D would make one of D's steps (D's requests plus a chunk of the prompt, priced
   with the profile) longer than the ITL target: then it waits at P anyway (the frontend's ITL
   guard, perf/itl_guard.py, which `serve --planner` turns on; `itl_guard=False` turns it off);
   else it goes to P (REMOTE).
2. D admits it in arrival order once its KV has room for the whole sequence (prompt + output):
   every request, local or remote, waits here first, as the engine reserves a remote prefill's
   blocks before it asks P (sim/plan/decode.py).
3. REMOTE: D sends the prompt to P, which refuses it if it expects to finish it later than the
   lease (`prefill_lease_s`; D then computes it itself). P queues it (in arrival order, or with
   `prefill_deadline_s` in deadline order: sim/plan/workers.py) and prefills the part not cached
   on P for the profile's time; the first token reaches the client `handoff_s` later, when the KV
   has landed on D, and the sequence joins D's batch. P caches the prompt's full prefix blocks
   (LRU, the profile's KV capacity) and tells the router's index, as KV events do.
   LOCAL: D computes the prompt in the token budget its decodes leave, slowing their steps
   (sim/plan/decode.py); its first token is out when the last chunk is done.
4. D decodes the rest of the output. Mean ITL = (last token - first token) / (output - 1); a
   one-token output meets any ITL.

Prefix blocks: the router and the caches work in the trace's 512-token blocks, with the trace's
hash ids as block hashes (ids are already prefix-unique: equal id = equal prefix). One trace block
stands for the 32 engine blocks of 16 tokens it covers, which share or differ all together, so
overlaps are the same in tokens; only a partial last block (< 512 tokens, shared only when the
ids say so) is never counted as cached: the engine could reuse up to 496 more tokens of it.
Arrivals with no ids (Azure) share nothing. Decode workers keep no prefix cache here.

Pools start READY at t = 0 with the planner's first decision (warm-started from the history
before t = 0) or the static sizes. A new worker is READY `startup_s` after the decision that asked
for it; a removed worker is cancelled if still starting (newest first), else drained (least
loaded first): it leaves the router at once and stops when its last request is done. GPU time is
counted from a worker's start to its stop (or the end of the run), starting and draining included.

Stages: both (the normal run), prefill only (TTFT of each request with every prompt sent to the
prefill pool; for the static search), or decode only (requests enter decode at given first-token
times, their KV already there).

It knows nothing of argument parsing, JSON or plots (splitserve/bench/plan.py).
"""

from __future__ import annotations

import heapq
import math
import sys

import numpy as np

from kvstore.events import KvEventBatch
from planner import Planner
from router import NoWorkerAvailable, Router, RouterConfig, WorkerRole
from perf.itl_guard import ItlGuard, ItlGuardMode, LocalPrefillBudget, must_wait, note_decode_s, prefill_late
from perf.profile import Profile
from sim.plan.config import SimConfig, SimResult, TimelinePoint
from sim.plan.decode import DecodeWorker, Kind
from sim.plan.ticks import PlannerTicks
from sim.plan.workers import PrefillWorker, State
from sim.workload import TRACE_BLOCK_TOKENS, Workload

__all__ = ["SimConfig", "SimResult", "Simulation", "TimelinePoint"]

_READY, _PREFILL_DONE, _LANDED, _DECODE, _TICK, _REPORT = range(6)
_PROGRESS_EVERY = 2048
REPORT_INTERVAL_S = 0.5     # the frontend reads every worker's load this often (frontend/routing.py)


class _GaveUp(Exception):
    pass


class Simulation(PlannerTicks):
    _tick_kind = _TICK
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
        guard = ItlGuard(profile, config.itl_target_s) if config.itl_guard else None
        if guard is not None and ItlGuardMode(config.itl_guard_mode) is ItlGuardMode.BUDGET:
            guard = LocalPrefillBudget(guard, ttft_target_s=config.ttft_target_s)
        self._itl_guard = guard
        self.router = Router(RouterConfig(timing=profile.timing, chunk_tokens=profile.max_num_batched_tokens),
                             block_size=TRACE_BLOCK_TOKENS, seed=config.seed, clock=lambda: self.now)
        self.heap: list[tuple] = []
        self._seq = 0
        self.prefill: dict[str, PrefillWorker] = {}      # alive (not stopped)
        self.decode: dict[str, DecodeWorker] = {}
        self.all_workers: list = []
        self._num_workers = 0
        # the batch stays within max_num_seqs (admission counts the KV in flight); a larger one,
        # should it occur, is priced at the profile's plain decode step
        fast, cap, slow = profile.decode_step_fn(profile.max_num_seqs), profile.max_num_seqs, profile.decode_step_s
        self._step_fn = lambda batch, context: fast(batch, context) if batch <= cap else slow(batch, context)
        timing = profile.timing
        self._step_base_s = timing.step_s([])
        self._chunk_s = lambda start, n: timing.step_s([(start, n)]) - self._step_base_s
        self._cache_blocks = max(profile.kv_capacity_tokens // TRACE_BLOCK_TOKENS, 1)
        self._prefill_s: dict[tuple[int, int], float] = {}
        self._pending: dict[WorkerRole, list[int]] = {WorkerRole.PREFILL: [], WorkerRole.DECODE: []}
        n = len(workload)
        self.ttft = np.full(n, np.nan)
        self.itl = np.full(n, np.nan)
        self.first_token = np.full(n, np.nan) if decode_entry_s is None else decode_entry_s.astype(float)
        self.cached = np.zeros(n, dtype=np.int64)
        self.local = np.zeros(n, dtype=bool)
        self.decode_owned = np.zeros(n, dtype=bool)      # LOCAL for a reason no prefill worker changes
        self.decode_wait = np.zeros(n)
        self._prefill_of: dict[int, str] = {}            # REMOTE, until its prefill starts
        self._decode_of: dict[int, str] = {}             # until it is done
        self._submitted: dict[int, float] = {}           # queued on a prefill worker at, until it starts
        self.arrival = workload.arrival_s
        self.prompt = workload.prompt.tolist()
        self.output = workload.output.tolist()
        self.hashes = workload.hashes
        self._outstanding = n
        self._done = 0
        self._end = 0.0                  # the last completion
        self.result = SimResult(self.ttft, self.itl, self.first_token, self.cached, 0.0, 0.0,
                                self.local, self.decode_wait)
        self._init_ticks(prefill_workers, decode_workers)
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
        if "decode" in self.stages and "prefill" in self.stages:
            self._push(REPORT_INTERVAL_S, _REPORT, 0, 0)
        bar = tqdm(total=len(src_t), desc=self.desc or "simulate", unit="req", file=sys.stderr,
                   mininterval=0.5, disable=not self.progress, leave=False)
        heap, i, n = self.heap, 0, len(src_t)
        last_done = 0
        on_arrival = self._arrive if src_order is None else self._enter_decode
        handlers = {_DECODE: self._decode_event, _LANDED: self._landed, _PREFILL_DONE: self._prefill_done}
        try:
            while True:
                t_src = src_t[i] if i < n else math.inf
                if heap and heap[0][0] <= t_src:
                    t, _, kind, x, y = heapq.heappop(heap)
                    self.now = t
                    if kind == _TICK:
                        self._tick(t)
                    elif kind == _REPORT:
                        self._report(t)
                    elif kind == _READY:
                        self._ready(t, x)
                    else:
                        handlers[kind](t, x, y)
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

    # ---- arrival: routing and conditional disaggregation --------------------------------------

    def _arrive(self, t: float, rid: int) -> None:
        if "decode" not in self.stages:
            self._route_prefill(t, rid, direct=True)
            return
        try:
            d = self.router.route(rid, (), self.prompt[rid], WorkerRole.DECODE)
        except NoWorkerAvailable:
            self._pending[WorkerRole.DECODE].append(rid)
            return
        kind = Kind.REMOTE if self._route_prefill(t, rid, direct=False, decode=d.worker_id) else Kind.LOCAL
        self.local[rid] = kind is Kind.LOCAL
        self._note_arrival(rid, kind)
        self._offer(t, d.worker_id, rid, kind)

    def _route_prefill(self, t: float, rid: int, direct: bool, decode: str | None = None) -> bool:
        """Choose a prefill worker (the frontend's `_remote_prefill`); True if the prompt goes there.
        `direct` (the prefill-only stage): no decode worker, so it is queued there at once. `decode`:
        the decode worker chosen first, whose requests the ITL guard counts."""
        cfg = self.cfg
        if not direct and self.prompt[rid] < cfg.remote_prefill_min_tokens:
            self.decode_owned[rid] = True           # too short to send: the decode pool's own
            return False
        try:
            p = self.router.route(rid, self.hashes[rid] if self.hashes is not None else (),
                                  self.prompt[rid], WorkerRole.PREFILL)
        except NoWorkerAvailable:
            if direct:
                self._pending[WorkerRole.PREFILL].append(rid)
            return False
        queued = self.router.load(p.worker_id) * TRACE_BLOCK_TOKENS
        if (not direct and (queued > cfg.max_prefill_queue_tokens or self._prefill_late(queued, rid, p.overlap_blocks))
                and not self._must_wait(t, rid, p.overlap_blocks, decode)):
            self.router.finished(rid, p.worker_id)
            # a prompt longer than the limit itself never goes remote: the decode pool's own
            self.decode_owned[rid] = p.prefill_blocks * TRACE_BLOCK_TOKENS > cfg.max_prefill_queue_tokens
            return False
        self.cached[rid] = min(p.overlap_blocks * TRACE_BLOCK_TOKENS, self.prompt[rid] - 1)
        if direct:
            self._note_arrival(rid, Kind.REMOTE)
            self._submit_prefill(t, rid, p.worker_id, float(self.arrival[rid]), lease=False)
        else:
            self._prefill_of[rid] = p.worker_id
        return True

    def _lengths(self, rid: int, overlap_blocks: int) -> tuple[int, int]:
        """The prompt's tokens, and those left to compute after its cached prefix (at least one)."""
        prompt = int(self.prompt[rid])
        return prompt, prompt - min(overlap_blocks * TRACE_BLOCK_TOKENS, prompt - 1)

    def _prefill_late(self, queued: float, rid: int, overlap_blocks: int) -> bool:
        """The budget rule's TTFT gate (perf/itl_guard.py): the prefill worker's queue would make
        this prompt late."""
        return prefill_late(self._itl_guard, queued, *self._lengths(rid, overlap_blocks))

    def _must_wait(self, t: float, rid: int, overlap_blocks: int, decode: str | None) -> bool:
        """The ITL guard: a prompt past the queue gate waits at its prefill worker when computing
        it on its decode worker (that worker's requests, as the frontend counts them) would break
        the ITL target."""
        w = self.decode.get(decode) if decode is not None else None
        if self._itl_guard is None or w is None:
            return False
        prompt, uncached = self._lengths(rid, overlap_blocks)
        return must_wait(self._itl_guard, prompt, uncached, w.load, w.batch, decode, t)

    def _report(self, t: float) -> None:
        """The workers' load reports, as the frontend polls them: the router's count of a worker's
        queue is its last report plus what was routed there since (router/load.py)."""
        router = self.router
        for w in self.prefill.values():
            if w.state is State.READY:
                router.update_worker_load(w.wid, 0, w.queued_tokens)
        for w in self.decode.values():
            if w.state is State.READY:
                w.advance(t)
                router.update_worker_load(w.wid, w.reserved // TRACE_BLOCK_TOKENS, w.waiting_prefill_tokens)
        if self._outstanding > 0:
            self._push(t + REPORT_INTERVAL_S, _REPORT, 0, 0)

    # ---- prefill ------------------------------------------------------------------------------

    def _service_s(self, rid: int) -> float:
        key = (self.prompt[rid], int(self.cached[rid]))
        service = self._prefill_s.get(key)
        if service is None:
            service = self._prefill_s[key] = self.profile.prefill_s(*key)
        return service

    def _submit_prefill(self, t: float, rid: int, wid: str, queued_at: float, lease: bool = True) -> bool:
        """Queue the prompt on prefill worker `wid`; False if it refuses: it is draining or gone,
        or (`lease`) it expects to finish later than the decode worker's lease."""
        w = self.prefill.get(wid)
        service = self._service_s(rid)
        if lease and (w is None or w.state is not State.READY
                      or w.expected_finish_s(t, service) > self.cfg.prefill_lease_s):
            self.router.finished(rid, wid)
            self.cached[rid] = 0
            return False
        self._submitted[rid] = queued_at
        started = w.submit(t, rid, queued_at, service, self.prompt[rid])
        if started is not None:
            self._begin_prefill(wid, *started)
        return True

    def _begin_prefill(self, wid: str, rid: int, start: float, done: float) -> None:
        self._push(done, _PREFILL_DONE, rid, wid)
        self._note_prefill(rid, start, done)

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
        landed = t + self.cfg.handoff_s
        if "decode" in self.stages:
            self._push(landed, _LANDED, rid, 0)
        else:
            self._first_token(rid, landed)
            self._complete(rid)

    def _first_token(self, rid: int, t: float) -> None:
        self.ttft[rid] = ttft = t - self.arrival[rid]
        self.first_token[rid] = t
        self.router.first_token(rid)
        self._note_first_token(rid, ttft)
        if ttft > self.cfg.ttft_target_s:
            self._miss()

    # ---- decode -------------------------------------------------------------------------------

    def _offer(self, t: float, wid: str, rid: int, kind: Kind) -> None:
        w = self.decode[wid]
        self._decode_of[rid] = wid
        w.advance(t)
        w.offer(rid, self.prompt[rid], self.output[rid], kind, int(self.cached[rid]) if kind is Kind.LOCAL else 0)
        self._after_admission(t, w)

    def _after_admission(self, t: float, w: DecodeWorker) -> None:
        """Send the prompts of the remote prefills D just reserved blocks for; note the waits."""
        for rid in w.take_reserved():
            self.decode_wait[rid] = t - self.arrival[rid]
            wid = self._prefill_of.pop(rid)
            if not self._submit_prefill(t, rid, wid, t):
                self.local[rid] = True
                w.to_local(rid)
        self._schedule(w)

    def _landed(self, t: float, rid: int, _) -> None:
        self._first_token(rid, t)
        w = self.decode[self._decode_of[rid]]
        w.advance(t)
        w.kv_landed(rid)
        if self.output[rid] <= 1:
            self._release_decode(t, rid)
        self._after_admission(t, w)

    def _enter_decode(self, t: float, rid: int) -> None:
        """Decode-only stage: the request's KV is here at its first-token time."""
        if self.output[rid] <= 1:
            self._complete(rid)
            return
        try:
            d = self.router.route(rid, (), self.prompt[rid], WorkerRole.DECODE)
        except NoWorkerAvailable:
            self._pending[WorkerRole.DECODE].append(rid)
            return
        self._offer(t, d.worker_id, rid, Kind.READY)

    def _schedule(self, w: DecodeWorker) -> None:
        t = w.next_event_s()
        if t is not None:
            self._push(t, _DECODE, w.wid, w.version)

    def _decode_event(self, t: float, wid: str, version: int) -> None:
        w = self.decode.get(wid)
        if w is None or w.version != version:
            return
        w.advance(t)
        done, prefilled = w.due()
        for rid in prefilled:
            self._first_token(rid, t)
            if self.output[rid] <= 1:
                self._release_decode(t, rid, stop=False)
        for rid in done:
            self.itl[rid] = itl = (t - self.first_token[rid]) / (self.output[rid] - 1)
            note_decode_s(self._itl_guard, t - self.first_token[rid])
            self._note_itl(itl)
            self._release_decode(t, rid, stop=False)
            if itl > self.cfg.itl_target_s and not self.ttft[rid] > self.cfg.ttft_target_s:
                self._miss()                  # a request that missed its TTFT is counted once
        if w.state is State.DRAINING and w.idle:
            self._stop(w, t)
        else:
            self._after_admission(t, w)

    def _release_decode(self, t: float, rid: int, stop: bool = True) -> None:
        wid = self._decode_of.pop(rid, None)
        self.router.finished(rid, wid)
        self._complete(rid)
        w = self.decode.get(wid) if wid is not None else None
        if stop and w is not None and w.state is State.DRAINING and w.idle:
            self._stop(w, t)

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

    def _add(self, role: WorkerRole, now: float, ready: bool) -> None:
        self._num_workers += 1
        ready_s = now if ready else now + self.cfg.startup_s
        if role is WorkerRole.PREFILL:
            w = PrefillWorker(f"p{self._num_workers}", now, ready_s, self._cache_blocks,
                              self.cfg.prefill_deadline_s)
            self.prefill[w.wid] = w
        else:
            p = self.profile
            w = DecodeWorker(f"d{self._num_workers}", now, ready_s, self._step_fn, p.max_num_seqs,
                             p.kv_capacity_tokens, self._chunk_s, p.max_num_batched_tokens, self._step_base_s)
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
            if role is WorkerRole.PREFILL:
                self._route_prefill(t, rid, direct=True)
            elif "prefill" in self.stages:
                self._arrive(t, rid)
            else:
                self._enter_decode(t, rid)

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

    # ---- the end ------------------------------------------------------------------------------

    def _finish(self) -> SimResult:
        r = self.result
        r.end_s = self._end
        r.gpu_s = sum(w.gpu_s(self._end) for w in self.all_workers)
        return r

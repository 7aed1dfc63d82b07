"""The routing simulator behind `splitserve bench routesim`: the real router driving simulated
workers on a virtual clock.

`bench replay` runs real processes in real time (~4 min a policy); this runs the same workloads in
seconds, so that routing policies can be compared, instrumented and scaled to 1,000 workers. What
is real: the `Router` (index, cost, selection, load book) fed by KV event batches and load reports
exactly as the frontend feeds it, and each worker's engine (worker.py: the real `Engine`, scheduler
and `BlockPool`, with the mock runner's timing model on the simulator's clock), so a simulated worker
schedules, caches, evicts and emits events exactly as a `serve --mock` worker does.
The network is instant: a decision, a step's KV events and a request's end reach the router when
they happen (``--event-delay-s`` delays the events); load reports (blocks, queued prompt tokens,
decoding requests) come every ``--report-interval-s`` (the workers push theirs every 50 ms while they
run; the frontend's poll comes every 0.5 s). With ``--frontends N`` there are N routers, as N
frontend processes each have one: requests arrive at them in turn, each router learns only its own
requests' first tokens and ends, and every router gets every KV event and every load report, so
the cost of routing from N partial views (and of stale reports) shows; ``--own-load-only`` drops
the decoding counts from the reports (each router then sees the others' decodes only through
blocks and queued prompts).

Beside each policy's figures it prints the pooled-cache oracle (oracle.py) for the same requests
and capacity, and where the reuse the oracle found went missing (`miss_*`, in prompt tokens, each
request's shortfall capped at the oracle's hit):

- ``miss_in_flight``: no worker had stored the prefix yet (the request that computes it was still
  queued or running when this one was routed);
- ``miss_evicted``: the fleet had held the prefix and evicted it (capacity, duplicates, LRU order);
- ``miss_routed_elsewhere``: a worker held more of it than the one chosen (load, or a policy that
  ignores the cache);
- ``miss_lost_in_queue``: the chosen worker held it when routed but not at admission (evicted while
  the request waited); ``gained_in_queue`` counts the opposite (blocks computed meanwhile).

Requests longer than the context (``--max-model-len``) are rejected as the server rejects them.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvstore.events import KvEventBatch
from perf.profile import DEFAULT_KV_TOKENS, StepTiming
from router import Router, RouterConfig, WorkerRole
from runtime.config import EngineConfig
from sim.oracle import PooledCacheOracle
from sim.route.worker import Seq, SimRequest, SimWorker, sim_model_config

_ARRIVAL, _STEP_END, _REPORT, _EVENTS = range(4)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The simulated fleet; defaults are the mock workers' (`serve --mock`)."""
    workers: int = 8
    block_size: int = 16
    num_blocks: int = DEFAULT_KV_TOKENS // 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 131_072
    report_interval_s: float = 0.5
    event_delay_s: float = 0.0
    frontends: int = 1              # routers, each taking every N-th request (frontend processes)
    report_running: bool = True     # reports carry the worker's decoding count (the others' decodes)
    attribute: bool = True          # miss attribution (one extra index lookup per decision)
    vocab_size: int = 4096          # the mock's output tokens are drawn below this

    def engine_config(self) -> EngineConfig:
        """Each simulated worker's engine: a mock worker's (`serve --mock`, async scheduling)."""
        return EngineConfig(model="", block_size=self.block_size, num_blocks=self.num_blocks,
                            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens, mock=True, device="cpu")


@dataclass(slots=True)
class MissLedger:
    """Where the oracle's reuse went (tokens); see the module docstring."""
    oracle: int = 0
    actual: int = 0
    in_flight: int = 0
    evicted: int = 0
    routed_elsewhere: int = 0
    lost_in_queue: int = 0
    gained_in_queue: int = 0
    beyond_oracle: int = 0

    def fields(self, prompt_tokens: int) -> dict:
        def rate(n: int) -> float:
            return round(n / prompt_tokens, 4) if prompt_tokens else 0.0
        return {f"miss_{k}": rate(getattr(self, k)) for k in
                ("in_flight", "evicted", "routed_elsewhere", "lost_in_queue")} | {
            "gained_in_queue": rate(self.gained_in_queue), "beyond_oracle": rate(self.beyond_oracle)}


@dataclass(slots=True)
class _Decision:
    oracle_tokens: int
    best_tokens: int            # most leading tokens any worker held (index), capped at the oracle's
    chosen_tokens: int          # what the chosen worker held (index), capped likewise
    ever_stored: bool           # the block after the fleet's longest run had been stored somewhere


@dataclass(slots=True)
class RouterClock:
    """Router time spent, for decisions/s and ingest figures at scale."""
    route_s: float = 0.0
    decisions: int = 0
    ingest_s: float = 0.0
    ingest_blocks: int = 0
    ingest_batches: int = 0
    report_s: float = 0.0
    finish_s: float = 0.0


class Simulation:
    def __init__(self, cfg: SimConfig, router_config: RouterConfig, requests: Sequence[SimRequest],
                 timing: StepTiming, seed: int = 0, prompt_of=None) -> None:
        """`prompt_of(req)` builds a request's token ids at its arrival where `req.prompt` is None
        (so a long trace's prompts are in memory only while they run)."""
        self.prompt_of = prompt_of
        self.cfg = cfg
        self.timing = timing
        self.now = 0.0
        self.routers = [Router(router_config, cfg.block_size, seed=seed + i, clock=lambda: self.now)
                        for i in range(cfg.frontends)]
        self.router = self.routers[0]
        self._router_of: dict[str, Router] = {}     # request id -> the router (frontend) that took it
        engine_cfg, model_cfg = cfg.engine_config(), sim_model_config(cfg.vocab_size)
        self.workers = {f"w{i}": SimWorker(f"w{i}", engine_cfg, timing, model_cfg, lambda: self.now)
                        for i in range(cfg.workers)}
        for wid in self.workers:
            for r in self.routers:
                r.add_worker(wid, WorkerRole.DECODE)
        self.requests = list(requests)
        self.oracle = PooledCacheOracle.for_fleet(cfg.block_size, cfg.workers, cfg.num_blocks)
        self.ledger = MissLedger()
        self.clock = RouterClock()
        self._seqs: list[Seq] = []
        self._decisions: dict[int, _Decision] = {}
        self._heap: list[tuple[float, int, int, object]] = []
        self._order = 0
        self._next_seq = {wid: 1 for wid in self.workers}
        self._ever_stored: set[int] = set()
        self._oracle_tokens: dict[int, int] = {}    # request index -> the pooled oracle's hit
        self.rejected = 0

    # ---- the event loop ----------------------------------------------------------------------

    def run(self) -> dict:
        wall0 = time.perf_counter()
        for req in self.requests:
            self._push(req.arrival_s, _ARRIVAL, req)
        self._push(0.0, _REPORT, None)
        pending = len(self.requests)
        while self._heap and (pending or any(w.has_work for w in self.workers.values())):
            t, _, kind, payload = heapq.heappop(self._heap)
            self.now = t
            if kind == _ARRIVAL:
                pending -= 1
                self._arrive(payload)
            elif kind == _STEP_END:
                self._step(payload)
            elif kind == _EVENTS:
                self._deliver(payload)
            else:
                self._report()
        return self._summary(time.perf_counter() - wall0)

    def _push(self, t: float, kind: int, payload: object) -> None:
        self._order += 1
        heapq.heappush(self._heap, (t, self._order, kind, payload))

    def _arrive(self, req: SimRequest) -> None:
        if req.prompt_len + req.output_len > self.cfg.max_model_len:    # the server refuses it
            self.rejected += 1
            return
        oracle_tokens = sum(self.oracle.observe(req.block_hashes, req.prompt_len))
        self._oracle_tokens[req.index] = oracle_tokens
        held = self.router.index.overlaps(req.block_hashes) if self.cfg.attribute else {}
        router = self._router_of[req.request_id] = self.routers[req.index % len(self.routers)]
        t0 = time.perf_counter()
        d = router.route(req.request_id, req.block_hashes, req.prompt_len, WorkerRole.DECODE,
                         hint=req.cache_key)
        self.clock.route_s += time.perf_counter() - t0
        self.clock.decisions += 1
        if self.cfg.attribute:
            bs = self.cfg.block_size
            best = max(held.values(), default=0)
            nxt = req.block_hashes[best] if best < len(req.block_hashes) else None
            self._decisions[req.index] = _Decision(
                oracle_tokens, min(best * bs, oracle_tokens), min(held.get(d.worker_id, 0) * bs, oracle_tokens),
                nxt in self._ever_stored)
        worker = self.workers[d.worker_id]
        self._seqs.append(worker.add(req, req.prompt if req.prompt is not None else self.prompt_of(req)))
        if not worker.busy:
            self._step(worker)

    def _step(self, worker: SimWorker) -> None:
        """The worker's engine steps at `now`: the step that ended is collected, the next launched."""
        first, done, events = worker.step(self.now)
        if events:
            wid = worker.worker_id
            batch = KvEventBatch(wid, self._next_seq[wid], events)
            self._next_seq[wid] += 1
            if self.cfg.event_delay_s > 0:
                self._push(self.now + self.cfg.event_delay_s, _EVENTS, batch)
            else:
                self._deliver(batch)
        for seq in first:
            self._router_of[seq.req.request_id].first_token(seq.req.request_id)
            self._account(seq)
        for seq in done:
            t0 = time.perf_counter()
            self._router_of.pop(seq.req.request_id).finished(seq.req.request_id)
            self.clock.finish_s += time.perf_counter() - t0
        if worker.ready_at_s is not None:
            self._push(worker.ready_at_s, _STEP_END, worker)

    def _deliver(self, batch: KvEventBatch) -> None:
        if self.cfg.attribute:
            for ev in batch.events:
                if hasattr(ev, "parent_hash"):
                    self._ever_stored.update(ev.block_hashes)
        t0 = time.perf_counter()
        for r in self.routers:
            r.apply_events(batch)
        self.clock.ingest_s += time.perf_counter() - t0
        self.clock.ingest_batches += 1
        self.clock.ingest_blocks += sum(len(getattr(ev, "block_hashes", ())) for ev in batch.events)

    def _report(self) -> None:
        t0 = time.perf_counter()
        for wid, w in self.workers.items():
            blocks, queued = w.active_blocks(), w.waiting_prefill_tokens()
            decoding = w.num_decoding() if self.cfg.report_running else None
            for r in self.routers:
                r.update_worker_load(wid, blocks, queued, decoding)
        self.clock.report_s += time.perf_counter() - t0
        self._push(self.now + self.cfg.report_interval_s, _REPORT, None)

    def _account(self, seq: Seq) -> None:
        d = self._decisions.pop(seq.req.index, None)
        if d is None:
            return
        led = self.ledger
        actual = seq.cached_tokens
        a = min(actual, d.oracle_tokens)
        led.oracle += d.oracle_tokens
        led.actual += actual
        fleet_gap = d.oracle_tokens - d.best_tokens
        if d.ever_stored:
            led.evicted += fleet_gap
        else:
            led.in_flight += fleet_gap
        led.routed_elsewhere += d.best_tokens - d.chosen_tokens
        if a < d.chosen_tokens:
            led.lost_in_queue += d.chosen_tokens - a
        else:
            led.gained_in_queue += a - d.chosen_tokens
        led.beyond_oracle += max(0, actual - d.oracle_tokens)

    # ---- results -----------------------------------------------------------------------------

    def _summary(self, wall_s: float) -> dict:
        seqs = [s for s in self._seqs if s.first_token_s >= 0]
        ttft = np.array([s.first_token_s - s.req.arrival_s for s in seqs])
        # What no placement can beat: each prompt prefilled alone on an idle worker, with the pooled
        # oracle's hit (floor) or with the hit this policy got (own prefill).
        chunk, prefill = self.cfg.max_num_batched_tokens, self.timing.prefill_s
        floor = np.array([prefill(s.req.prompt_len, self._oracle_tokens.get(s.req.index, 0), chunk) for s in seqs])
        own = np.array([prefill(s.req.prompt_len, s.cached_tokens, chunk) for s in seqs])
        prompt = sum(s.req.prompt_len for s in seqs)
        cached = sum(s.cached_tokens for s in seqs)
        served = {wid: w.stats.prompt_tokens for wid, w in self.workers.items()}
        computed = {wid: w.stats.prompt_tokens - w.stats.hit_tokens for wid, w in self.workers.items()}
        mean = sum(served.values()) / len(served)
        hit = cached / prompt if prompt else 0.0
        oracle = self.oracle.totals.hit_rate()
        c = self.clock
        out = {
            "requests": len(self.requests), "errors": self.rejected,
            "unfinished": sum(1 for s in self._seqs if s.finish_s < 0),
            "prefix_hit_rate": round(hit, 4),
            **self.oracle.summary(),
            "oracle_share": round(hit / oracle, 3) if oracle else None,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90), "ttft_p99_s": _pct(ttft, 99),
            "ttft_mean_s": round(float(ttft.mean()), 4) if len(ttft) else None,
            "ttft_floor_p50_s": _pct(floor, 50), "ttft_floor_p90_s": _pct(floor, 90),
            "ttft_own_prefill_p50_s": _pct(own, 50), "ttft_own_prefill_p90_s": _pct(own, 90),
            "max_over_mean_load": round(max(served.values()) / mean, 3) if mean else None,
            "max_over_mean_computed": round(max(computed.values()) / (sum(computed.values()) / len(computed)), 3)
            if sum(computed.values()) else None,
            "preemptions": sum(w.stats.preemptions for w in self.workers.values()),
            "sim_span_s": round(self.now, 2),
            "busy_fraction": round(sum(w.stats.busy_s for w in self.workers.values())
                                   / (self.now * len(self.workers)), 3) if self.now else None,
            "sim_wall_s": round(wall_s, 2),
            "router_decisions_per_s": round(c.decisions / c.route_s) if c.route_s else None,
            "router_route_mean_us": round(1e6 * c.route_s / c.decisions, 1) if c.decisions else None,
            "router_ingest_blocks_per_s": round(c.ingest_blocks / c.ingest_s) if c.ingest_s else None,
            "router_ingest_blocks": c.ingest_blocks, "router_ingest_batches": c.ingest_batches,
            "router_report_s": round(c.report_s, 3), "router_finish_s": round(c.finish_s, 3),
            "indexed_blocks": self.router.index.num_entries(),
            "router_index_tables_mib": round(index_tables_bytes(self.router) / 2**20, 1),
        }
        if self.cfg.attribute:
            out |= self.ledger.fields(prompt)
        if len(self.workers) <= 16:
            out["worker_prompt_tokens"] = served
            out["worker_computed_tokens"] = computed
        return out


def index_tables_bytes(router: Router) -> int:
    """The prefix index's hash tables (chain masks, parents, children, orphan counts, each
    worker's block sets), by sys.getsizeof: the tables themselves, not the int objects in them
    (hashes are shared with the event batches; a 64-bit hash is another 32 bytes where unshared)."""
    import sys

    idx = router.index
    chains = idx._chains                                          # noqa: SLF001 (a bench probe)
    total = sum(sys.getsizeof(d) for d in chains._chain.values())  # noqa: SLF001
    total += sys.getsizeof(chains._parent) + sys.getsizeof(chains._orphan_refs) + sys.getsizeof(chains._children)  # noqa: SLF001
    total += sum(sys.getsizeof(s) for s in chains._children.values() if type(s) is set)  # noqa: SLF001
    for w in idx._workers.values():                               # noqa: SLF001
        total += sum(sys.getsizeof(s) for s in w.held.blocks.values())
    return total


def _pct(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if len(values) else None


def offered_prefill_util(requests: Sequence[SimRequest], timing: StepTiming, budget: int,
                         workers: int) -> float:
    """No-cache prefill seconds (chunked by ``budget``) / (arrival span * workers): replay's rule."""
    busy = sum(timing.step_s([(start, min(budget, r.prompt_len - start))])
               for r in requests for start in range(0, r.prompt_len, budget))
    span = requests[-1].arrival_s - requests[0].arrival_s
    return busy / (span * workers) if span > 0 else math.inf



"""The engine step: schedule → execute → update, and the thread that runs it.

`Engine` is single-threaded. `EngineLoop` runs it on its own thread, fed by a queue of commands,
so that gRPC, Redis and detokenization never wait on the model and the model never waits on them.
Outputs leave through a callback called on the engine thread; the caller hops them onto its event
loop.

With async scheduling (the default on CUDA) a call to `step()` schedules and launches step N+1
before it waits for step N's sampled tokens, so the host work of a step — scheduling, building
inputs, planning attention, and everything the loop does between steps — runs while the device
computes the previous one. Step N+1 reads step N's tokens from the device (see scheduler.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from kvstore.block_pool import BlockPool
from kvstore.events import KvEvent
from engine.model_runner import ModelRunner
from engine.request import Request
from runtime.types import FinishReason, KvReservation, RequestOutput
from engine.scheduler import ScheduledChunk, Scheduler
from runtime.config import EngineConfig

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.05


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_total_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_prompt_tokens: int
    num_prefix_hit_tokens: int
    num_waiting_prefill_tokens: int
    num_awaiting_kv: int = 0
    num_held: int = 0


class Engine:
    def __init__(self, cfg: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.cfg = cfg
        self.runner = runner or (_mock_runner(cfg) if cfg.mock else ModelRunner(cfg))
        self.max_model_len = min(self.runner.max_model_len, self.runner.num_blocks * cfg.block_size)
        self.pool = BlockPool(self.runner.num_blocks, enable_caching=cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, cfg.block_size, self.max_model_len, cfg.max_num_seqs,
                                   cfg.max_num_batched_tokens, self.runner.model_config.eos_token_ids)
        overlap = cfg.async_scheduling
        if overlap is None:          # on where a device runs steps beside the host (or the mock models one)
            overlap = self.runner.device.type == "cuda" or cfg.mock
        self.async_scheduling = bool(overlap) and hasattr(self.runner, "launch")
        self._in_flight: tuple[list[ScheduledChunk], object] | None = None   # launched, not yet updated

    def add_request(self, request: Request) -> RequestOutput | None:
        """Queue a request; returns an immediate error output if it can never run here."""
        if request.num_tokens >= self.max_model_len or not request.prompt_token_ids:
            return RequestOutput(request.request_id, [], FinishReason.ERROR, 0, request.session,
                                 error=f"prompt of {request.num_tokens} tokens does not fit the context "
                                       f"of {self.max_model_len}")
        self.scheduler.add(request)
        return None

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler
        chunks = sched.schedule()
        if not self.async_scheduling:
            if not chunks:
                return []
            sampled = self.runner.execute(chunks)
            sched.commit(chunks)
            return sched.update(chunks, sampled)
        prev, self._in_flight = self._in_flight, None
        try:
            if chunks:
                launched = self.runner.launch(chunks, prev[1] if prev else None)
                sched.commit(chunks)
                self._in_flight = (chunks, launched)
            return sched.update(prev[0], prev[1].result()) if prev else []
        except BaseException:
            self._in_flight = None
            sched.release_deferred()
            raise

    def take_events(self) -> list[KvEvent]:
        return self.pool.take_events()

    def take_reservations(self) -> list[KvReservation]:
        out, self.scheduler.reservations = self.scheduler.reservations, []
        return out

    def stats(self) -> EngineStats:
        s = self.scheduler
        to_prefill = sum(r.num_tokens for r in s.waiting) + sum(
            r.num_tokens - r.num_computed_tokens - 1 for r in s.running if r.num_computed_tokens < r.num_tokens - 1)
        return EngineStats(self.pool.num_blocks, self.pool.num_free, len(s.running), len(s.waiting),
                           s.num_preemptions, s.num_prompt_tokens, s.num_prefix_hit_tokens, to_prefill,
                           len(s.awaiting_kv), len(s.held))

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None


def _mock_runner(cfg: EngineConfig):
    from engine.mock_runner import MockModelRunner
    return MockModelRunner(cfg)


class EngineLoop:
    """Runs an `Engine` on a thread. Thread-safe: submit / abort / call from anywhere."""

    def __init__(self, engine: Engine, on_outputs: Callable[[list[RequestOutput]], None],
                 on_events: Callable[[list[KvEvent]], None] | None = None,
                 on_reservations: Callable[[list[KvReservation]], None] | None = None) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_events = on_events
        self._on_reservations = on_reservations
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.stats = engine.stats()
        self._stats_at = 0.0

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> None:
        self._inbox.put(("add", request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def kv_arrived(self, request_id: str, first_token: int) -> None:
        self._inbox.put(("kv_arrived", (request_id, first_token)))

    def kv_failed(self, request_id: str) -> None:
        self._inbox.put(("kv_failed", request_id))

    def release_held(self, request_id: str) -> None:
        self._inbox.put(("release", request_id))

    def call(self, fn: Callable[[Engine], object]) -> Future:
        """Run fn(engine) on the engine thread between steps (e.g. a consistent snapshot)."""
        fut: Future = Future()
        self._inbox.put(("call", (fn, fut)))
        return fut

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout=10)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload) -> None:
        eng = self.engine
        if kind == "add":
            err = eng.add_request(payload)
            if err is not None:
                self._on_outputs([err])
        elif kind == "abort":
            eng.abort_request(payload)
        elif kind == "kv_arrived":
            out = eng.scheduler.kv_arrived(*payload)
            if out is not None:
                self._on_outputs([out])
        elif kind == "kv_failed":
            eng.scheduler.kv_failed(payload)
        elif kind == "release":
            eng.scheduler.release_held(payload)
        elif kind == "call":
            fn, fut = payload
            try:
                fut.set_result(fn(eng))
            except Exception as e:  # returned to the caller, not fatal to the loop
                fut.set_exception(e)

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._drain(block=not eng.has_work)
            if self._stop.is_set():
                break
            if eng.has_work:
                try:
                    outputs = eng.step()
                except Exception:
                    log.exception("engine step failed; failing the running requests")
                    outputs = self._fail_all()
                if outputs:
                    self._on_outputs(outputs)
            reservations = eng.take_reservations()
            if reservations and self._on_reservations:
                self._on_reservations(reservations)
            events = eng.take_events()
            if events and self._on_events:
                self._on_events(events)
            # stats walk every queued request; readers poll them at most every 0.5 s, so refresh at
            # most every STATS_INTERVAL_S while busy (always once the engine goes idle)
            now = time.monotonic()
            if not eng.has_work or now - self._stats_at >= STATS_INTERVAL_S:
                self.stats, self._stats_at = eng.stats(), now

    def _fail_all(self) -> list[RequestOutput]:
        sched = self.engine.scheduler
        failed = list(sched.requests.values())
        for req in failed:
            sched.abort(req.request_id)
        sched.release_deferred()          # no step is in flight any more (Engine.step dropped it)
        return [RequestOutput(r.request_id, [], FinishReason.ERROR, 0, r.session, error="engine step failed",
                              internal_error=True)
                for r in failed]

"""The engine step: schedule → execute → update, and the thread that runs it.

`Engine` is single-threaded: `add_request` takes a plain `EngineRequest`, and `step()` returns one
`StepResult` (the step's outputs, the KV events and the remote-prefill reservations it caused).
`EngineLoop` runs it on its own thread, fed by a queue of typed commands (engine/commands.py), so
that gRPC, Redis and detokenization never wait on the model and the model never waits on them.
Results leave through callbacks called on the engine thread; the caller hops them onto its event
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
from dataclasses import dataclass, field
from typing import Callable

from kvstore.pools.block_pool import BlockPool
from kvstore.events import KvEvent
from engine.commands import (Abort, AddRequest, Command, KvArrived, KvFailed, ReleaseHeld, RunOnEngine, Wake)
from engine.plan import StepPlan
from engine.request import Request
from engine.runner import Launched, Runner
from engine.scheduler import Scheduler
from runtime.config import EngineConfig
from runtime.types import EngineRequest, FinishReason, KvReservation, RequestOutput, TokenLogprobs

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
    num_gpu_hit_blocks: int = 0         # prompt blocks found in G1 (hits on the device tier)
    tiers: object | None = None         # kvstore.tiers.TierStats with the KV tiers on
    tier_copy_errors: int = 0           # G1 <-> G2 copies that failed
    num_onboarding: int = 0             # requests waiting for their blocks from host or disk
    num_deadline_deferred: int = 0      # prefill deadline order: prompts put behind savable ones, so far
    num_decoding: int = 0               # running requests past their prefill (what routers count as decodes)


@dataclass(slots=True)
class StepResult:
    """What one call of `Engine.step()` produced."""
    outputs: list[RequestOutput] = field(default_factory=list)
    events: list[KvEvent] = field(default_factory=list)            # blocks stored / removed
    reservations: list[KvReservation] = field(default_factory=list)  # remote prefills to start


def context_limit(cfg: EngineConfig, runner) -> int:
    """The longest sequence this engine runs: the runner's context (the model's, or a lower
    configured one) and what the KV cache holds. A configured --max-model-len that ends up lower
    is said once, with why."""
    kv_tokens = runner.num_blocks * cfg.block_size
    limit = min(runner.max_model_len, kv_tokens)
    if cfg.max_model_len and limit < cfg.max_model_len:
        why = []
        if runner.max_model_len < cfg.max_model_len:
            why.append(f"the model supports {runner.model_config.max_position_embeddings} positions "
                       "(max_position_embeddings)")
        if kv_tokens < cfg.max_model_len:
            why.append(f"the KV cache holds {kv_tokens} tokens ({runner.num_blocks} blocks of {cfg.block_size})")
        log.warning("--max-model-len %d lowered to %d: %s", cfg.max_model_len, limit, " and ".join(why))
    return limit


class Engine:
    def __init__(self, cfg: EngineConfig, runner: Runner | None = None) -> None:
        self.cfg = cfg
        self.runner = runner or (_mock_runner(cfg) if cfg.mock else _model_runner(cfg))
        self.max_model_len = context_limit(cfg, self.runner)
        self.pool = BlockPool(self.runner.num_blocks, enable_caching=cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, cfg.block_size, self.max_model_len, cfg.max_num_seqs,
                                   cfg.max_num_batched_tokens, self.runner.model_config.eos_token_ids)
        overlap = cfg.async_scheduling
        if overlap is None:          # on where a device runs steps beside the host (or the mock models one)
            overlap = self.runner.steps_beside_host
        self.async_scheduling = bool(overlap)
        self._in_flight: tuple[StepPlan, Launched, float] | None = None   # launched (at), not yet updated
        self._step_done_at = 0.0                # when the last launched step's result came in
        self.tier_io = None          # KV tiers below G1 (engine/kv_tiers.py); None: off
        self._prefill_meter = None   # measured prefill speed, for the tiers and the deadline order
        if cfg.kv_host_gib > 0 or cfg.kv_disk_gib > 0 or cfg.kv_disk_dir:
            from engine import kv_tiers
            self.tier_io = kv_tiers.build(cfg, self.runner, self.scheduler)
            self.tiers = self.tier_io.tiers
            self._prefill_meter = kv_tiers.PrefillMeter(self.scheduler.prefill_speed.tokens_per_s)

    def add_request(self, spec: EngineRequest) -> RequestOutput | None:
        """Queue a request; returns an immediate error output if it can never run here."""
        request = Request.of(spec)
        if request.request_id in self.scheduler.requests:
            # the one already here keeps running; the second copy is refused (its caller sees why)
            return RequestOutput(request.request_id, [], FinishReason.ERROR, 0, request.session,
                                 error=f"request {request.request_id} is already running on this worker")
        if spec.sampling.n > 1 or (spec.sampling.grammar is not None and not self.runner.supports_grammar):
            # in the interface (runtime/types.py), not yet in this engine: refused, never ignored
            what = "n > 1" if spec.sampling.n > 1 else "structured output (grammar)"
            return RequestOutput(request.request_id, [], FinishReason.ERROR, 0, request.session,
                                 error=f"{what} is not supported by this engine yet")
        if spec.sampling.prompt_logprobs is not None and not self.runner.supports_prompt_logprobs:
            return RequestOutput(request.request_id, [], FinishReason.ERROR, 0, request.session,
                                 error="prompt logprobs are not supported by this engine's runner")
        if spec.sampling.grammar is not None:
            why = ("ignore_eos cannot be combined with a grammar (the grammar ends the output)"
                   if spec.sampling.ignore_eos else self.runner.check_grammar(spec.sampling.grammar))
            if why:
                return RequestOutput(request.request_id, [], FinishReason.ERROR, 0, request.session, error=why)
        if request.num_tokens >= self.max_model_len or not request.prompt_token_ids:
            return RequestOutput(request.request_id, [], FinishReason.ERROR, 0, request.session,
                                 error=f"prompt of {request.num_tokens} tokens does not fit the context "
                                       f"of {self.max_model_len}")
        self.scheduler.add(request)
        return None

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    def kv_arrived(self, request_id: str, first_token: int, first_logprob: TokenLogprobs | None = None,
                   prompt_lps: list[TokenLogprobs] | None = None) -> RequestOutput | None:
        """Decode side: the prompt's KV landed in the reserved blocks; continue from `first_token`
        (with the prefill worker's logprobs of it and of the prompt, where the request asked)."""
        out = self.scheduler.kv_arrived(request_id, first_token, prompt_lps)
        if out is not None and first_logprob is not None:
            out.logprobs = [first_logprob]
        return out

    def kv_failed(self, request_id: str) -> None:
        """Decode side: the remote prefill failed; compute the prompt here, in the blocks we hold."""
        self.scheduler.kv_failed(request_id)

    def release_held(self, request_id: str) -> None:
        """Prefill side: unpin a finished hold_blocks request's blocks."""
        self.scheduler.remote.release_held(request_id)

    def step(self) -> StepResult:
        """Run one step if there is work (schedule → launch → commit → update), and collect what the
        step, and the commands handled since the last one, produced. Cheap when idle."""
        if self.tier_io is not None:
            return self._tier_step()
        return StepResult(self._run_step() if self.has_work else [], self.pool.take_events(),
                          self.scheduler.remote.take_reservations())

    def _tier_step(self) -> StepResult:
        io, sched = self.tier_io, self.scheduler
        io.poll()                               # copies that landed: blocks unpinned, requests requeued
        outputs = []
        if self.has_work:
            if not (sched.waiting or sched.running or self._in_flight):
                time.sleep(5e-4)                # only tier work under way: do not spin the core
            outputs = self._run_step()
        else:
            self.tiers.poll()                   # idle: finish disk write-backs
        return StepResult(outputs, self.pool.take_events() + self.tiers.take_events(),
                          sched.remote.take_reservations())

    def _measure_prefill(self, plan: StepPlan, seconds: float, end: float) -> None:
        """The prefill-speed meter (for the KV tiers' load-or-recompute choice and a prefill
        worker's deadline order) sees each step's tokens and the wall time it took; a prefill
        worker's scheduler charges that time to the prompts in the step."""
        if self.scheduler.track_prefill_time:
            self.scheduler.charge_prefill(plan, seconds, end)
        if (self.tier_io is not None or self.scheduler.order.deadline_s is not None) and plan.rows:
            if self._prefill_meter is None:      # the deadline order's pace, without KV tiers
                from engine.kv_tiers import PrefillMeter
                self._prefill_meter = PrefillMeter(self.scheduler.prefill_speed.tokens_per_s)
            speed = self._prefill_meter.observe(sum(r.num_tokens for r in plan.rows), seconds)
            if speed is not None:
                self.scheduler.prefill_speed = speed

    def _run_step(self) -> list[RequestOutput]:
        sched = self.scheduler
        plan = sched.schedule()
        if self.tier_io is not None and plan.copies:
            try:
                self.tier_io.start(plan)        # before the forward pass that reads onboarded blocks
            except BaseException:               # an onboard its rows needed failed: the step with it
                self._abandon(self._in_flight, plan)
                raise
        if not self.async_scheduling:
            if not plan:
                return []
            t0 = time.perf_counter()
            try:
                sampled = self.runner.execute(plan)
                logprobs, prompt_lps = self.runner.last_logprobs, self.runner.last_prompt_logprobs
            except BaseException:
                sched.abandon(plan)
                raise
            end = time.perf_counter()
            self._measure_prefill(plan, end - t0, end)
            sched.commit(plan)
            return sched.update(plan, sampled, logprobs, prompt_lps)
        prev, self._in_flight = self._in_flight, None
        launched_plan = None
        try:
            if plan:
                launched_plan = plan
                launched_at = time.perf_counter()
                launched = self.runner.launch(plan, prev[1] if prev else None)
                sched.commit(plan)
                self._in_flight = (plan, launched, launched_at)
            if not prev:
                return []
            sampled = prev[1].result()
            # the step's own time: from its launch, or from the previous step's end where it was
            # queued behind that one (it is measured where its result comes in, a call later)
            done = time.perf_counter()
            self._measure_prefill(prev[0], done - max(prev[2], self._step_done_at), done)
            self._step_done_at = done
            return sched.update(prev[0], sampled, prev[1].logprobs(), prev[1].prompt_logprobs())
        except BaseException:
            self._abandon(prev, launched_plan)
            raise

    def _abandon(self, prev: tuple | None, plan: StepPlan | None) -> None:
        """A step failed: forget it and the one launched before it, if any (their requests are
        failed by the caller)."""
        self._in_flight = None
        for p in (prev[0] if prev else None, plan):
            if p is not None:
                self.scheduler.abandon(p)
        self.scheduler.release_deferred()

    def stats(self) -> EngineStats:
        s = self.scheduler
        prefilling = [r for r in s.running if r.num_computed_tokens < r.num_tokens - 1]
        to_prefill = sum(r.num_tokens for r in s.waiting) + sum(
            r.num_tokens - r.num_computed_tokens - 1 for r in prefilling)
        io = self.tier_io
        return EngineStats(self.pool.num_blocks, self.pool.num_free, len(s.running), len(s.waiting),
                           s.num_preemptions, s.num_prompt_tokens, s.num_prefix_hit_tokens, to_prefill,
                           len(s.remote.awaiting_kv), len(s.remote.held), s.num_gpu_hit_blocks,
                           io.tiers.stats() if io is not None else None, io.copy_errors if io is not None else 0,
                           len(s.onboarding.waiting) if s.onboarding is not None else 0, s.order.num_deferred,
                           len(s.running) - len(prefilling))

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    def close(self) -> None:
        """Stop the KV tiers' disk thread and close their files (the index stays for a restart),
        and a tensor-parallel runner's other ranks."""
        if self.tier_io is not None:
            self.tiers.close()
            self.tier_io = self.scheduler.onboarding = None
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()


def _mock_runner(cfg: EngineConfig) -> Runner:
    from engine.mock_runner import MockModelRunner
    return MockModelRunner(cfg)


def _model_runner(cfg: EngineConfig) -> Runner:
    t0 = time.perf_counter()
    if cfg.tensor_parallel_size > 1:           # rank 0 of a worker that spans GPUs (engine/parallel/)
        from engine.parallel.runner import TpRunner as ModelRunner
    else:
        from engine.model_runner import ModelRunner
    imported_s = time.perf_counter() - t0
    runner = ModelRunner(cfg)
    runner.startup_s = {"runner_imports": round(imported_s, 3), **runner.startup_s}
    return runner


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

    def submit(self, request: EngineRequest) -> None:
        self._inbox.put(AddRequest(request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    def kv_arrived(self, request_id: str, first_token: int, first_logprob: TokenLogprobs | None = None,
                   prompt_lps: list[TokenLogprobs] | None = None) -> None:
        self._inbox.put(KvArrived(request_id, first_token, first_logprob, prompt_lps))

    def kv_failed(self, request_id: str) -> None:
        self._inbox.put(KvFailed(request_id))

    def release_held(self, request_id: str) -> None:
        self._inbox.put(ReleaseHeld(request_id))

    def call(self, fn: Callable[[Engine], object]) -> Future:
        """Run fn(engine) on the engine thread between steps (e.g. a consistent snapshot)."""
        fut: Future = Future()
        self._inbox.put(RunOnEngine(fn, fut))
        return fut

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(Wake())
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.engine.close()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                self._handle(cmd)
            except Exception:   # a bug in one command must not end the loop every request depends on
                log.exception("engine command %s failed; the loop goes on", type(cmd).__name__)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: Command) -> None:
        eng = self.engine
        out = None
        match cmd:
            case AddRequest(request):
                out = eng.add_request(request)
            case Abort(request_id):
                eng.abort_request(request_id)
            case KvArrived(request_id, first_token, first_logprob, prompt_lps):
                out = eng.kv_arrived(request_id, first_token, first_logprob, prompt_lps)
            case KvFailed(request_id):
                eng.kv_failed(request_id)
            case ReleaseHeld(request_id):
                eng.release_held(request_id)
            case RunOnEngine(fn, fut):
                try:
                    fut.set_result(fn(eng))
                except Exception as e:  # returned to the caller, not fatal to the loop
                    fut.set_exception(e)
            case Wake():
                pass
            case _:
                raise TypeError(f"not an engine command: {cmd!r}")
        if out is not None:
            self._on_outputs([out])

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._drain(block=not eng.has_work)
            if self._stop.is_set():
                break
            try:
                result = eng.step()
            except Exception as e:
                eng.runner.step_failed(e)
                log.exception("engine step failed; failing the running requests")
                result = StepResult(self._fail_all(), eng.pool.take_events(), eng.scheduler.remote.take_reservations())
            if result.outputs:
                self._on_outputs(result.outputs)
            if result.reservations and self._on_reservations:
                self._on_reservations(result.reservations)
            if result.events and self._on_events:
                self._on_events(result.events)
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

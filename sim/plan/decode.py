"""A simulated decode worker on a virtual clock: admission, local prefill and continuous batching.

What the engine's decode worker does with a request, as the simulator needs it (engine/scheduler.py
and decode_worker/remote_prefill.py are the real thing):

1. **Admission** (`offer`): requests wait here in arrival order and are admitted while the KV pool
   has room for the sequence (its prompt + output tokens are reserved at once, so nothing is ever
   preempted) and fewer than max_num_seqs sequences run or await their KV from a prefill worker
   (as in the engine). A request prefilled remotely (REMOTE) then has its blocks reserved
   and its prompt is sent to a prefill worker (`take_reserved`); it joins the batch when its KV has
   landed (`kv_landed`). A
   request whose KV is already here (READY: the decode-only stage of the static search) joins at
   admission.
2. **Local prefill**: admitted LOCAL prompts are computed in order, one at a time, in the token
   budget the decode tokens leave (max_num_batched_tokens - batch): each step carries one chunk,
   and costs the chunk's time on top of the decode step (`chunk_s`). A prompt's chunks share its
   total cost evenly over its steps. When its last chunk is done its first token is out
   (`due` reports it) and it joins the batch.
3. **Decode**, advanced analytically between events: every running sequence gains one token per
   step and a step of B sequences with summed context X lasts f(B, X / B) (+ the chunk's share
   while a prompt is being prefilled here). Between two events B is fixed and X grows by B per
   step, so the step time grows by b = f(B, C + 1) - f(B, C) per step: after s steps the time
   spent is a s + b s^2 / 2, inverted in closed form. Steps are continuous (a request joins
   mid-step instead of at the next boundary: at most one step per request).

The step statistics (`stat_*`) are what the planner's decode correction reads: the mean step time
includes the local prefill chunks, as the inter-token gaps a frontend measures do.

It knows nothing of routers, planners or the event queue; the simulator calls in.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from enum import IntEnum
from typing import Callable

from sim.plan.workers import Worker

StepFn = Callable[[int, float], float]          # (batch, context) -> decode step seconds
ChunkFn = Callable[[int, int], float]           # (start, tokens) -> a prefill chunk's extra seconds


class Kind(IntEnum):
    LOCAL = 0       # prefilled here
    REMOTE = 1      # prefilled by a prefill worker, its KV pushed here
    READY = 2       # its KV is already here


class DecodeWorker(Worker):
    __slots__ = ("step_fn", "chunk_s", "step_base_s", "max_seqs", "kv_tokens", "budget", "t0", "steps",
                 "batch", "ctx", "a", "b", "heap", "joined", "waiting", "reserved", "awaiting", "new_remote",
                 "lane", "lane_start", "lane_end", "lane_extra_s", "version", "stat_steps", "stat_batch", "stat_ctx",
                 "stat_busy_s")

    def __init__(self, wid: str, start_s: float, ready_s: float, step_fn: StepFn, max_seqs: int,
                 kv_tokens: int, chunk_s: ChunkFn | None = None, budget: int = 2048,
                 step_base_s: float = 0.0) -> None:
        super().__init__(wid, start_s, ready_s)
        self.step_fn, self.max_seqs, self.kv_tokens = step_fn, max_seqs, kv_tokens
        self.chunk_s, self.budget, self.step_base_s = chunk_s, budget, step_base_s
        self.t0 = 0.0           # the time the fluid state below describes
        self.steps = 0.0        # steps run so far (continuous)
        self.batch = 0
        self.ctx = 0.0          # summed context of the running sequences
        self.a = self.b = 0.0   # step time now, and its growth per step
        self.heap: list[tuple[float, int]] = []                 # (finishing step, request)
        self.joined: dict[int, tuple[float, float, int]] = {}   # request -> (step, context, reserved)
        self.waiting: deque[tuple[int, int, int, int, Kind]] = deque()   # (rid, prompt, output, cached, kind)
        self.reserved = 0
        self.awaiting: dict[int, tuple[int, int, int]] = {}     # REMOTE, reserved: rid -> (prompt, output, kv)
        self.new_remote: list[int] = []                         # reserved since take_reserved
        self.lane: deque[tuple[int, int, int, int]] = deque()   # LOCAL, admitted: (rid, prompt, output, cached)
        self.lane_start = 0.0         # the step at which the head of the lane started
        self.lane_end = math.inf      # the step at which the head of the lane is computed
        self.lane_extra_s = 0.0       # its chunk's seconds per step
        self.version = 0        # bumped whenever the next event time may change
        self.stat_steps = self.stat_batch = self.stat_ctx = self.stat_busy_s = 0.0

    @property
    def load(self) -> int:
        return self.batch + len(self.waiting) + len(self.awaiting) + len(self.lane)

    @property
    def waiting_prefill_tokens(self) -> int:
        """What the engine reports as prefill to do: waiting prompts whole, the lane's left."""
        left = sum(p for _, p, _, _, _ in self.waiting) + sum(p for _, p, _, _ in self.lane)
        if self.lane and math.isfinite(self.lane_end):
            _, prompt, _, cached = self.lane[0]
            done = 1.0 - max(self.lane_end - self.steps, 0.0) / max(self.lane_end - self.lane_start, 1e-9)
            left -= int(done * (prompt - cached))
        return left

    @property
    def idle(self) -> bool:
        return not (self.batch or self.waiting or self.awaiting or self.lane)

    def advance(self, now_s: float) -> None:
        """Run the steps up to now_s."""
        dt = now_s - self.t0
        if dt <= 0:
            return
        if self.batch or self.lane:
            a, b, n = self.a, self.b, self.batch
            ds = dt / a if b <= 1e-15 * a else (math.sqrt(a * a + 2 * b * dt) - a) / b
            if n:               # the steps that decode: the ones whose gaps a frontend measures
                self.stat_steps += ds
                self.stat_batch += n * ds
                self.stat_ctx += ds * (self.ctx + n * ds / 2)
                self.stat_busy_s += dt
            self.ctx += n * ds
            self.steps += ds
            self.a = a + b * ds
        self.t0 = now_s

    def offer(self, rid: int, prompt: int, output: int, kind: Kind, cached: int = 0) -> None:
        """A request routed here (call advance first): admit it now, or it waits here, in order."""
        self.waiting.append((rid, prompt, output, cached, kind))
        self._admit()

    def take_reserved(self) -> list[int]:
        """REMOTE requests whose blocks were reserved since the last call: send their prompts."""
        out, self.new_remote = self.new_remote, []
        return out

    def kv_landed(self, rid: int) -> None:
        """A REMOTE request's KV is here (call advance first): it joins the batch."""
        prompt, output, need = self.awaiting.pop(rid)
        self._join(rid, prompt, output, need)
        self._refit()

    def to_local(self, rid: int) -> None:
        """A REMOTE request's prefill worker refused it: compute its prompt here (its blocks are
        held already; it takes the lane without a running slot of its own, as the engine's
        kv_failed appends it to the running requests)."""
        prompt, output, _ = self.awaiting.pop(rid)
        self._enqueue_lane(rid, prompt, output, 0)
        self._refit()

    def due(self) -> tuple[list[int], list[int]]:
        """(sequences whose last step is done, LOCAL prompts whose prefill is done and whose first
        token is now out); call advance first. Admits waiting requests into the room made."""
        done: list[int] = []
        prefilled: list[int] = []
        heap = self.heap
        while heap and heap[0][0] <= self.steps + 1e-6:
            _, rid = heapq.heappop(heap)
            step0, ctx0, reserved = self.joined.pop(rid)
            self.batch -= 1
            self.ctx -= ctx0 + (self.steps - step0)
            self.reserved -= reserved
            done.append(rid)
        if not self.batch:
            self.ctx = 0.0
        while self.lane and self.lane_end <= self.steps + 1e-6:
            rid, prompt, output, _ = self.lane.popleft()
            prefilled.append(rid)
            self._join(rid, prompt, output, 0)
            self._start_lane()
        self._admit()
        return done, prefilled

    def next_event_s(self) -> float | None:
        """When the earliest running sequence finishes or the lane's prompt is computed, if
        nothing joins before."""
        target = min(self.heap[0][0] if self.heap else math.inf, self.lane_end if self.lane else math.inf)
        if not math.isfinite(target):
            return None
        d = max(target - self.steps, 0.0)
        return self.t0 + self.a * d + self.b * d * d / 2

    # ---- internals ------------------------------------------------------------------------------

    def _admit(self) -> None:
        waiting = self.waiting
        while waiting:
            rid, prompt, output, cached, kind = waiting[0]
            need = prompt + output
            if self.reserved + need > self.kv_tokens and (self.batch or self.awaiting or self.lane):
                break
            if self.batch + len(self.lane) + len(self.awaiting) >= self.max_seqs:
                break           # the engine admits while fewer than max_num_seqs run or await their KV
            waiting.popleft()
            self.reserved += need
            if kind is Kind.REMOTE:
                self.awaiting[rid] = (prompt, output, need)
                self.new_remote.append(rid)
            elif kind is Kind.READY:
                self._join(rid, prompt, output, need)
            else:
                self._enqueue_lane(rid, prompt, output, cached)
        self._refit()

    def _join(self, rid: int, prompt: int, output: int, need: int) -> None:
        """The sequence's first token is out: it decodes its output - 1 other tokens here. `need`:
        the KV it reserved (0: already counted, a LOCAL prompt's at its admission)."""
        if output <= 1:
            self.reserved -= need or prompt + output
            return
        self.batch += 1
        self.ctx += prompt + 1
        self.joined[rid] = (self.steps, prompt + 1, need or prompt + output)
        heapq.heappush(self.heap, (self.steps + output - 1, rid))

    def _enqueue_lane(self, rid: int, prompt: int, output: int, cached: int) -> None:
        self.lane.append((rid, prompt, output, cached))
        if len(self.lane) == 1:
            self._start_lane()

    def _start_lane(self) -> None:
        """The head of the lane starts: its chunks, one a step, in the budget the decodes leave."""
        if not self.lane:
            self.lane_end, self.lane_extra_s = math.inf, 0.0
            return
        _, prompt, _, cached = self.lane[0]
        start = min(max(cached, 0), prompt - 1)
        n = max(self.budget - self.batch, 1)
        k = -(-(prompt - start) // n)
        total = sum(self.chunk_s(s, min(n, prompt - s)) for s in range(start, prompt, n)) if self.chunk_s else 0.0
        self.lane_start, self.lane_end = self.steps, self.steps + k
        self.lane_extra_s = total / k

    def _refit(self) -> None:
        self.version += 1
        n = self.batch
        extra = self.lane_extra_s if self.lane else 0.0
        if not n:
            self.a, self.b = (extra + self.step_base_s, 0.0) if self.lane else (0.0, 0.0)
            return
        c = self.ctx / n
        base = self.step_fn(n, c)
        self.a = base + extra
        self.b = max(self.step_fn(n, c + 1) - base, 0.0)

"""Simulated workers on a virtual clock: what one prefill or decode worker does with its requests.

Lifecycle (docs/operations.md): STARTING (costs a GPU, serves nothing) -> READY -> DRAINING (takes no new
work, finishes what it holds) -> STOPPED. A worker costs GPU time from its start to its stop.

- `PrefillWorker`: one server, in arrival order or (with a TTFT deadline) in deadline order. A
  prompt's service time is the profile's prefill time at its cached prefix, fixed when it is
  queued. It keeps an LRU prefix cache of trace blocks (what its KV pool holds) and reports
  stored / evicted blocks as KV events.
- `DecodeWorker`: continuous batching, advanced analytically between events. Every running
  sequence gains one token per step and a step of B sequences with summed context X lasts
  f(B, X / B) (the profile). Between two events (a join or a finish) B is fixed and X grows by B
  per step, so the step time grows by b = f(B, C + 1) - f(B, C) per step: after s steps the time
  spent is a s + b s^2 / 2, inverted in closed form. Steps are treated as continuous (a request
  joins mid-step instead of at the next step boundary: an error of at most one step per request).
  Admission reserves a sequence's prompt + output tokens of KV (so nothing is ever preempted) and
  at most max_num_seqs sequences run; the rest wait, in order, on the worker.

It knows nothing of routers, planners or the event queue; the simulator calls in.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from enum import IntEnum
from typing import Callable

from kvstore.events import BlockRemoved, BlockStored, KvEvent


class State(IntEnum):
    STARTING = 0
    READY = 1
    DRAINING = 2
    STOPPED = 3


class Worker:
    __slots__ = ("wid", "state", "start_s", "ready_s", "stop_s")

    def __init__(self, wid: str, start_s: float, ready_s: float) -> None:
        self.wid = wid
        self.state = State.READY if ready_s <= start_s else State.STARTING
        self.start_s, self.ready_s = start_s, ready_s
        self.stop_s: float | None = None

    def stop(self, now_s: float) -> None:
        self.state = State.STOPPED
        self.stop_s = now_s

    def gpu_s(self, end_s: float) -> float:
        stop = end_s if self.stop_s is None else min(self.stop_s, end_s)
        return max(stop - self.start_s, 0.0)


class PrefillWorker(Worker):
    """One prompt at a time, for the profile's time. Queued prompts go in arrival order, or with a
    `deadline_s` (the TTFT target) in deadline order: the oldest prompt that can still finish
    within its deadline, and the ones that cannot only when none can (as the engine's prefill
    workers do with a TTFT target, engine/sched/order.py)."""
    __slots__ = ("free_at", "in_flight", "cache", "cache_blocks", "seq", "deadline_s", "queue", "late")

    def __init__(self, wid: str, start_s: float, ready_s: float, cache_blocks: int,
                 deadline_s: float | None = None) -> None:
        super().__init__(wid, start_s, ready_s)
        self.free_at = 0.0                 # when the prompt being computed is done
        self.in_flight = 0                 # computing + queued
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.cache_blocks = cache_blocks
        self.seq = 0                       # KV event batches published
        self.deadline_s = deadline_s
        self.queue: deque[tuple[int, float, float]] = deque()   # (request, arrival, service), arrival order
        self.late: deque[tuple[int, float, float]] = deque()    # those past saving, arrival order

    def submit(self, now_s: float, rid: int, arrival_s: float, service_s: float) -> tuple[int, float, float] | None:
        """Queue a prompt; (it, its start, its completion) if it starts at once."""
        self.in_flight += 1
        self.queue.append((rid, arrival_s, service_s))
        return self.next(now_s) if self.free_at <= now_s and len(self.queue) == 1 and not self.late else None

    def next(self, now_s: float) -> tuple[int, float, float] | None:
        """The worker is free at now_s: start the next prompt; (it, its start, its completion)."""
        queue = self.queue
        if self.deadline_s is not None:
            while queue and now_s + queue[0][2] > queue[0][1] + self.deadline_s:
                self.late.append(queue.popleft())      # late now, so late for good
        if queue:
            rid, _, service = queue.popleft()
        elif self.late:
            rid, _, service = self.late.popleft()
        else:
            return None
        self.free_at = now_s + service
        return rid, now_s, self.free_at

    @property
    def backlog_s(self) -> float:
        """Work left at the last start: for choosing whom to drain."""
        return self.free_at + sum(s for _, _, s in self.queue) + sum(s for _, _, s in self.late)

    def store(self, blocks: tuple[int, ...]) -> list[KvEvent]:
        """The prompt's full blocks are now cached here (LRU); the events that say so."""
        cache = self.cache
        new = []
        for h in blocks:
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
                new.append(h)
        gone = []
        while len(cache) > self.cache_blocks:
            gone.append(cache.popitem(last=False)[0])
        events: list[KvEvent] = []
        if new:
            events.append(BlockStored(tuple(new), None))
        if gone:
            events.append(BlockRemoved(tuple(gone)))
        return events


class DecodeWorker(Worker):
    __slots__ = ("step_fn", "max_seqs", "kv_tokens", "t0", "steps", "batch", "ctx", "a", "b", "heap",
                 "joined", "waiting", "reserved", "version", "stat_steps", "stat_batch", "stat_ctx",
                 "stat_busy_s")

    def __init__(self, wid: str, start_s: float, ready_s: float, step_fn: Callable[[int, float], float],
                 max_seqs: int, kv_tokens: int) -> None:
        super().__init__(wid, start_s, ready_s)
        self.step_fn, self.max_seqs, self.kv_tokens = step_fn, max_seqs, kv_tokens
        self.t0 = 0.0           # the time the fluid state below describes
        self.steps = 0.0        # steps run so far (continuous)
        self.batch = 0
        self.ctx = 0.0          # summed context of the running sequences
        self.a = self.b = 0.0   # step time now, and its growth per step
        self.heap: list[tuple[float, int]] = []                 # (finishing step, request)
        self.joined: dict[int, tuple[float, float, int]] = {}   # request -> (step, context, reserved)
        self.waiting: deque[tuple[int, int, int]] = deque()     # (request, prompt, output)
        self.reserved = 0
        self.version = 0        # bumped whenever the next finish time may change
        self.stat_steps = self.stat_batch = self.stat_ctx = self.stat_busy_s = 0.0

    @property
    def load(self) -> int:
        return self.batch + len(self.waiting)

    @property
    def idle(self) -> bool:
        return not self.batch and not self.waiting

    def advance(self, now_s: float) -> None:
        """Run the batch up to now_s."""
        dt = now_s - self.t0
        if dt <= 0:
            return
        if self.batch:
            a, b, n = self.a, self.b, self.batch
            ds = dt / a if b <= 1e-15 * a else (math.sqrt(a * a + 2 * b * dt) - a) / b
            self.stat_steps += ds
            self.stat_batch += n * ds
            self.stat_ctx += ds * (self.ctx + n * ds / 2)
            self.stat_busy_s += dt
            self.ctx += n * ds
            self.steps += ds
            self.a = a + b * ds
        self.t0 = now_s

    def offer(self, rid: int, prompt: int, output: int) -> None:
        """A request whose first token is out (call advance first): join now, or wait here."""
        self.waiting.append((rid, prompt, output))
        self._admit()

    def finish_due(self) -> list[int]:
        """Remove the sequences whose last step is done (call advance first); admit waiters."""
        done = []
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
        self._admit()
        return done

    def next_finish_s(self) -> float | None:
        """When the earliest running sequence finishes, if nothing joins before."""
        if not self.heap:
            return None
        d = max(self.heap[0][0] - self.steps, 0.0)
        return self.t0 + self.a * d + self.b * d * d / 2

    def _admit(self) -> None:
        waiting = self.waiting
        while waiting and self.batch < self.max_seqs:
            rid, prompt, output = waiting[0]
            need = prompt + output
            if self.batch and self.reserved + need > self.kv_tokens:
                break
            waiting.popleft()
            self.batch += 1
            self.ctx += prompt + 1
            self.reserved += need
            self.joined[rid] = (self.steps, prompt + 1, need)
            heapq.heappush(self.heap, (self.steps + output - 1, rid))
        self._refit()

    def _refit(self) -> None:
        self.version += 1
        n = self.batch
        if not n:
            self.a = self.b = 0.0
            return
        c = self.ctx / n
        self.a = self.step_fn(n, c)
        self.b = max(self.step_fn(n, c + 1) - self.a, 0.0)

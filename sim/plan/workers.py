"""Simulated workers on a virtual clock: what one prefill or decode worker does with its requests.

Lifecycle (docs/operations.md): STARTING (costs a GPU, serves nothing) -> READY -> DRAINING (takes no new
work, finishes what it holds) -> STOPPED. A worker costs GPU time from its start to its stop.

- `PrefillWorker`: one server, in arrival order or (with a TTFT deadline) in deadline order. A
  prompt's service time is the profile's prefill time at its cached prefix, fixed when it is
  queued. It keeps an LRU prefix cache of trace blocks (what its KV pool holds) and reports
  stored / evicted blocks as KV events.
- The decode worker (admission, local prefill, continuous batching) is in sim/plan/decode.py.

It knows nothing of routers, planners or the event queue; the simulator calls in.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from enum import IntEnum

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
    __slots__ = ("free_at", "in_flight", "cache", "cache_blocks", "seq", "deadline_s", "queue", "late", "queued_s",
                 "queued_tokens")

    def __init__(self, wid: str, start_s: float, ready_s: float, cache_blocks: int,
                 deadline_s: float | None = None) -> None:
        super().__init__(wid, start_s, ready_s)
        self.free_at = 0.0                 # when the prompt being computed is done
        self.in_flight = 0                 # computing + queued
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.cache_blocks = cache_blocks
        self.seq = 0                       # KV event batches published
        self.deadline_s = deadline_s
        # (request, arrival, service, prompt tokens), in arrival order
        self.queue: deque[tuple[int, float, float, int]] = deque()
        self.late: deque[tuple[int, float, float, int]] = deque()    # those past saving, in arrival order
        self.queued_s = 0.0                # the service time of the queued prompts (both queues)
        self.queued_tokens = 0             # their prompt tokens: what the worker reports as waiting

    def submit(self, now_s: float, rid: int, arrival_s: float, service_s: float,
               tokens: int = 0) -> tuple[int, float, float] | None:
        """Queue a prompt (of `tokens` tokens); (it, its start, its completion) if it starts at once."""
        self.in_flight += 1
        self.queued_s += service_s
        self.queued_tokens += tokens
        self.queue.append((rid, arrival_s, service_s, tokens))
        return self.next(now_s) if self.free_at <= now_s and len(self.queue) == 1 and not self.late else None

    def next(self, now_s: float) -> tuple[int, float, float] | None:
        """The worker is free at now_s: start the next prompt; (it, its start, its completion)."""
        queue = self.queue
        if self.deadline_s is not None:
            while queue and now_s + queue[0][2] > queue[0][1] + self.deadline_s:
                self.late.append(queue.popleft())      # late now, so late for good
        if queue:
            rid, _, service, tokens = queue.popleft()
        elif self.late:
            rid, _, service, tokens = self.late.popleft()
        else:
            return None
        self.queued_s -= service
        self.queued_tokens -= tokens
        self.free_at = now_s + service
        return rid, now_s, self.free_at

    @property
    def backlog_s(self) -> float:
        """When the work it holds would be done: for choosing whom to drain."""
        return self.free_at + self.queued_s

    def expected_finish_s(self, now_s: float, service_s: float) -> float:
        """Seconds until a prompt of `service_s` queued now would be computed, behind everything
        queued here: what a prefill worker weighs against a decode worker's lease."""
        return max(self.free_at - now_s, 0.0) + self.queued_s + service_s

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

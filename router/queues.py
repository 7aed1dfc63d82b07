"""Each worker's prefill queue as the router predicts it: when would a new prompt start?

A worker admits prompts in arrival order and prefills them ahead of nothing else that matters to a
new prompt's first token, so its queue is a FIFO of prefill work, each item worth the seconds the
cost model (router/cost.py) predicted when the router sent it. The router keeps, per worker,

    busy_until = when the work it has sent there will be done (a virtual clock),

and a new prompt would start at max(now, busy_until). Routing adds the prompt's predicted prefill
time; the first token of a request (the frontend sees it) proves that it, and everything sent
before it, is done, so busy_until is re-anchored to now + what is still queued behind it, and the
prediction's errors never accumulate. A request that ends without a first token (cancelled,
failed) leaves the queue.

Worker reports (queued prompt tokens, from every frontend) can only raise the estimate: the tokens
the report counts minus the cached tokens of this router's own queued prompts (the report counts a
waiting prompt whole) are a lower bound of the queue, and they make work that other frontends sent
visible. Their decoding counts do the same for decodes: what a worker decodes beyond this router's
own decodes there was sent by other frontends (`others`), and the KV cost counts both.

Pure: an injected clock, no I/O. It knows nothing of the index or of how a worker is chosen.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass(slots=True)
class _Queue:
    # request id -> (predicted prefill seconds, cached tokens), in routing order
    items: OrderedDict[str, tuple[float, int]] = field(default_factory=OrderedDict)
    cached_tokens: int = 0          # sum over items


class PrefillQueues:
    """The queues, with each worker's queue end and decode count in arrays indexed by its row, so
    that the KV policy's scan over candidates (router/selection.py) reads them vectorized."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._queues: dict[str, _Queue] = {}
        self._owner: dict[str, str] = {}            # queued request id -> worker id
        self.row: dict[str, int] = {}               # worker -> its row in the arrays below
        self._free_rows: list[int] = []
        # row -> when the prefill work queued on that worker ends (a virtual clock)
        self.busy_until = np.zeros(8)
        # row -> requests that worker is decoding for this router (first token out, not finished)
        self.decoding = np.zeros(8, dtype=np.int64)
        self.decoding_total = 0                     # sum of ``decoding``: 0 lets the scan skip it
        self._decoder: dict[str, str] = {}          # decoding request id -> worker id
        # request id -> the worker it was first routed to, when its prefill moved to another
        # worker (a disaggregated request: it decodes on the first once its first token is out)
        self._moved: dict[str, str] = {}
        # row -> requests that worker decodes for other routers (its last report's decoding count
        # less what this router had decoding there then): other frontends' load
        self.others = np.zeros(8, dtype=np.int64)
        self.others_total = 0

    def add_worker(self, worker_id: str) -> None:
        if worker_id in self._queues:
            return
        self._queues[worker_id] = _Queue()
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = len(self.row)
            if row == len(self.busy_until):
                self.busy_until = np.concatenate([self.busy_until, np.zeros(row)])
                self.decoding = np.concatenate([self.decoding, np.zeros(row, dtype=np.int64)])
                self.others = np.concatenate([self.others, np.zeros(row, dtype=np.int64)])
        self.row[worker_id] = row
        self.busy_until[row] = 0.0
        self.decoding[row] = 0
        self.others[row] = 0

    def remove_worker(self, worker_id: str) -> None:
        q = self._queues.pop(worker_id, None)
        if q is None:
            return
        row = self.row.pop(worker_id)
        self._free_rows.append(row)
        self.decoding_total -= int(self.decoding[row])
        self.decoding[row] = 0
        self.others_total -= int(self.others[row])
        self.others[row] = 0
        for rid in [r for r, w in self._decoder.items() if w == worker_id]:
            del self._decoder[rid]
        for rid in q.items:
            self._owner.pop(rid, None)
            self._moved.pop(rid, None)

    def wait_s(self, worker_id: str) -> float:
        """Seconds until the worker would start a prompt sent now."""
        return max(0.0, float(self.busy_until[self.row[worker_id]]) - self._clock())

    def queued(self, worker_id: str) -> int:
        return len(self._queues[worker_id].items)

    def is_queued(self, request_id: str) -> bool:
        """Whether the request's prefill is still ahead (routed, no first token yet)."""
        return request_id in self._owner

    def route(self, request_id: str, worker_id: str, prefill_s: float, cached_tokens: int) -> None:
        """Queue the request's prefill on the worker (moving it if it was queued elsewhere: the
        prefill half of a disaggregated request runs on the prefill worker, not the decode one,
        which is remembered: the request decodes there once its first token is out)."""
        first = self._owner.get(request_id)
        if first is not None:
            if first != worker_id and request_id not in self._moved:
                self._moved[request_id] = first
            self._drop(request_id)
        q = self._queues[worker_id]
        row = self.row[worker_id]
        self.busy_until[row] = max(self._clock(), float(self.busy_until[row])) + prefill_s
        q.items[request_id] = (prefill_s, cached_tokens)
        q.cached_tokens += cached_tokens
        self._owner[request_id] = worker_id

    def first_token(self, request_id: str) -> None:
        """The request's prefill is done, and so is every prompt sent to its worker before it."""
        worker_id = self._owner.get(request_id)
        if worker_id is None:
            moved = self._moved.pop(request_id, None)      # its prefill worker's queue let it go first
            if moved is not None:
                self._count_decode(request_id, moved)
            return
        q = self._queues[worker_id]
        while q.items:
            rid, (_, cached) = q.items.popitem(last=False)
            del self._owner[rid]
            q.cached_tokens -= cached
            moved = self._moved.pop(rid, None)      # prompts sent before it are done too
            self._count_decode(rid, moved if moved is not None else worker_id)
            if rid == request_id:
                break
        row = self.row[worker_id]
        self.busy_until[row] = self._clock() + (sum(s for s, _ in q.items.values()) if q.items else 0)

    def _count_decode(self, request_id: str, worker_id: str) -> None:
        row = self.row.get(worker_id)
        if row is not None:                         # a decode worker gone meanwhile counts nothing
            self._decoder[request_id] = worker_id
            self.decoding[row] += 1
            self.decoding_total += 1

    def finished(self, request_id: str, worker_id: str | None = None) -> None:
        """The request ended (on ``worker_id`` only, if given: the prefill half of a disaggregated
        request, done or given up, or a decode worker that let it go); if it never got a first
        token, its work leaves the queue."""
        owner = self._owner.get(request_id)
        moved = self._moved.get(request_id)
        if worker_id is None or (moved is not None and worker_id == moved):
            if owner is not None:
                self._drop(request_id)
            self._moved.pop(request_id, None)
        elif owner is not None and worker_id == owner:
            self._drop(request_id)                  # its decode worker, if moved, is still known
        decoder = self._decoder.get(request_id)
        if decoder is not None and (worker_id is None or worker_id == decoder):
            del self._decoder[request_id]
            self.decoding[self.row[decoder]] -= 1
            self.decoding_total -= 1

    def _drop(self, request_id: str) -> None:
        worker_id = self._owner.pop(request_id)
        q = self._queues[worker_id]
        prefill_s, cached = q.items.pop(request_id)
        q.cached_tokens -= cached
        row = self.row[worker_id]
        self.busy_until[row] = max(self._clock(), float(self.busy_until[row]) - prefill_s)

    def report(self, worker_id: str, waiting_prefill_tokens: int,
               seconds_of: Callable[[int], float]) -> None:
        """A worker's own count of queued prompt tokens: raise the estimate if it shows more work."""
        q = self._queues[worker_id]
        uncached = waiting_prefill_tokens - q.cached_tokens
        if uncached > 0:
            floor = self._clock() + seconds_of(uncached)
            row = self.row[worker_id]
            if floor > self.busy_until[row]:
                self.busy_until[row] = floor


    def report_decoding(self, worker_id: str, num_decoding: int) -> None:
        """A worker's decoding requests by its own count: those beyond this router's decodes and
        queued prompts there (a worker counts a prompt as decoding from the step that computes its
        last chunk, a step before its first token reaches the router) were sent by other routers
        (other frontends), and count as decodes until the next report."""
        row = self.row[worker_id]
        others = max(0, num_decoding - int(self.decoding[row]) - len(self._queues[worker_id].items))
        self.others_total += others - int(self.others[row])
        self.others[row] = others

    def decodes(self) -> np.ndarray | None:
        """Per row, the requests each worker is decoding: this router's, plus what the workers last
        reported running for other routers; None when there are none (the scan skips the term)."""
        if not self.others_total:
            return self.decoding if self.decoding_total else None
        return self.decoding + self.others


class Utilisation:
    """The fleet's prefill utilisation as routed: predicted prefill seconds sent over the last
    ``window`` decisions, divided by the time they span and the number of workers.

    Counting decisions rather than seconds makes the window follow the request rate; before
    ``window // 4`` decisions there is no estimate (0).
    """

    def __init__(self, window: int = 256) -> None:
        assert window >= 4
        self._window = window
        self._routes: deque[tuple[float, float]] = deque()      # (time, prefill seconds)
        self._sum_s = 0.0

    def add(self, now: float, prefill_s: float) -> None:
        self._routes.append((now, prefill_s))
        self._sum_s += prefill_s
        if len(self._routes) > self._window:
            self._sum_s -= self._routes.popleft()[1]

    def value(self, now: float, num_workers: int) -> float:
        routes = self._routes
        if len(routes) < self._window // 4 or num_workers <= 0:
            return 0.0
        span = now - routes[0][0]
        # the oldest route's work began the window: count the span from it, and at least that work
        return self._sum_s / (max(span, routes[0][1]) * num_workers) if span > 0 or routes[0][1] > 0 else 0.0

"""Per-worker load as the router sees it: what it routed, corrected by what workers report.

A worker's load is its last reported value plus what the router sent it since that report. A
request routed before a report is assumed to be inside the report, so finishing it changes
nothing until the next report says so; a worker that never reports is tracked by the router's
own accounting alone (route adds, finish subtracts).

Two loads per worker: decode blocks (KV held by running sequences, plus the blocks its queued
prompt tokens will take) and prefill blocks (prompt blocks queued for prefill). Which one a policy looks at depends on the worker's role.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class _WorkerLoad:
    epoch: int = 0                  # bumped on every report
    reported_decode: float = 0.0
    reported_prefill: float = 0.0
    routed_decode: float = 0.0      # routed since the last report
    routed_prefill: float = 0.0


# One routing of a request: (worker, decode blocks, prefill blocks, the worker's epoch then). A
# plain tuple: one is made per decision.
_Routed = tuple[str, float, float, int]


@dataclass(slots=True)
class LoadTracker:
    block_size: int
    _workers: dict[str, _WorkerLoad] = field(default_factory=dict)
    _requests: dict[str, list[_Routed]] = field(default_factory=dict)
    # reported + routed, kept current so that selection reads one dict instead of calling per worker
    decode: dict[str, float] = field(default_factory=dict)
    prefill: dict[str, float] = field(default_factory=dict)

    def add_worker(self, worker_id: str) -> None:
        w = self._workers.setdefault(worker_id, _WorkerLoad())
        self._refresh(worker_id, w)

    def remove_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        self.decode.pop(worker_id, None)
        self.prefill.pop(worker_id, None)

    def _refresh(self, worker_id: str, w: _WorkerLoad) -> None:
        self.decode[worker_id] = w.reported_decode + w.routed_decode
        self.prefill[worker_id] = w.reported_prefill + w.routed_prefill

    def route(self, request_id: str, worker_id: str, decode_blocks: float,
              prefill_blocks: float) -> None:
        w = self._workers[worker_id]
        if decode_blocks:
            w.routed_decode += decode_blocks
            self.decode[worker_id] = w.reported_decode + w.routed_decode
        if prefill_blocks:
            w.routed_prefill += prefill_blocks
            self.prefill[worker_id] = w.reported_prefill + w.routed_prefill
        routed = (worker_id, decode_blocks, prefill_blocks, w.epoch)
        earlier = self._requests.get(request_id)
        if earlier is None:
            self._requests[request_id] = [routed]
        else:
            earlier.append(routed)

    def finish(self, request_id: str, worker_id: str | None = None) -> bool:
        """Release a request's load (on ``worker_id`` only, if given). False if nothing was held."""
        routed = self._requests.get(request_id)
        if not routed:
            return False
        if worker_id is None:       # the usual end: everything it held, no list to rebuild
            del self._requests[request_id]
            for r in routed:
                self._release(r)
            return True
        keep = [r for r in routed if r[0] != worker_id]
        if len(keep) == len(routed):
            return False
        for r in routed:
            if r[0] == worker_id:
                self._release(r)
        if keep:
            self._requests[request_id] = keep
        else:
            del self._requests[request_id]
        return True

    def _release(self, routed: _Routed) -> None:
        """Take one routing's load off its worker, unless a report has counted it since."""
        wid, decode_blocks, prefill_blocks, epoch = routed
        w = self._workers.get(wid)
        if w is not None and w.epoch == epoch:     # a load of 0 changes nothing: not rewritten
            if decode_blocks:
                w.routed_decode = max(0.0, w.routed_decode - decode_blocks)
                self.decode[wid] = w.reported_decode + w.routed_decode
            if prefill_blocks:
                w.routed_prefill = max(0.0, w.routed_prefill - prefill_blocks)
                self.prefill[wid] = w.reported_prefill + w.routed_prefill

    def report(self, worker_id: str, active_blocks: int, waiting_prefill_tokens: int) -> None:
        w = self._workers[worker_id]
        w.epoch += 1
        # Queued prompts hold no blocks yet but will: count them, or a report would erase the
        # requests routed just before it (they are assumed inside it) while they wait.
        w.reported_decode = active_blocks + waiting_prefill_tokens / self.block_size
        w.reported_prefill = waiting_prefill_tokens / self.block_size
        w.routed_decode = 0.0
        w.routed_prefill = 0.0
        self._refresh(worker_id, w)

    def num_requests(self) -> int:
        return len(self._requests)

"""The disk tier's I/O thread: runs DiskPool writes, reads and probes off the engine's step loop.

The step loop submits a DiskJob and goes on; the thread runs jobs one at a time in submission
order (so a slot's old row is always removed before a later job rewrites it) and appends each
finished job to a queue that the step loop drains with ``take_done()`` (never blocking). What the
I/O blocks on (NIXL POSIX polling, fdatasync, SQLite commits, xxhash) releases the GIL, so the
step loop keeps running meanwhile. An unexpected exception fails the job, never the thread.

A modelled disk (the mock engine's, ``block_s`` > 0): a read or write of n blocks is handed back
no sooner than n * block_s after the modelled disk was free, so jobs queue as on one device and
the step loop sees the profile's disk time, however fast the real I/O of the mock's small slots
was. The delay is in ``take_done`` (a job is not handed back early), never a sleep.

Knows nothing of slots' meaning or tiers' tables: the tier manager applies results.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvstore.movers.disk_pool import DiskError, DiskPool

log = logging.getLogger(__name__)


class DiskJobKind(Enum):
    WRITE = "write"      # items: WriteItems -> result: per item None | DiskError
    READ = "read"        # items: ReadItems  -> result: per item None | DiskError
    PROBE = "probe"      # items: disk slots, host_slots -> result: (write_s, read_s) or the exception


@dataclass(slots=True)
class DiskJob:
    kind: DiskJobKind
    items: list
    host_slots: list[int]
    owner: Any = None                # what the submitter needs back (an Onboarding)
    result: Any = None
    seconds: float = 0.0
    ready_at: float = 0.0            # perf_counter time from which take_done hands it back
    _done: threading.Event = field(default_factory=threading.Event)


class DiskWorker:
    def __init__(self, disk: DiskPool, block_s: float = 0.0) -> None:
        self.disk = disk
        self.block_s = block_s           # modelled seconds per block of a read or write; 0: real time
        self._free_at = 0.0              # when the modelled disk finishes its last job (the thread's)
        self._jobs: queue.Queue[DiskJob | None] = queue.Queue()
        self._done: collections.deque[DiskJob] = collections.deque()
        self.num_outstanding = 0         # submitted and not yet taken back (step loop's count)
        self._thread = threading.Thread(target=self._loop, name="kv-disk-io", daemon=True)
        self._thread.start()

    def submit(self, job: DiskJob) -> None:
        self.num_outstanding += 1
        self._jobs.put(job)

    def take_done(self) -> list[DiskJob]:
        """Finished jobs in completion order whose (modelled) time has come (the step loop's,
        non-blocking)."""
        out = []
        now = time.perf_counter()
        while self._done and self._done[0].ready_at <= now:
            out.append(self._done.popleft())
        self.num_outstanding -= len(out)
        return out

    def run(self, job: DiskJob, timeout_s: float) -> bool:
        """Submit and wait (start-up only: probes). False on timeout; the job is then left behind."""
        self._jobs.put(job)
        return job._done.wait(timeout_s)

    def close(self) -> None:
        """Finish the queued jobs, then stop."""
        self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            t0 = time.perf_counter()
            try:
                if job.kind == DiskJobKind.WRITE:
                    job.result = self.disk.write(job.items)
                elif job.kind == DiskJobKind.READ:
                    job.result = self.disk.read(job.items)
                else:
                    job.result = self.disk.probe(job.items, job.host_slots)
            except Exception as e:     # a bug or an unexpected OS error: fail the job, keep the thread
                log.exception("disk tier %s job failed", job.kind.value)
                error = DiskError.WRITE_ERROR if job.kind == DiskJobKind.WRITE else DiskError.READ_ERROR
                job.result = e if job.kind == DiskJobKind.PROBE else [error] * len(job.items)
            job.seconds = time.perf_counter() - t0
            if self.block_s and job.kind != DiskJobKind.PROBE:
                job.seconds = max(job.seconds, len(job.items) * self.block_s)
                job.ready_at = self._free_at = max(t0, self._free_at) + job.seconds
            if job.kind != DiskJobKind.PROBE:
                self._done.append(job)
            job._done.set()

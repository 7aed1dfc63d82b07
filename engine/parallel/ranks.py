"""The ranks 1..N-1 of a tensor-parallel worker, as seen from rank 0 (the worker process itself).

Rank 0 starts one process per other rank (`python -m engine.parallel.rank_main`, one per GPU of the
worker's share; they die with it: PR_SET_PDEATHSIG) and talks to each over two socket pairs,
inherited at spawn (no listener, no port, no key): one for the steps, one for the rank's KV
transfer agent (engine/parallel/kv.py), served on a thread of its own. The messages are small typed dataclasses
(`RankInit`, `RankReady`, `RankStop`) and the scheduler's plain-data `StepPlan`s themselves, one per
step, pickled: rank 0 sends a plan before it launches the plan's forward pass, so every rank enters
the pass's collectives in the same order.

A rank that dies takes the worker down: a watchdog thread sees the exit, logs it and ends this
process with `EXIT_RANK_LOST` (the other ranks die with it), because a collective waiting on a dead
peer never returns. The pool controller restarts the worker like any crashed one, and the
frontends migrate its requests. Knows nothing about the model: what the ranks run is
engine/parallel/rank_main.py, what rank 0 runs is engine/parallel/runner.py.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from runtime.config import EngineConfig
from runtime.process import with_parent_death

log = logging.getLogger(__name__)

EXIT_RANK_LOST = 3               # the worker's exit code when one of its ranks died
READY_TIMEOUT_S = 1800.0         # loading a model's share (and its CUDA graphs) may take this long
STOP_TIMEOUT_S = 10.0
WATCH_INTERVAL_S = 0.1


@dataclass(frozen=True, slots=True)
class RankInit:
    """Rank 0 -> rank r, first: who it is and where the process group's store is."""
    cfg: EngineConfig
    rank: int
    size: int
    store_addr: str              # host:port of the TCP store rank 0 hosts
    worker: str                  # for log lines: the worker this rank belongs to


@dataclass(frozen=True, slots=True)
class RankReady:
    """Rank r -> rank 0, once its share of the model runs."""
    rank: int
    num_blocks: int
    startup_s: dict[str, float]


@dataclass(frozen=True, slots=True)
class RankFailed:
    """Rank r -> rank 0: it could not start (the error, for rank 0's log), then it exits."""
    rank: int
    error: str


@dataclass(frozen=True, slots=True)
class RankStop:
    """Rank 0 -> rank r: the worker stops; leave the process group and exit."""


class RankLost(RuntimeError):
    """A rank died or failed to start."""


@dataclass(slots=True)
class _Rank:
    rank: int
    proc: subprocess.Popen
    conn: Connection
    lock: threading.Lock
    kv_conn: Connection


class RankSet:
    """Ranks 1..size-1 of this worker: started, initialised, sent each step's plan, stopped.

    One watchdog thread, from the start: it collects each rank's `RankReady`, and on a rank's
    `RankFailed` or exit calls `on_lost` (default: log it and end this process, since a collective
    waiting on the lost rank, or rank 0's own join, would never return)."""

    def __init__(self, cfg: EngineConfig, size: int, store_addr: str, worker: str = "worker",
                 on_lost=None) -> None:
        self.size, self.worker = size, worker
        self._on_lost = on_lost or self._exit
        self._ranks: list[_Rank] = []
        self._ready: dict[int, RankReady] = {}
        self._all_ready = threading.Event()
        self._stopping = threading.Event()
        self._lost_lock = threading.Lock()
        self._lost_seen = threading.Event()
        try:
            for r in range(1, size):
                self._ranks.append(self._spawn(r))
            for rk in self._ranks:
                rk.conn.send(RankInit(cfg, rk.rank, size, store_addr, worker))
        except BaseException:
            self.kill()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="tp-rank-watchdog", daemon=True)
        self._watchdog.start()

    @staticmethod
    def _spawn(rank: int) -> _Rank:
        (ours, theirs), (kv_ours, kv_theirs) = socket.socketpair(), socket.socketpair()
        try:
            argv = [sys.executable, "-m", "engine.parallel.rank_main", "--fd", str(theirs.fileno()),
                    "--kv-fd", str(kv_theirs.fileno())]
            proc = subprocess.Popen(with_parent_death(argv), pass_fds=(theirs.fileno(), kv_theirs.fileno()))
        finally:
            theirs.close()
            kv_theirs.close()
        return _Rank(rank, proc, Connection(ours.detach()), threading.Lock(), Connection(kv_ours.detach()))

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> list[RankReady]:
        """Every rank's `RankReady`, in rank order (RankLost past `timeout_s`; a rank that fails
        meanwhile goes to `on_lost`)."""
        if not self._all_ready.wait(timeout_s):
            missing = [rk.rank for rk in self._ranks if rk.rank not in self._ready]
            raise RankLost(f"tensor-parallel ranks {missing} were not ready within {timeout_s:.0f} s")
        return [self._ready[rk.rank] for rk in self._ranks]

    def send(self, msg: object) -> None:
        """`msg` (a StepPlan) to every rank, in the order of the calls. A broken channel is a lost
        rank: the watchdog ends the worker; this raises meanwhile."""
        for rk in self._ranks:
            with rk.lock:
                try:
                    rk.conn.send(msg)
                except (BrokenPipeError, ConnectionResetError, OSError) as e:
                    raise RankLost(f"tensor-parallel rank {rk.rank} is gone ({e})") from None

    @property
    def pids(self) -> list[int]:
        return [rk.proc.pid for rk in self._ranks]

    def kv_channels(self) -> list[tuple[int, Connection]]:
        """(rank, its KV agent's channel) of ranks 1..size-1 (engine/parallel/kv.py)."""
        return [(rk.rank, rk.kv_conn) for rk in self._ranks]

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask every rank to leave and exit; kill what is left after `timeout_s`."""
        self.ask_stop()
        self.wait_stopped(timeout_s)

    def ask_stop(self) -> None:
        """Tell every rank to leave the group and exit (no wait: rank 0 leaves the group meanwhile,
        since NCCL's teardown may wait for every rank of the communicator)."""
        self._stopping.set()
        for rk in self._ranks:
            try:
                with rk.lock:
                    rk.conn.send(RankStop())
            except OSError:
                pass

    def wait_stopped(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Wait for the ranks asked to stop; kill what is left after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for rk in self._ranks:
            try:
                rk.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank %d did not stop in time; killing it", rk.rank)
        self.kill()

    def kill(self) -> None:
        self._stopping.set()
        for rk in self._ranks:
            if rk.proc.poll() is None:
                rk.proc.kill()
                rk.proc.wait()
            rk.conn.close()
            rk.kv_conn.close()

    def confirm_lost(self, timeout_s: float) -> bool:
        """Whether a rank exits within `timeout_s` (a step failed: is a lost rank the cause?); if
        one does, `on_lost` is called now, as the watchdog would (by default this process ends)."""
        deadline = time.monotonic() + timeout_s
        if self._lost_seen.is_set():            # the watchdog is ending the worker already
            time.sleep(timeout_s)
            return True
        while True:
            for rk in self._ranks:
                code = rk.proc.poll()
                if code is not None:
                    self._lost(rk.rank, _describe(code))
                    return True
            if time.monotonic() >= deadline or self._stopping.is_set():
                return False
            time.sleep(0.02)

    # ---- the watchdog -------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL_S):
            for rk in self._ranks:
                why = self._check(rk)
                if why is not None:
                    self._lost(rk.rank, why)
                    return

    def _lost(self, rank: int, why: str) -> None:
        """`on_lost` once, whichever of the watchdog and a failed step sees the loss first."""
        with self._lost_lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            self._lost_seen.set()
        self._on_lost(rank, why)

    def _check(self, rk: _Rank) -> str | None:
        """Why rank `rk` is lost (None: it is fine); collects its RankReady while starting."""
        if rk.rank not in self._ready:
            try:
                msg = rk.conn.recv() if rk.conn.poll() else None
            except (EOFError, OSError):
                msg = RankFailed(rk.rank, "its channel to rank 0 closed")
            if isinstance(msg, RankReady):
                self._ready[rk.rank] = msg
                if len(self._ready) == len(self._ranks):
                    self._all_ready.set()
            elif isinstance(msg, RankFailed):
                return f"failed to start: {msg.error}"
        code = rk.proc.poll()
        return None if code is None else _describe(code)

    def _exit(self, rank: int, why: str) -> None:
        """A rank is lost: its collectives never complete, so this worker ends now (the other
        ranks die with it); the controller restarts it, the frontends migrate its requests."""
        log.error("tensor-parallel rank %d of %s %s: stopping the worker (exit code %d); its requests "
                  "continue on other workers", rank, self.worker, why, EXIT_RANK_LOST)
        for h in logging.getLogger().handlers:
            h.flush()
        for rk in self._ranks:
            if rk.proc.poll() is None:
                rk.proc.kill()
        os._exit(EXIT_RANK_LOST)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"

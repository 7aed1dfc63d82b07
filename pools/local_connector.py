"""The local-process connector: workers as child processes of `splitserve serve`.

`start(pool)` launches `splitserve prefill-worker|decode-worker --config FILE` through the `spawn`
function it is given (serve writes the worker's config and starts it in its own process group, so
a terminal's Ctrl-C reaches serve alone, and it dies with serve: PR_SET_PDEATHSIG). Worker names are
ROLE-N (`decode-0`, `prefill-1`, `aggregated-2`), never reused; the worker's id in discovery is the
name plus a unique suffix.

With a `Placement` (pools/gpus.py: the host's GPUs, `serve` on cuda) each worker gets its own GPUs
when it starts, in its environment (CUDA_VISIBLE_DEVICES, runtime/gpus.py `worker_env`), and gives
them back when it leaves: drained, stopped, or failed for good; a crashed worker waiting for its
restart keeps them. A start with no GPUs free fails with a `ConnectorError` that says what is free,
and the controller retries it on its next tick.

`drain(name)` sends SIGTERM (the worker drains, then exits 0) and `stop(name)` SIGKILL. An exit
that was not asked for is a crash: the worker is restarted under the same name after a backoff
(pools/restarts.py), and after too many crashes in a row it is left failed and reported (ERROR
line, `splitserve_worker_crash_loops_total`, `pools status`). With `restart_crashed` off (serve's
start-up, where a crash means a bad model or flag) a crash fails the worker at once.
"""

from __future__ import annotations

import itertools
import logging
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

from pools.connector import ConnectorError, HandleState, WorkerHandle
from pools.book import PoolName
from pools.gpus import GpuLease, NoGpus, Placement
from pools.restarts import CrashHistory, RestartPolicy, record_crash

log = logging.getLogger(__name__)

# (pool, worker name, its GPUs or None) -> the started process
Spawn = Callable[[PoolName, str, "GpuLease | None"], subprocess.Popen]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass(slots=True)
class _Slot:
    name: str
    pool: PoolName
    proc: subprocess.Popen | None
    history: CrashHistory
    state: HandleState = HandleState.RUNNING
    launched_at: float = 0.0         # monotonic
    started_at: float = 0.0          # unix
    restart_at: float = 0.0          # monotonic, in BACKOFF
    detail: str = ""
    gpus: GpuLease | None = None     # held from start until the worker is gone for good

    def handle(self) -> WorkerHandle:
        return WorkerHandle(self.name, self.pool, self.state, self.started_at, self.history.restarts, self.detail,
                            self.gpus.visible_devices if self.gpus else "")


class LocalProcessConnector:
    def __init__(self, spawn: Spawn, roles: dict[PoolName, str], policy: RestartPolicy = RestartPolicy(),
                 on_restart: Callable[[PoolName], None] | None = None,
                 on_crash_loop: Callable[[PoolName], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, placement: Placement | None = None) -> None:
        self._spawn, self._roles, self._policy = spawn, roles, policy
        self.placement = placement
        self._on_restart, self._on_crash_loop = on_restart, on_crash_loop
        self._clock = clock
        self._slots: dict[str, _Slot] = {}
        self._numbers = {pool: itertools.count() for pool in roles}
        self.restart_crashed = True

    # ---- the Connector protocol ------------------------------------------------------------
    async def start(self, pool: PoolName) -> WorkerHandle:
        gpus = None
        if self.placement is not None:
            try:
                gpus = self.placement.take(pool)
            except NoGpus as e:
                raise ConnectorError(f"cannot start another {pool} worker: {e}") from None
        name = f"{self._roles[pool]}-{next(self._numbers[pool])}"
        slot = _Slot(name, pool, None, CrashHistory(self._policy), gpus=gpus)
        self._slots[name] = slot
        try:
            self._launch(slot)
        except Exception as e:               # nothing runs under this name: forget it (and its GPUs)
            self._forget(slot)
            raise e if isinstance(e, ConnectorError) else ConnectorError(f"starting {name} failed: {e}") from e
        except BaseException:
            self._forget(slot)
            raise
        return slot.handle()

    async def drain(self, name: str) -> None:
        slot = self._slot(name)
        if slot.state in (HandleState.BACKOFF, HandleState.FAILED):
            self._forget(slot)              # not running: nothing to drain
            return
        slot.state = HandleState.DRAINING
        _signal(slot.proc, signal.SIGTERM)

    async def stop(self, name: str) -> None:
        slot = self._slot(name)
        if slot.proc is not None and slot.proc.poll() is None:
            slot.state = HandleState.DRAINING       # an exit we asked for: not a crash
            _signal(slot.proc, signal.SIGKILL)
        else:
            self._forget(slot)

    def list(self) -> list[WorkerHandle]:
        return [s.handle() for s in self._slots.values()]

    async def refresh(self) -> None:
        now = self._clock()
        for slot in list(self._slots.values()):
            if slot.state == HandleState.BACKOFF and now >= slot.restart_at:
                self._launch(slot)
                if self._on_restart:
                    self._on_restart(slot.pool)
                continue
            if slot.proc is None or slot.state in (HandleState.BACKOFF, HandleState.FAILED):
                continue
            code = slot.proc.poll()
            if code is None:
                continue
            if slot.state == HandleState.DRAINING:
                log.info("%s exited after its drain (%s)", slot.name, describe_exit(code))
                self._forget(slot)
            else:
                record_crash(slot, describe_exit(code), now, self.restart_crashed, log, self._on_crash_loop,
                             restarting="restarting it", hint="See its log above; ")
                if slot.state == HandleState.FAILED:
                    self._release_gpus(slot)        # left stopped: its GPUs are free for others

    # ---- beyond the protocol: what serve needs -------------------------------------------
    def pid(self, name: str) -> int | None:
        slot = self._slots.get(name)
        return slot.proc.pid if slot and slot.proc and slot.proc.poll() is None else None

    def failed(self) -> list[WorkerHandle]:
        return [s.handle() for s in self._slots.values() if s.state == HandleState.FAILED]

    def kill_all(self) -> None:
        for slot in self._slots.values():
            if slot.proc is not None and slot.proc.poll() is None:
                slot.state = HandleState.DRAINING
                _signal(slot.proc, signal.SIGKILL)

    def running(self) -> int:
        return sum(1 for s in self._slots.values() if s.proc is not None and s.proc.poll() is None)

    # ---- internals --------------------------------------------------------------------------
    def _slot(self, name: str) -> _Slot:
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(f"no worker named {name!r}") from None

    def _forget(self, slot: _Slot) -> None:
        self._slots.pop(slot.name, None)
        self._release_gpus(slot)

    def _release_gpus(self, slot: _Slot) -> None:
        if slot.gpus is not None and self.placement is not None:
            self.placement.give_back(slot.gpus)
            slot.gpus = None

    def _launch(self, slot: _Slot) -> None:
        slot.proc = self._spawn(slot.pool, slot.name, slot.gpus)
        slot.state = HandleState.RUNNING
        slot.launched_at, slot.started_at = self._clock(), time.time()


def _signal(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is not None and proc.poll() is None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass

"""The Ray connector: workers (and `serve --ray`'s frontend and SLA planner) as Ray actors.

Each component runs in one `ComponentActor`: Ray places the actor on a node with the resources it
asks for (`num_gpus` per worker from --ray-worker-gpus, CPU-only actors otherwise), and the actor
runs the component's ordinary process there (`splitserve decode-worker --config /dev/stdin`, its
config through a pipe: nothing is left on the node), which inherits the GPUs Ray assigned
(CUDA_VISIBLE_DEVICES) and dies with the actor (PR_SET_PDEATHSIG).
The process binds and advertises the node's address, so the frontend and the workers talk gRPC and
NIXL to each other directly: Ray starts, watches and stops processes, it carries no request data.

`RayConnector` implements the connector interface (pools/connector.py) like the local-process
connector does for child processes: handle names are ROLE-N, never reused; `drain(name)` calls the
actor's `drain` (SIGTERM to the worker: its own drain), the worker exits when done and the actor is
then killed and forgotten; `stop(name)` kills the actor. A worker that exits unasked, or an actor
that dies (its process killed, its node lost), is a crash: the connector replaces it under the same
handle name with a new actor after a backoff, and a crash loop leaves it failed
(pools/restarts.py). Ray's own actor restarts are off (max_restarts=0) so that there is one
restart policy, this one. An actor that Ray cannot place yet (no node with a free GPU) stays
`running` with `detail` saying so; discovery shows it is not ready.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray

from pools.connector import ConnectorError, HandleState, WorkerHandle
from pools.local_connector import describe_exit
from pools.book import PoolName
from pools.restarts import CrashHistory, RestartPolicy, record_crash
from runtime.config import FrontendConfig, PlannerComponentConfig, WorkerConfig
from runtime.config_file import config_json
from runtime.process import with_parent_death

log = logging.getLogger(__name__)

RAY_NAMESPACE = "splitserve"
POLL_TIMEOUT_S = 2.0            # an actor that does not answer within this is still being placed
Component = WorkerConfig | FrontendConfig | PlannerComponentConfig      # the configs a ComponentActor runs


class ComponentActor:
    """One Splitserve process on the node Ray placed this actor on (used as a Ray actor class).

    The process reads its config from a pipe (`--config /dev/stdin`), never from a file: a killed
    actor (ray.kill is a SIGKILL) leaves nothing behind on the node. Its command line names the
    component it runs (`--worker-id NAME` for a worker, which the file's value equals)."""

    def __init__(self, command: str, cfg: Component, env: dict[str, str]) -> None:
        node = ray.util.get_node_ip_address()
        if isinstance(cfg, WorkerConfig):       # reachable from the other nodes at the node's address
            cfg = dataclasses.replace(cfg, host=node, advertise_host=node)
        name = ["--worker-id", cfg.worker_id] if getattr(cfg, "worker_id", None) else []    # ps shows whose
        child_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "splitserve", command, "--config", "/dev/stdin", *name]
        self.proc = subprocess.Popen(with_parent_death(argv), env=child_env, process_group=0, stdin=subprocess.PIPE)
        self.proc.stdin.write(config_json(cfg).encode())
        self.proc.stdin.close()
        self.node = node

    def info(self) -> dict[str, Any]:
        return {"node": self.node, "pid": self.proc.pid, "actor_pid": os.getpid(),
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    def poll(self) -> int | None:
        """The process's exit code, or None while it runs."""
        return self.proc.poll()

    def drain(self) -> None:
        """The component's own drain: SIGTERM (it finishes its requests, then exits)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


RemoteComponent = ray.remote(max_restarts=0, max_task_retries=0)(ComponentActor)


def start_component(name: str, command: str, cfg: Component, env: dict[str, str], num_cpus: float,
                    num_gpus: float = 0.0, resources: dict[str, float] | None = None):
    """A new ComponentActor running `splitserve COMMAND` with `cfg`; returns its actor handle at once."""
    return RemoteComponent.options(name=name, namespace=RAY_NAMESPACE, num_cpus=num_cpus, num_gpus=num_gpus,
                                   resources=resources or {}).remote(command, cfg, env)


async def call(ref, timeout_s: float = POLL_TIMEOUT_S):
    """Await a Ray object ref with a timeout (asyncio.TimeoutError while the actor is not placed yet)."""
    return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)


def kill_actor(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as e:          # already gone: nothing to kill
        log.debug("ray.kill: %s", e)


@dataclass(slots=True)
class _Slot:
    name: str
    pool: PoolName
    history: CrashHistory
    actor: Any = None
    incarnation: int = 0
    state: HandleState = HandleState.RUNNING
    launched_at: float = 0.0         # monotonic
    started_at: float = 0.0          # unix
    restart_at: float = 0.0          # monotonic, in BACKOFF
    placed: bool = False
    detail: str = ""

    def handle(self) -> WorkerHandle:
        return WorkerHandle(self.name, self.pool, self.state, self.started_at, self.history.restarts, self.detail)


# (pool, handle name, actor name) -> the new actor
Launch = Callable[[PoolName, str, str], Any]


class RayConnector:
    def __init__(self, launch: Launch, roles: dict[PoolName, str], policy: RestartPolicy = RestartPolicy(),
                 on_restart: Callable[[PoolName], None] | None = None,
                 on_crash_loop: Callable[[PoolName], None] | None = None, prefix: str = "splitserve",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._launch_fn, self._roles, self._policy = launch, roles, policy
        self._on_restart, self._on_crash_loop = on_restart, on_crash_loop
        self._prefix, self._clock = prefix, clock
        self._slots: dict[str, _Slot] = {}
        self._numbers = {pool: itertools.count() for pool in roles}
        self.restart_crashed = True

    # ---- the Connector protocol ------------------------------------------------------------
    async def start(self, pool: PoolName) -> WorkerHandle:
        name = f"{self._roles[pool]}-{next(self._numbers[pool])}"
        slot = _Slot(name, pool, CrashHistory(self._policy))
        self._slots[name] = slot
        try:
            self._launch(slot)
        except ConnectorError:               # nothing runs under this name: forget it
            del self._slots[name]
            raise
        return slot.handle()

    async def drain(self, name: str) -> None:
        slot = self._slot(name)
        if slot.state in (HandleState.BACKOFF, HandleState.FAILED):
            self._slots.pop(name)
            return
        slot.state = HandleState.DRAINING
        try:
            await call(slot.actor.drain.remote())
        except asyncio.TimeoutError:              # not placed yet: nothing runs, nothing to drain
            kill_actor(slot.actor)
            self._slots.pop(name, None)
        except ray.exceptions.RayActorError:
            pass                                  # already dead: refresh forgets it

    async def stop(self, name: str) -> None:
        slot = self._slot(name)
        if slot.actor is not None:
            kill_actor(slot.actor)
        self._slots.pop(name)

    def list(self) -> list[WorkerHandle]:
        return [s.handle() for s in self._slots.values()]

    async def refresh(self) -> None:
        now = self._clock()
        slots = [s for s in self._slots.values() if s.state not in (HandleState.BACKOFF, HandleState.FAILED)]
        codes = await asyncio.gather(*(self._poll(s) for s in slots))
        for slot, (code, dead) in zip(slots, codes):
            if code is None and not dead:
                continue
            why = dead or describe_exit(code)
            if slot.state == HandleState.DRAINING:
                log.info("%s exited after its drain (%s)", slot.name, why)
                kill_actor(slot.actor)
                self._slots.pop(slot.name, None)
            else:
                kill_actor(slot.actor)
                record_crash(slot, why, now, self.restart_crashed, log, self._on_crash_loop,
                             restarting="replacing its actor")
        for slot in list(self._slots.values()):
            if slot.state == HandleState.BACKOFF and now >= slot.restart_at:
                self._launch(slot)
                if self._on_restart:
                    self._on_restart(slot.pool)

    # ---- beyond the protocol: what serve needs -------------------------------------------
    def failed(self) -> list[WorkerHandle]:
        return [s.handle() for s in self._slots.values() if s.state == HandleState.FAILED]

    def kill_all(self) -> None:
        for slot in self._slots.values():
            if slot.actor is not None:
                kill_actor(slot.actor)
        self._slots.clear()

    def running(self) -> int:
        return sum(1 for s in self._slots.values() if s.state in (HandleState.RUNNING, HandleState.DRAINING))

    def actor_name(self, name: str) -> str | None:
        slot = self._slots.get(name)
        return f"{self._prefix}-{slot.name}.{slot.incarnation}" if slot else None

    # ---- internals --------------------------------------------------------------------------
    def _slot(self, name: str) -> _Slot:
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(f"no worker named {name!r}") from None

    def _launch(self, slot: _Slot) -> None:
        slot.incarnation += 1       # Ray frees a dead actor's name late: each incarnation has its own
        try:
            slot.actor = self._launch_fn(slot.pool, slot.name, self.actor_name(slot.name))
        except ConnectorError:
            raise
        except Exception as e:
            raise ConnectorError(f"Ray refused to create the actor for {slot.name}: {e}") from e
        slot.state, slot.placed, slot.detail = HandleState.RUNNING, False, "waiting for Ray to place the actor"
        slot.launched_at, slot.started_at = self._clock(), time.time()

    async def _poll(self, slot: _Slot) -> tuple[int | None, str]:
        """(exit code or None, why the actor is dead or "")."""
        try:
            code = await call(slot.actor.poll.remote())
        except asyncio.TimeoutError:
            return None, ""                     # not placed yet (or busy): still running as far as we know
        except ray.exceptions.RayActorError as e:
            return None, f"actor died ({type(e).__name__})"
        if not slot.placed:
            slot.placed, slot.detail = True, ""
        return code, ""

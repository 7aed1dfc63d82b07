"""`splitserve serve --ray [ADDRESS]`: the same cluster as `serve`, its components placed as Ray actors.

This process (the Ray driver) connects to the Ray cluster at ADDRESS (or starts a local one with
`--ray` alone), runs the embedded Redis on its own node bound to that node's address (or uses
--redis-url), the pool controller and its admin API, and places the components below. A local Ray
cluster (`--ray` alone) is this machine's only: Ray, Redis, the workers and the frontend's links
bind loopback (splitserve/cli.py sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray loads).

- the frontend as one actor pinned to this node (clients connect where they would without Ray);
- each worker as one actor with --ray-worker-gpus GPUs and --ray-worker-cpus CPUs, anywhere Ray
  finds them, through the Ray connector (pools/ray_connector.py), which the controller drives
  like the local-process one: `pools scale` starts and drains actors, a dead actor is replaced;
- with --planner, the SLA planner as one actor pinned to this node (`splitserve planner`, driving
  the admin API on loopback with the admin token in its environment), replaced if it dies like the
  frontend.

Every actor runs the component's ordinary process (pools/ray_connector.py); the processes talk
gRPC (and NIXL for KV) to each other directly at their nodes' addresses. Ray carries no request data.
Stopping drains as `serve` does; then the actors are killed, and a local Ray cluster is shut down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
import time

import ray

from pools.local_connector import describe_exit
from pools.book import PoolName
from pools.ray_connector import RAY_NAMESPACE, RayConnector, kill_actor, start_component
from pools.restarts import CrashHistory, RestartPolicy
from runtime.config import PlannerComponentConfig, RayConfig, ServeConfig, SlaConfig
from runtime.process import bounded
from runtime.redis_embedded import free_port
from splitserve.placement import ray_worker_gpus
from splitserve.serve import CLOSE_TIMEOUT_S, STOP_MARGIN_S, Launcher, connect_host, frontend_config, serve, worker_config

log = logging.getLogger("splitserve.serve")

# what an actor's process gets from this one's environment (cache dir, UCX transports), never a secret;
# the rest, node-specific settings included, it inherits from `ray start` on its node
PASSED_ENV_PREFIXES = ("SPLITSERVE_", "UCX_")
SECRET_ENV = ("SPLITSERVE_API_KEY", "SPLITSERVE_ADMIN_TOKEN", "SPLITSERVE_KUBE_TOKEN")
PLANNER_STOP_S = 5.0          # the planner has nothing to drain: SIGTERM, then its actor is killed


def serve_ray(cfg: ServeConfig) -> int:
    return serve(cfg, RayLauncher, connect=_connect)


def _connect(cfg: ServeConfig) -> bool:
    problem = unreachable(cfg.ray.address)
    if problem:      # Ray itself retries a wrong address for minutes
        print(f"splitserve serve: cannot reach the Ray cluster at {cfg.ray.address}: {problem}", file=sys.stderr)
        return False
    try:
        connect_ray(cfg.ray)
        return True
    except (ConnectionError, RuntimeError, ValueError) as e:
        print(f"splitserve serve: cannot reach the Ray cluster at {cfg.ray.address}: {e}", file=sys.stderr)
        return False


def unreachable(address: str, timeout_s: float = 5.0) -> str:
    """Why HOST:PORT takes no TCP connection ("" if it does, or if `address` is not HOST:PORT)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in address:
        return ""                     # local, auto, ray://: Ray's own checks
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        return ""
    except OSError as e:
        return f"{e.strerror or e} (is `ray start --head --port {port}` running there?)"


def connect_ray(cfg: RayConfig) -> None:
    """Join the cluster at cfg.address, or start a local one (`local`)."""
    if cfg.address == "local":
        ray.init(address="local", num_cpus=cfg.local_cpus, include_dashboard=False, namespace=RAY_NAMESPACE)
    else:
        ray.init(address=cfg.address, namespace=RAY_NAMESPACE)


def planner_config(cfg: ServeConfig, admin_address: str, metrics_port: int) -> PlannerComponentConfig:
    """The planner actor's: serve's SLA settings (a profile path made absolute: the actor's working
    directory is Ray's), its Redis, the admin API at `admin_address` and /metrics on `metrics_port`
    beside the controller's; no token (it comes by environment)."""
    sla = {f.name: getattr(cfg.planner, f.name) for f in dataclasses.fields(SlaConfig)}
    if sla["profile"]:
        sla["profile"] = os.path.abspath(sla["profile"])
    return PlannerComponentConfig(**sla, redis=cfg.frontend.redis, admin_address=admin_address,
                                  metrics_host=cfg.frontend.host, metrics_port=metrics_port)


def worker_gpus(cfg: ServeConfig) -> dict[PoolName, float]:
    """GPUs per worker actor of each pool: --ray-worker-gpus, else as many as the worker spans (its
    pool's tensor-parallel size) where the engine will run on cuda."""
    has_gpus = lambda: ray.cluster_resources().get("GPU", 0) > 0     # noqa: E731
    return {pool: ray_worker_gpus(cfg, role, has_gpus)
            for pool, role in ((PoolName.PREFILL, "prefill"), (PoolName.DECODE, "decode"))}


class ActorProcess:
    """The frontend (or planner) actor, seen as the Popen `Launcher` supervises (poll, send_signal,
    returncode). `poll` never blocks: it runs in serve's event loop, beside the admin API and the
    controller, every 0.2 s, and an actor Ray is still placing may not answer for seconds; so one
    question is kept in flight and its answer read once there is one."""

    def __init__(self, actor) -> None:
        self.actor = actor
        self.returncode: int | None = None
        self._asked = None                     # the poll call in flight

    def poll(self) -> int | None:
        if self.returncode is None:
            if self._asked is None:
                self._asked = self.actor.poll.remote()
            done, _ = ray.wait([self._asked], timeout=0)
            if not done:
                return None                    # not placed yet, or busy
            asked, self._asked = self._asked, None
            try:
                self.returncode = ray.get(asked)
            except ray.exceptions.RayActorError:
                self.returncode = -signal.SIGKILL    # the actor died: its process with it
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if sig == signal.SIGTERM:
            self.actor.drain.remote()
        else:
            self.kill()

    def kill(self) -> None:
        kill_actor(self.actor)


class RayLauncher(Launcher):
    def __init__(self, cfg: ServeConfig, model_dir: str, book) -> None:
        super().__init__(cfg, model_dir, book)
        self.node = ray.util.get_node_ip_address()
        self.gpus = worker_gpus(cfg)
        self.frontends = 0
        self.planners = 0
        self.planner_started = 0.0
        self.planner_history = CrashHistory(self.frontend_history.policy)
        # actors on other nodes resolve a tiny model there; any other model must lie at the same path on each node
        self.actor_model = cfg.engine.model if cfg.engine.model.startswith("tiny") else model_dir
        self.actor_env = {k: v for k, v in os.environ.items()
                          if k.startswith(PASSED_ENV_PREFIXES) and k not in SECRET_ENV}

    def redis_host(self) -> str:
        return self.node

    def make_connector(self, policy: RestartPolicy) -> RayConnector:
        ns = self.cfg.frontend.redis.namespace
        return RayConnector(self._launch_worker, self.roles, policy,
                            on_restart=lambda pool: self.metrics.restarts.labels(pool).inc(),
                            on_crash_loop=lambda pool: self.metrics.crash_loops.labels(pool).inc(),
                            prefix=ns)

    def _launch_worker(self, pool: PoolName, name: str, actor_name: str):
        role = self.roles[pool]
        command = "prefill-worker" if role == "prefill" else "decode-worker"
        wcfg = worker_config(self.cfg, self.actor_model, role, name.rsplit("-", 1)[1], self.ports_of(name))
        return start_component(actor_name, command, wcfg, self.actor_env, self.cfg.ray.worker_cpus, self.gpus[pool])

    def _start_frontend(self, index: int = 0) -> None:
        fcfg = dataclasses.replace(frontend_config(self.cfg, self.model_dir), model=self.actor_model)
        env = dict(self.actor_env)
        if self.cfg.frontend.api_key:
            env["SPLITSERVE_API_KEY"] = self.cfg.frontend.api_key   # to the actor's environment, never argv
        name = f"{self.cfg.frontend.redis.namespace}-frontend.{self.frontends}"
        self.frontends += 1
        # pinned to this node: clients connect to --host:--http-port here, as without Ray
        actor = start_component(name, "frontend", fcfg, env, self.cfg.ray.frontend_cpus,
                                resources={f"node:{self.node}": 0.001})
        self.fronts[index].proc = ActorProcess(actor)
        self.fronts[index].started = time.monotonic()

    def _start_planner(self) -> None:
        """The SLA planner as an actor pinned to this node: the admin API may bind loopback only, and
        a --planner-profile path is this node's. It sets the pools' sizes through the admin API's
        SetPoolTargets, so its decisions show in `pools status` as the in-process planner's do."""
        sla = self.cfg.planner
        admin = f"{connect_host(self.cfg.controller.admin_host)}:{self.admin_address.rsplit(':', 1)[1]}"
        metrics_port = free_port()
        pcfg = planner_config(self.cfg, admin, metrics_port)
        env = {**self.actor_env, "SPLITSERVE_ADMIN_TOKEN": self.admin_token}   # never argv, never the config file
        name = f"{self.cfg.frontend.redis.namespace}-planner.{self.planners}"
        self.planners += 1
        actor = start_component(name, "planner", pcfg, env, 0, resources={f"node:{self.node}": 0.001})
        self.planner = ActorProcess(actor)
        self.planner_started = time.monotonic()
        self.controller.planner_metrics_url = f"http://{connect_host(pcfg.metrics_host)}:{metrics_port}/metrics"
        log.info("SLA planner: actor %s, %s (profile %s)", name, sla.targets(), self.planner_profile.name)

    async def _supervise(self) -> bool:
        """Also replace a planner actor that died; a crash-looping planner is left stopped (serving goes
        on, the pools keep their sizes)."""
        if not await super()._supervise():
            return False
        p = self.planner
        if p is not None and p.poll() is not None:
            self.planner = None
            self.controller.planner_metrics_url = None
            if not self._restart_later("planner", p.returncode, self.planner_started, self.planner_history,
                                       self._start_planner, "a new actor; the pools keep their sizes meanwhile"):
                log.error("the SLA planner keeps crashing (%s); not restarting it: the pools keep their sizes "
                          "(`splitserve pools scale` still works)", describe_exit(p.returncode))
        return True

    async def _stop_planner(self) -> None:
        p, self.planner = self.planner, None
        if p is None:
            return
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + PLANNER_STOP_S
            while p.poll() is None and time.monotonic() < deadline and not self.kill_now.is_set():
                await asyncio.sleep(0.1)
        p.kill()

    async def _shutdown(self) -> None:
        self.stop.set()                              # a planner restart still pending starts nothing now
        await self._stop_planner()                   # first: no more targets
        if self.controller is not None:
            self.controller.acting = False           # no restarts, no scaling from here on
        if self.connector is not None:
            self.connector.restart_crashed = False
        if self.controller is not None:
            await bounded("closing the pool controller", self.controller.close(), CLOSE_TIMEOUT_S)
        for f in self.fronts:
            if f.proc is not None and f.proc.poll() is None:
                f.proc.send_signal(signal.SIGTERM)
        c = self.connector
        if c is not None:
            for h in c.list():
                try:
                    await c.drain(h.name)
                except KeyError:
                    pass
            deadline = time.monotonic() + self.cfg.frontend.drain_timeout_s + STOP_MARGIN_S
            while c.running() and time.monotonic() < deadline and not self.kill_now.is_set():
                await c.refresh()
                await asyncio.sleep(0.2)
            if c.running() and not self.kill_now.is_set():
                log.warning("%d worker actor(s) did not stop in time; killing them", c.running())
            c.kill_all()
        deadline = time.monotonic() + 10
        for f in (f.proc for f in self.fronts if f.proc is not None):
            while f.poll() is None and time.monotonic() < deadline and not self.kill_now.is_set():
                await asyncio.sleep(0.1)
            f.kill()
        if self.admin is not None:
            await self.admin.stop(grace=0.5)
        if self.redis is not None:
            self.redis.close()
        if self.token_path is not None:
            self.token_path.unlink(missing_ok=True)
        ray.shutdown()

    def _banner(self) -> str:
        where = "a local Ray cluster" if self.cfg.ray.address == "local" else f"the Ray cluster at {self.cfg.ray.address}"
        actors = "frontend, workers and the SLA planner" if self.planner is not None else "frontend and workers"
        return (super()._banner().rstrip("\n") +
                f"\nOn {where}: {actors} are actors in Ray namespace {RAY_NAMESPACE!r} "
                f"({self.gpus[PoolName.PREFILL]:g} GPU(s) per prefill worker, {self.gpus[PoolName.DECODE]:g} "
                f"per decode worker).\n")

"""`splitserve serve`: a whole cluster on one machine, as separate processes, kept at its size.

Starts the embedded Redis (unless --redis-url), the frontend, and a pool controller
(pools/controller.py) that starts the workers through the local-process connector
(pools/local_connector.py) and keeps each pool at its desired size: it restarts crashed workers
with backoff, reports crash loops, and scales on `splitserve pools scale` through the admin API
(pools/admin.py, on --admin-port), which this process serves. With --planner the SLA planner
(planner/live.py) sets the pools' sizes from the measured load and --ttft-ms/--itl-ms once every
worker is ready (an override from `pools scale` still wins). Waits until the frontend reports
every worker healthy; prints where to connect. It also supervises its own children: a Redis or a
frontend that dies is started again on the same port (docs/operations.md).

Stopping (Ctrl-C / SIGTERM): the frontend stops taking requests and every worker drains, so open
streams finish (or, past --drain-timeout-s, end with an error event); then Redis stops. A second
signal kills everything at once. Children run in their own process group (a terminal's Ctrl-C
reaches this process alone, which orders the rest) and die with it even if it is killed
(PR_SET_PDEATHSIG).

Each child gets its whole config as a file (`splitserve decode-worker --config DIR/decode-0.json`),
derived from the ServeConfig: the workers' from its engine, the frontend's from its frontend, all
sharing its Redis and host. The files lie in a private directory (mode 0700) that is removed at
exit; the API key is not in them but in the frontend's environment, and the admin token reaches no
child at all. The cluster token that worker RPCs require (runtime/grpc_links.py: SPLITSERVE_CLUSTER_TOKEN,
generated per run unless set) reaches every child by environment.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pools.admin import start_admin_server
from pools.connector import ConnectorError
from pools.controller import PoolController
from pools.local_connector import LocalProcessConnector, describe_exit
from pools.book import PoolBook, PoolName
from pools.restarts import CrashHistory, RestartPolicy
from runtime.admin_auth import new_token, write_token_file
from runtime.config import FrontendConfig, ServeConfig, WorkerConfig
from runtime.config_file import write_config
from runtime.errors import InvalidRequest
from runtime.grpc_links import ensure_cluster_token
from runtime.metrics import PoolMetrics, start_metrics_server
from runtime.model_config import ModelConfig
from runtime.process import bounded, run_component, with_parent_death
from runtime.quantization import quantization_name, resolve_quantization
from runtime.redis_embedded import EmbeddedRedis
from splitserve.models import resolve_model
from splitserve.serve_plan import (FrontendSlot, WorkerPorts, connect_host, frontend_config, machine_problem,  # noqa: F401
                                   pool_book, serving_mode, worker_config)
from splitserve.placement import check_pools_tp, plan_placement, pool_tp
from runtime.gpus import worker_env

log = logging.getLogger("splitserve.serve")

STOP_MARGIN_S = 15.0          # beyond the drain timeout, before stragglers are killed
CLOSE_TIMEOUT_S = 5.0         # for each of serve's own clean-up steps; the workers' drain goes on regardless
# never passed on as they are: the admin token reaches no child, the API key only the frontend
SECRETS_ENV = ("SPLITSERVE_ADMIN_TOKEN", "SPLITSERVE_API_KEY")


class Cluster:
    """The child processes and their config files."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._config_dir: str | None = None

    @property
    def config_dir(self) -> str:
        """Where the children's config files lie: private (mode 0700), removed by `stop`."""
        if self._config_dir is None:
            self._config_dir = tempfile.mkdtemp(prefix="splitserve-serve-")
        return self._config_dir

    def spawn(self, name: str, argv: list[str], env: dict[str, str], stdout=None,
              own_group: bool = False) -> subprocess.Popen:
        """Start `splitserve ARGV...` as a child that dies with this process."""
        proc = subprocess.Popen(with_parent_death([sys.executable, "-m", "splitserve", *argv]), env=env,
                                stdout=stdout, process_group=0 if own_group else None)
        self.procs = [(n, p) for n, p in self.procs if p.poll() is None or n != name] + [(name, proc)]
        return proc

    def spawn_component(self, command: str, name: str, cfg: WorkerConfig | FrontendConfig,
                        env: dict[str, str]) -> subprocess.Popen:
        """Start `splitserve COMMAND --config DIR/NAME.json` with `cfg` in that file, in its own group."""
        path = os.path.join(self.config_dir, f"{name}.json")
        write_config(cfg, path)
        return self.spawn(name, [command, "--config", path], env, own_group=True)

    def dead(self) -> list[tuple[str, int]]:
        return [(n, p.returncode) for n, p in self.procs if p.poll() is not None]

    def alive(self) -> list[tuple[str, subprocess.Popen]]:
        return [(n, p) for n, p in self.procs if p.poll() is None]

    def stop(self, timeout_s: float = 10.0) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", name)
                p.kill()
                p.wait()
        self.remove_config_dir()

    def remove_config_dir(self) -> None:
        if self._config_dir is not None:
            shutil.rmtree(self._config_dir, ignore_errors=True)


def serve(cfg: ServeConfig, launcher: type[Launcher] | None = None, connect=None) -> int:
    """Run the cluster `cfg` describes until stopped. `serve --ray` passes its launcher and how it
    connects to Ray (splitserve/ray_serve.py); `connect(cfg)` False: exit 2."""
    launcher = launcher or Launcher
    problem = machine_problem(cfg)
    if problem:
        print(f"splitserve serve: {problem}", file=sys.stderr)
        return 2
    try:
        model_dir = resolve_model(cfg.engine.model)
        model_cfg = ModelConfig.from_dir(model_dir)           # an unsupported quantization is refused here
        weights = quantization_name(resolve_quantization(model_cfg.quantization, cfg.engine.quantization))
        check_pools_tp(cfg, model_cfg)
    except InvalidRequest as e:
        print(f"splitserve serve: {e.message}", file=sys.stderr)
        return 2
    cfg, aggregated_why = serving_mode(cfg)
    if aggregated_why:
        print(f"splitserve serve: {aggregated_why}: serving aggregated, {cfg.decode_workers} worker(s) that "
              "prefill their own prompts", file=sys.stderr)
    try:
        placement = None if connect is not None else plan_placement(cfg)    # Ray places its actors itself
    except InvalidRequest as e:
        print(f"splitserve serve: {e.message}", file=sys.stderr)
        return 2
    if placement is not None and cfg.planner.enabled and cfg.planner.gpu_budget is None:
        cfg = dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner,
                                                                   gpu_budget=placement.allocator.num_gpus))
    profile = None
    if cfg.planner.enabled:
        try:
            from planner.live import check_sla
            profile = check_sla(cfg.planner, weights, (pool_tp(cfg, "prefill"), pool_tp(cfg, "decode")),
                                cfg.controller)
        except (InvalidRequest, ValueError, OSError) as e:
            print(f"splitserve serve: --planner: {getattr(e, 'message', e)}", file=sys.stderr)
            return 2
    if cfg.frontends < 1:
        print("splitserve serve: --frontends must be at least 1", file=sys.stderr)
        return 2
    try:
        book = pool_book(cfg, aggregated_why)
        ports = WorkerPorts.parse(cfg.worker_ports, cfg.decode_workers + cfg.prefill_workers)
    except InvalidRequest as e:
        print(f"splitserve serve: {e.message}", file=sys.stderr)
        return 2
    if connect is not None and not connect(cfg):
        return 2
    ensure_cluster_token()       # this process's (its controller asks the workers) and every child's
    runner = launcher(cfg, model_dir, book)
    runner.aggregated_why, runner.worker_ports = aggregated_why, ports
    runner.planner_profile, runner.placement = profile, placement
    return run_component(runner.run())


class Launcher:
    """One `serve` run: children, controller, admin API; `run()` returns the exit code."""

    def __init__(self, cfg: ServeConfig, model_dir: str, book: PoolBook) -> None:
        self.cfg, self.model_dir, self.book = cfg, model_dir, book
        self.cluster = Cluster()
        self.role = "decode" if cfg.prefill_workers else "aggregated"
        self.roles = {PoolName.DECODE: self.role, PoolName.PREFILL: "prefill"}
        self.metrics = PoolMetrics()
        self.stop = asyncio.Event()
        self.kill_now = asyncio.Event()
        self.redis: EmbeddedRedis | None = None
        policy = RestartPolicy(backoff_s=cfg.controller.restart_backoff_s,
                               crash_loop_restarts=cfg.controller.crash_loop_restarts)
        # --frontends N: N processes on the same ports, each restarted on its own when it dies
        self.fronts = [FrontendSlot(i, history=CrashHistory(policy)) for i in range(cfg.frontends)]
        self.frontend_history = self.fronts[0].history
        self.connector: LocalProcessConnector | None = None
        self.controller: PoolController | None = None
        self.planner = None                           # with --planner: a planner.live.PlannerLoop (an actor on Ray)
        self.planner_profile = None
        self.aggregated_why = ""                      # serving_mode's: why no prefill pool although asked
        self.worker_ports = WorkerPorts()             # --worker-ports (serve() parses it)
        self.placement = None                         # pools.gpus.Placement: each worker's GPUs (None: none placed)
        self.admin = None
        self.admin_token = ""                         # in memory only; a planner actor gets it by environment
        self.token_path: Path | None = None
        self.admin_address = ""
        self.env: dict[str, str] = {}                 # every child's environment: no secret in it
        self.frontend_env: dict[str, str] = {}        # the frontend's: that and the API key

    # ---- the run ----------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            return await self._run()
        finally:
            await self._shutdown()

    def _on_signal(self, sig: int) -> None:
        if self.stop.is_set():
            log.warning("second %s: stopping everything now", signal.Signals(sig).name)
            self.kill_now.set()
        else:
            log.info("stopping (signal %s): draining the workers", signal.Signals(sig).name)
            self.stop.set()

    async def _run(self) -> int:
        cfg = self.cfg
        if not cfg.frontend.redis.url:
            try:
                self.redis = EmbeddedRedis(port=cfg.redis_port or None, own_group=True, host=self.redis_host())
            except RuntimeError as e:
                print(f"splitserve serve: the embedded Redis did not start on {self.redis_host()}:"
                      f"{cfg.redis_port or 'a free port'} ({str(e).strip().splitlines()[-1] if str(e).strip() else e}); "
                      "choose another --redis-port (0 picks a free one)", file=sys.stderr)
                return 2
            cfg = self.cfg = dataclasses.replace(cfg, frontend=dataclasses.replace(
                cfg.frontend, redis=dataclasses.replace(cfg.frontend.redis, url=self.redis.url)))
        self.env = {k: v for k, v in os.environ.items() if k not in SECRETS_ENV}
        self.env["PYTHONUNBUFFERED"] = "1"
        self.frontend_env = dict(self.env)
        if cfg.frontend.api_key:       # the frontend's alone: by environment, never argv or a file
            self.frontend_env["SPLITSERVE_API_KEY"] = cfg.frontend.api_key
        if not await self._start_controller():
            return 2
        for slot in self.fronts:
            self._start_frontend(slot.index)
        self.controller.start()
        if not await self._wait_ready():
            return 0 if self.stop.is_set() else 1     # stopped on request while starting: not a failure
        self.connector.restart_crashed = True
        if cfg.planner.enabled:
            self._start_planner()
        print(self._banner(), flush=True)
        while not self.stop.is_set():
            if not await self._supervise():
                return 1
            await _wait(self.stop, 0.2)
        return 0

    async def _start_controller(self) -> bool:
        cfg, c = self.cfg, self.cfg.controller
        token = self.admin_token = c.admin_token or new_token()
        mhost = "127.0.0.1" if cfg.frontend.host in ("0.0.0.0", "::", "") else cfg.frontend.host
        mport = start_metrics_server(cfg.frontend.host, 0, self.metrics.registry)
        policy = RestartPolicy(backoff_s=c.restart_backoff_s, crash_loop_restarts=c.crash_loop_restarts)
        self.connector = self.make_connector(policy)
        self.connector.restart_crashed = False        # during start-up a crash fails serve
        self.controller = PoolController(self.book, self.connector, self.roles, cfg.frontend.redis.url,
                                         cfg.frontend.redis.namespace, self.metrics,
                                         metrics_url=f"http://{mhost}:{mport}/metrics",
                                         lease_ttl_s=cfg.frontend.redis.lease_ttl_s)
        try:
            self.admin, port = await start_admin_server(self.controller, c.admin_host, c.admin_port, token)
        except OSError as e:
            print(f"splitserve serve: the admin API {e} (choose another with --admin-port, 0 picks a free one)",
                  file=sys.stderr)
            return False
        self.admin_address = f"{c.admin_host}:{port}"
        self.controller.admin_address = self.admin_address
        if not c.admin_token:
            self.token_path = write_token_file(port, token)
        return True

    # ---- what `serve --ray` replaces (splitserve/ray_serve.py) -------------------------------
    def redis_host(self) -> str:
        return "127.0.0.1"

    def make_connector(self, policy: RestartPolicy):
        return LocalProcessConnector(
            self._spawn_worker, self.roles, policy,
            on_restart=lambda pool: self.metrics.restarts.labels(pool).inc(),
            on_crash_loop=lambda pool: self.metrics.crash_loops.labels(pool).inc(), placement=self.placement)

    def _spawn_worker(self, pool: PoolName, name: str, gpus=None) -> subprocess.Popen:
        """Worker `name` of `pool`, on its GPUs (a pools.gpus.GpuLease) where the connector placed it."""
        role = self.roles[pool]
        command = "prefill-worker" if role == "prefill" else "decode-worker"
        index = name.rsplit("-", 1)[1]
        env = self.env if gpus is None else {**self.env, **worker_env(gpus.gpus)}
        wcfg = worker_config(self.cfg, self.model_dir, role, index, self.ports_of(name),
                             gpus.share if gpus is not None else 1.0)
        return self.cluster.spawn_component(command, name, wcfg, env)

    def ports_of(self, name: str) -> tuple[int, int]:
        """Worker `name`'s gRPC and metrics ports (--worker-ports; 0: free ones). ConnectorError
        when the range has no free pair."""
        try:
            return self.worker_ports.assign(name, {h.name for h in self.connector.list()})
        except ValueError as e:
            raise ConnectorError(str(e)) from None

    @property
    def frontend(self):
        """The first frontend process (the only one without --frontends)."""
        return self.fronts[0].proc

    def _start_frontend(self, index: int = 0) -> None:
        name = "frontend" if len(self.fronts) == 1 else f"frontend-{index}"
        slot = self.fronts[index]
        slot.proc = self.cluster.spawn_component("frontend", name, frontend_config(self.cfg, self.model_dir),
                                                 self.frontend_env)
        slot.started = time.monotonic()

    async def _wait_ready(self) -> bool:
        """Until the frontend's /health counts every worker (False: a child died, time ran out or a stop)."""
        url = f"http://{connect_host(self.cfg.frontend.host)}:{self.cfg.frontend.http_port}/health"
        want = {p: s.desired for p, s in self.book.pools.items()}
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        async with httpx.AsyncClient(timeout=1.0) as client:
            while time.monotonic() < deadline and not self.stop.is_set():
                failed = self.connector.failed()
                if failed:
                    log.error("%s exited during start-up (%s)", failed[0].name, failed[0].detail)
                    return False
                dead = next((f.proc for f in self.fronts if f.proc.poll() is not None), None)
                if dead is not None:
                    log.error("a frontend exited during start-up (%s)", describe_exit(dead.returncode))
                    return False
                try:
                    r = await client.get(url)
                    body = r.json()
                    if r.status_code == 200 and body.get("decode", 0) >= want[PoolName.DECODE] and \
                            body.get("prefill", 0) >= want[PoolName.PREFILL]:
                        return True
                except (httpx.HTTPError, ValueError):
                    pass
                await _wait(self.stop, 0.25)
        if not self.stop.is_set():
            log.error("the cluster was not healthy within %.0f s", self.cfg.startup_timeout_s)
        return False

    async def _supervise(self) -> bool:
        """Restart a Redis or frontend that died; False when the frontend crash-loops."""
        if self.redis is not None and not self.redis.alive:
            log.warning("the embedded Redis exited (%s); starting a new one on port %d", describe_exit(
                self.redis.returncode), self.redis.port)
            try:
                await asyncio.to_thread(self.redis.restart)
                self.metrics.component_restarts.labels("redis").inc()
                log.info("Redis is back on port %d; the workers re-register within a third of their lease",
                         self.redis.port)
            except RuntimeError as e:
                log.warning("restarting Redis failed (%s); trying again", e)
        for slot in self.fronts:
            f = slot.proc
            if f is not None and f.poll() is not None:
                slot.proc = None
                if not self._restart_later("frontend", f.returncode, slot.started, slot.history,
                                           lambda i=slot.index: self._start_frontend(i), "the workers keep running"):
                    log.error("the frontend keeps crashing (%s); stopping", describe_exit(f.returncode))
                    return False
        return True

    def _restart_later(self, component: str, returncode: int, started: float, history: CrashHistory,
                       start, meanwhile: str) -> bool:
        """A component (the frontend; on Ray the planner) exited: start it again after its backoff,
        unless serve is stopping by then. False (nothing scheduled) when it crash-loops."""
        uptime = time.monotonic() - started
        delay = history.crashed(uptime)
        if delay is None:
            return False
        log.warning("the %s %s after %.0f s; restarting it in %.1f s (%s)", component, describe_exit(returncode),
                    uptime, delay, meanwhile)

        def restart() -> None:
            if not self.stop.is_set():
                start()
                self.metrics.component_restarts.labels(component).inc()
        asyncio.get_running_loop().call_later(delay, restart)
        return True

    # ---- stopping ---------------------------------------------------------------------------
    def _start_planner(self) -> None:
        from planner.live import ControllerTarget, PlannerLoop
        from runtime.metrics import PlannerMetrics
        cfg = self.cfg
        self.planner = PlannerLoop(cfg.planner, ControllerTarget(self.controller), cfg.frontend.redis.url,
                                   cfg.frontend.redis.namespace, PlannerMetrics(self.metrics.registry),
                                   self.planner_profile)
        self.planner.start()
        log.info("SLA planner: %s (profile %s)", cfg.planner.targets(), self.planner_profile.name)

    async def _shutdown(self) -> None:
        if self.controller is not None:
            self.controller.acting = False           # no restarts, no scaling from here on
        if self.connector is not None:
            self.connector.restart_crashed = False
        if self.planner is not None:
            await bounded("closing the planner", self.planner.close(), CLOSE_TIMEOUT_S)
        if self.controller is not None:
            await bounded("closing the pool controller", self.controller.close(), CLOSE_TIMEOUT_S)
        for f in self.fronts:
            if f.proc is not None and f.proc.poll() is None:
                f.proc.send_signal(signal.SIGTERM)
        if self.connector is not None:
            for h in self.connector.list():
                try:
                    await self.connector.drain(h.name)
                except KeyError:
                    pass
        deadline = time.monotonic() + self.cfg.frontend.drain_timeout_s + STOP_MARGIN_S
        while self.cluster.alive() and time.monotonic() < deadline and not self.kill_now.is_set():
            await asyncio.sleep(0.1)
        for name, p in self.cluster.alive():
            if not self.kill_now.is_set():
                log.warning("%s did not stop in time; killing it", name)
            p.kill()
        for _, p in self.cluster.procs:
            p.wait()
        if self.admin is not None:
            await bounded("stopping the admin API", self.admin.stop(grace=0.5), CLOSE_TIMEOUT_S)
        if self.redis is not None:
            self.redis.close()
        if self.token_path is not None:
            self.token_path.unlink(missing_ok=True)
        self.cluster.remove_config_dir()

    def _banner(self) -> str:
        cfg = self.cfg
        model_name = frontend_config(cfg, self.model_dir).model_name
        url = f"http://{cfg.frontend.host}:{cfg.frontend.http_port}"
        pools = (f"{cfg.prefill_workers} prefill + {cfg.decode_workers} decode worker(s)" if cfg.prefill_workers
                 else f"{cfg.decode_workers} aggregated worker(s)")
        if self.aggregated_why:
            pools += f" ({self.aggregated_why})"
        token = (f"token in {self.token_path}" if self.token_path
                 else "token: --admin-token / SPLITSERVE_ADMIN_TOKEN")
        # the key itself is never printed: a placeholder the shell fills from the environment
        auth = " -H \"Authorization: Bearer $SPLITSERVE_API_KEY\"" if cfg.frontend.api_key else ""
        return (f"\nSplitserve is ready: model {model_name!r}, {pools}\n"
                f"  OpenAI HTTP  {url}/v1   (health {url}/health, metrics {url}/metrics)\n"
                f"  gRPC         {cfg.frontend.host}:{cfg.frontend.grpc_port}   (splitserve.v1.Generation)\n"
                f"  Admin        {self.admin_address}   (splitserve pools status --admin-url "
                f"{self.admin_address}; {token})\n"
                f"  try: curl {url}/v1/completions{auth} -H 'Content-Type: application/json' "
                f"-d '{{\"model\": \"{model_name}\", \"prompt\": \"def hello\", \"max_tokens\": 16}}'\n"
                f"Ctrl-C drains and stops everything.\n")


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except asyncio.TimeoutError:
        pass


def wait_ready(cluster: Cluster, health_url: str, num_decode: int, num_prefill: int, timeout_s: float,
               stop) -> bool:
    """For launchers of `serve` itself (bench replay): until the frontend's /health counts the
    workers (False: a child died, time ran out or `stop`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and stop["sig"] is None:
        dead = cluster.dead()
        if dead:
            log.error("%s exited during start-up (code %s)", *dead[0])
            return False
        try:
            r = httpx.get(health_url, timeout=1.0)
            body = r.json()
            if r.status_code == 200 and body.get("decode", 0) >= num_decode and body.get("prefill", 0) >= num_prefill:
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    if stop["sig"] is None:
        log.error("the cluster was not healthy within %.0f s", timeout_s)
    return False

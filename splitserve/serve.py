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
child at all.
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
from pools.controller import PoolController
from pools.local_connector import LocalProcessConnector, describe_exit
from pools.book import PoolBook, PoolName, PoolSpec
from pools.restarts import CrashHistory, RestartPolicy
from runtime.admin_auth import new_token, write_token_file
from runtime.config import FrontendConfig, ServeConfig, WorkerConfig
from runtime.config_file import write_config
from runtime.errors import InvalidRequest
from runtime.metrics import PoolMetrics, start_metrics_server
from runtime.process import bounded, run_component, with_parent_death
from runtime.redis_embedded import EmbeddedRedis
from splitserve.models import resolve_model

log = logging.getLogger("splitserve.serve")

STOP_MARGIN_S = 15.0          # beyond the drain timeout, before stragglers are killed
CLOSE_TIMEOUT_S = 5.0         # for each of serve's own clean-up steps; the workers' drain goes on regardless
SECRETS_ENV = ("SPLITSERVE_ADMIN_TOKEN",)


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
    try:
        model_dir = resolve_model(cfg.engine.model)
    except InvalidRequest as e:
        print(f"splitserve serve: {e.message}", file=sys.stderr)
        return 2
    from kvstore.movers.transfer import nixl_available
    if cfg.prefill_workers and not nixl_available():
        print("splitserve serve: NIXL is not installed (pip install 'splitserve[nixl]'); serving aggregated",
              file=sys.stderr)
        cfg = dataclasses.replace(cfg, prefill_workers=0)
    profile = None
    if cfg.planner.enabled:
        try:
            from planner.live import check_sla
            profile = check_sla(cfg.planner)
        except (InvalidRequest, ValueError, OSError) as e:
            print(f"splitserve serve: --planner: {getattr(e, 'message', e)}", file=sys.stderr)
            return 2
    try:
        book = pool_book(cfg)
    except InvalidRequest as e:
        print(f"splitserve serve: {e.message}", file=sys.stderr)
        return 2
    if connect is not None and not connect(cfg):
        return 2
    runner = launcher(cfg, model_dir, book)
    runner.planner_profile = profile
    return run_component(runner.run())


def pool_book(cfg: ServeConfig) -> PoolBook:
    """The pools' start sizes and limits; aggregated serving (--prefill-workers 0) fixes the prefill pool at 0."""
    c = cfg.controller
    decode = PoolSpec(cfg.decode_workers, c.min_decode_workers, c.max_decode_workers)
    if cfg.prefill_workers:
        prefill = PoolSpec(cfg.prefill_workers, c.min_prefill_workers, c.max_prefill_workers)
    else:
        prefill = PoolSpec(0, 0, 0, fixed="this cluster serves aggregated (started with --prefill-workers 0): "
                                          "every worker prefills its own prompts")
    for name, spec, n in (("decode", decode, cfg.decode_workers), ("prefill", prefill, cfg.prefill_workers)):
        if not spec.min <= n <= spec.max:
            raise InvalidRequest(f"--{name}-workers {n} lies outside the {name} pool's limits "
                                 f"(--min-{name}-workers {spec.min}, --max-{name}-workers {spec.max})")
    return PoolBook({PoolName.DECODE: decode, PoolName.PREFILL: prefill})


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
        self.frontend: subprocess.Popen | None = None
        self.frontend_started = 0.0
        self.frontend_history = CrashHistory(RestartPolicy(backoff_s=cfg.controller.restart_backoff_s,
                                                           crash_loop_restarts=cfg.controller.crash_loop_restarts))
        self.connector: LocalProcessConnector | None = None
        self.controller: PoolController | None = None
        self.planner = None                           # with --planner: a planner.live.PlannerLoop (an actor on Ray)
        self.planner_profile = None
        self.admin = None
        self.admin_token = ""                         # in memory only; a planner actor gets it by environment
        self.token_path: Path | None = None
        self.admin_address = ""
        self.env: dict[str, str] = {}

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
            self.redis = EmbeddedRedis(own_group=True, host=self.redis_host())
            cfg = self.cfg = dataclasses.replace(cfg, frontend=dataclasses.replace(
                cfg.frontend, redis=dataclasses.replace(cfg.frontend.redis, url=self.redis.url)))
        self.env = {k: v for k, v in os.environ.items() if k not in SECRETS_ENV}
        self.env["PYTHONUNBUFFERED"] = "1"
        if cfg.frontend.api_key:
            self.env["SPLITSERVE_API_KEY"] = cfg.frontend.api_key    # by environment, never argv or a file
        if not await self._start_controller():
            return 2
        self._start_frontend()
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
                                         metrics_url=f"http://{mhost}:{mport}/metrics")
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
            on_crash_loop=lambda pool: self.metrics.crash_loops.labels(pool).inc())

    def _spawn_worker(self, pool: PoolName, name: str) -> subprocess.Popen:
        role = self.roles[pool]
        command = "prefill-worker" if role == "prefill" else "decode-worker"
        index = name.rsplit("-", 1)[1]
        return self.cluster.spawn_component(command, name, worker_config(self.cfg, self.model_dir, role, index),
                                            self.env)

    def _start_frontend(self) -> None:
        self.frontend = self.cluster.spawn_component("frontend", "frontend", frontend_config(self.cfg, self.model_dir),
                                                     self.env)
        self.frontend_started = time.monotonic()

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
                if self.frontend.poll() is not None:
                    log.error("the frontend exited during start-up (%s)", describe_exit(self.frontend.returncode))
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
        f = self.frontend
        if f is not None and f.poll() is not None:
            self.frontend = None
            if not self._restart_later("frontend", f.returncode, self.frontend_started, self.frontend_history,
                                       self._start_frontend, "the workers keep running"):
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
        if self.frontend is not None and self.frontend.poll() is None:
            self.frontend.send_signal(signal.SIGTERM)
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
        token = (f"token in {self.token_path}" if self.token_path
                 else "token: --admin-token / SPLITSERVE_ADMIN_TOKEN")
        return (f"\nSplitserve is ready: model {model_name!r}, {pools}\n"
                f"  OpenAI HTTP  {url}/v1   (health {url}/health, metrics {url}/metrics)\n"
                f"  gRPC         {cfg.frontend.host}:{cfg.frontend.grpc_port}   (splitserve.v1.Generation)\n"
                f"  Admin        {self.admin_address}   (splitserve pools status --admin-url "
                f"{self.admin_address}; {token})\n"
                f"  try: curl {url}/v1/completions -H 'Content-Type: application/json' "
                f"-d '{{\"model\": \"{model_name}\", \"prompt\": \"def hello\", \"max_tokens\": 16}}'\n"
                f"Ctrl-C drains and stops everything.\n")


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except asyncio.TimeoutError:
        pass


def connect_host(host: str) -> str:
    """Where a process on this node reaches a server bound to `host` (a wildcard: loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def worker_config(cfg: ServeConfig, model_dir: str, role: str, index: int | str) -> WorkerConfig:
    """Worker ROLE-INDEX's: the cluster's engine, Redis, host and drain timeout; metrics on a free port.
    With the planner, prefill workers order their queues by its TTFT target (unless it sizes for FIFO ones)."""
    deadline_ordered = cfg.planner.enabled and cfg.planner.deadline_ordered
    deadline = cfg.planner.ttft_ms if role == "prefill" and deadline_ordered else None
    return WorkerConfig(engine=dataclasses.replace(cfg.engine, model=model_dir), redis=cfg.frontend.redis,
                        role=role, host=cfg.frontend.host, metrics_port=0, worker_id=f"{role}-{index}",
                        drain_timeout_s=cfg.frontend.drain_timeout_s, prefill_lease_s=cfg.prefill_lease_s,
                        prefill_deadline_ms=deadline)


def frontend_config(cfg: ServeConfig, model_dir: str) -> FrontendConfig:
    """The frontend's: the workers' model, named for clients; no key (it comes by environment)."""
    spec = cfg.engine.model
    model_name = cfg.frontend.model_name or (spec.split(":")[0] if spec.startswith("tiny") else Path(model_dir).name)
    max_model_len = cfg.engine.max_model_len
    if max_model_len is None and cfg.engine.mock:
        from perf.profile import DEFAULT_MAX_MODEL_LEN
        max_model_len = DEFAULT_MAX_MODEL_LEN
    return dataclasses.replace(cfg.frontend, model=model_dir, model_name=model_name, api_key=None,
                               max_model_len=max_model_len)


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

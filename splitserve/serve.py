"""`splitserve serve`: a whole cluster on one machine, as separate processes.

Starts the embedded Redis (unless --redis-url), the workers and the frontend; waits until the
frontend reports every worker healthy; prints where to connect; on Ctrl-C / SIGTERM stops them
all (children also die with this process if it is killed, via PR_SET_PDEATHSIG).

Each child gets its whole config as a file (`splitserve decode-worker --config DIR/decode-0.json`),
derived from the ServeConfig: the workers' from its engine, the frontend's from its frontend, all
sharing its Redis and host. The files lie in a private directory (mode 0700) that is removed at
exit; the API key is not in them but in the frontend's environment.
"""

from __future__ import annotations

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

from runtime.config import FrontendConfig, ServeConfig, WorkerConfig
from runtime.config_file import write_config
from runtime.errors import InvalidRequest
from runtime.process import die_with_parent
from runtime.redis_embedded import EmbeddedRedis
from splitserve.models import resolve_model

log = logging.getLogger("splitserve.serve")


class Cluster:
    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._config_dir: str | None = None

    @property
    def config_dir(self) -> str:
        """Where the children's config files lie: private (mode 0700), removed by `stop`."""
        if self._config_dir is None:
            self._config_dir = tempfile.mkdtemp(prefix="splitserve-serve-")
        return self._config_dir

    def spawn(self, name: str, argv: list[str], env: dict[str, str], stdout=None) -> None:
        """Start `splitserve ARGV...` as a child that dies with this process."""
        proc = subprocess.Popen([sys.executable, "-m", "splitserve", *argv], env=env, stdout=stdout,
                                preexec_fn=die_with_parent)
        self.procs.append((name, proc))

    def spawn_component(self, command: str, name: str, cfg: WorkerConfig | FrontendConfig,
                        env: dict[str, str]) -> None:
        """Start `splitserve COMMAND --config DIR/NAME.json` with `cfg` in that file."""
        path = os.path.join(self.config_dir, f"{name}.json")
        write_config(cfg, path)
        self.spawn(name, [command, "--config", path], env)

    def dead(self) -> list[tuple[str, int]]:
        return [(n, p.returncode) for n, p in self.procs if p.poll() is not None]

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
        if self._config_dir is not None:
            shutil.rmtree(self._config_dir, ignore_errors=True)


def serve(cfg: ServeConfig) -> int:
    try:
        model_dir = resolve_model(cfg.engine.model)
    except InvalidRequest as e:
        print(f"splitserve serve: {e.message}", file=sys.stderr)
        return 2
    from kvstore.transfer import nixl_available
    if cfg.prefill_workers and cfg.engine.mock:
        print("splitserve serve: mock workers hold no KV to move; serving aggregated", file=sys.stderr)
        cfg = dataclasses.replace(cfg, prefill_workers=0)
    if cfg.prefill_workers and not nixl_available():
        print("splitserve serve: NIXL is not installed (pip install 'splitserve[nixl]'); serving aggregated",
              file=sys.stderr)
        cfg = dataclasses.replace(cfg, prefill_workers=0)
    redis = None if cfg.frontend.redis.url else EmbeddedRedis()
    if redis is not None:
        cfg = dataclasses.replace(cfg, frontend=dataclasses.replace(
            cfg.frontend, redis=dataclasses.replace(cfg.frontend.redis, url=redis.url)))
    frontend = frontend_config(cfg, model_dir)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cfg.frontend.api_key:
        env["SPLITSERVE_API_KEY"] = cfg.frontend.api_key      # by environment, never argv or a file
    cluster = Cluster()
    stop = {"sig": None}

    def on_signal(signum, frame):
        stop["sig"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        role = "decode" if cfg.prefill_workers else "aggregated"
        for i in range(cfg.prefill_workers):
            cluster.spawn_component("prefill-worker", f"prefill-{i}", worker_config(cfg, model_dir, "prefill", i),
                                    env)
        for i in range(cfg.decode_workers):
            cluster.spawn_component("decode-worker", f"{role}-{i}", worker_config(cfg, model_dir, role, i), env)
        cluster.spawn_component("frontend", "frontend", frontend, env)
        url = f"http://{cfg.frontend.host}:{cfg.frontend.http_port}"
        if not wait_ready(cluster, f"{url}/health", cfg.decode_workers, cfg.prefill_workers,
                          cfg.startup_timeout_s, stop):
            return 0 if stop["sig"] is not None else 1    # stopped on request while starting: not a failure
        print(_banner(cfg, frontend.model_name, url), flush=True)
        while stop["sig"] is None:
            for name, code in cluster.dead():
                if name == "frontend":
                    log.error("the frontend exited (code %s); stopping", code)
                    return 1
            time.sleep(0.2)
        log.info("stopping (signal %s)", stop["sig"])
        return 0
    finally:
        cluster.stop()
        if redis is not None:
            redis.close()


def _banner(cfg: ServeConfig, model_name: str, url: str) -> str:
    pools = (f"{cfg.prefill_workers} prefill + {cfg.decode_workers} decode worker(s)" if cfg.prefill_workers
             else f"{cfg.decode_workers} aggregated worker(s)")
    return (f"\nSplitserve is ready: model {model_name!r}, {pools}\n"
            f"  OpenAI HTTP  {url}/v1   (health {url}/health, metrics {url}/metrics)\n"
            f"  gRPC         {cfg.frontend.host}:{cfg.frontend.grpc_port}   (splitserve.v1.Generation)\n"
            f"  try: curl {url}/v1/completions -H 'Content-Type: application/json' "
            f"-d '{{\"model\": \"{model_name}\", \"prompt\": \"def hello\", \"max_tokens\": 16}}'\n"
            f"Ctrl-C stops everything.\n")


def worker_config(cfg: ServeConfig, model_dir: str, role: str, index: int) -> WorkerConfig:
    """Worker ROLE-INDEX's: the cluster's engine, Redis and host; metrics on a free port."""
    return WorkerConfig(engine=dataclasses.replace(cfg.engine, model=model_dir), redis=cfg.frontend.redis,
                        role=role, host=cfg.frontend.host, metrics_port=0, worker_id=f"{role}-{index}")


def frontend_config(cfg: ServeConfig, model_dir: str) -> FrontendConfig:
    """The frontend's: the workers' model, named for clients; no key (it comes by environment)."""
    spec = cfg.engine.model
    model_name = cfg.frontend.model_name or (spec.split(":")[0] if spec.startswith("tiny") else Path(model_dir).name)
    max_model_len = cfg.engine.max_model_len
    if max_model_len is None and cfg.engine.mock:
        from runtime.profile import DEFAULT_MAX_MODEL_LEN
        max_model_len = DEFAULT_MAX_MODEL_LEN
    return dataclasses.replace(cfg.frontend, model=model_dir, model_name=model_name, api_key=None,
                               max_model_len=max_model_len)


def wait_ready(cluster: Cluster, health_url: str, num_decode: int, num_prefill: int, timeout_s: float,
               stop) -> bool:
    """Until the frontend's /health counts the workers (False: a child died, time ran out or `stop`)."""
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

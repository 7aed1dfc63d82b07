"""Test helper: real `splitserve serve` clusters in subprocesses, on free ports.

`start_cluster` runs `python -m splitserve serve` (its output captured to a file), waits for the
launcher's ready banner and /health, and `Cluster.stop` ends it with SIGTERM. With an explicit
--redis-url (an EmbeddedRedis the caller owns) tests can find the workers in Redis, ask them for
their status over gRPC and find their pids, as an operator would. `own_cluster` does all of that
with a Redis of its own. Every cluster gets a free admin port; `Cluster.cli(...)` runs
`splitserve pools|workers ...` against it, as an operator would (the token comes from the file
serve wrote). Every cluster gets its cluster token from the test (SPLITSERVE_CLUSTER_TOKEN), so
that tests may call its workers as its frontend does (`worker_metadata`). Used by the integration tests and by bench/cpu_serving_bench.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import redis.asyncio as aioredis

from proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from runtime.discovery import WorkerInfo, list_workers
from runtime.grpc_links import TOKEN_ENV, TOKEN_METADATA
from runtime.redis_embedded import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0


def until(cond, timeout_s: float = 10.0, interval_s: float = 0.05, what: str = "condition"):
    """Poll `cond()` until it returns something truthy; return it. Fails after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s (last: {value!r})")
        time.sleep(interval_s)


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples on the frontend's /metrics whose labels include `labels`."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(m.group(2)) for m in re.finditer(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.M)
               if all(w in (m.group(1) or "") for w in want))


def log_problems(text: str, also: tuple[str, ...] = (), context: int = 30) -> str:
    """The regions of a cluster log around each traceback or ERROR line (and each of `also`), for a
    failure message that shows the fault itself rather than the log's last lines; "" when clean."""
    lines = text.splitlines()
    hits = [i for i, line in enumerate(lines)
            if "Traceback" in line or " ERROR " in line or any(a in line for a in also)]
    if not hits:
        return ""
    shown: list[str] = []
    last = -1
    for i in hits:
        lo, hi = max(i - 5, last + 1), min(i + context, len(lines))
        if lo > last + 1 and shown:
            shown.append("...")
        shown.extend(lines[lo:hi])
        last = max(last, hi - 1)
    return "\n".join(shown)


def assert_clean_log(text: str, also: tuple[str, ...] = ()) -> None:
    problems = log_problems(text, also)
    assert not problems, f"the cluster log shows faults:\n{problems}"


@dataclass
class Cluster:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    log_path: Path
    redis_url: str | None = None
    namespace: str = "splitserve"
    argv: list[str] = field(default_factory=list)
    admin_port: int = 0
    cluster_token: str = ""

    @property
    def worker_metadata(self) -> tuple[tuple[str, str], ...]:
        """What a call to one of this cluster's workers must carry (runtime/grpc_links.py)."""
        return ((TOKEN_METADATA, self.cluster_token),)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def admin_url(self) -> str:
        return f"127.0.0.1:{self.admin_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def cli(self, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
        """`splitserve ARGS...` against this cluster's admin API (unless ARGS name another) in a
        subprocess: the real CLI, its output as text."""
        url = [] if "--admin-url" in args else ["--admin-url", self.admin_url]
        r = subprocess.run([sys.executable, "-m", "splitserve", *args, *url], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, env=env)
        if check:
            assert r.returncode == 0, f"splitserve {' '.join(args)}: {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                for pid in [self.proc.pid, *self.child_pids("splitserve")]:   # every thread's stack to the log
                    try:
                        os.kill(pid, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
                time.sleep(1.0)
                self.proc.kill()
                self.proc.wait()
                text = self.log()
                tail = text[text.rfind("stopping (signal"):] if "stopping (signal" in text else text[-3000:]
                raise AssertionError(f"splitserve serve ignored SIGTERM for {timeout_s} s\n{tail[-20000:]}")
        return self.proc.returncode

    # ---- the workers, as found in Redis -------------------------------------------------
    def workers(self) -> list[WorkerInfo]:
        return self.read_redis(list_workers)

    def read_redis(self, reader):
        """`await reader(client, namespace)` on a client of this cluster's Redis, closed after."""
        assert self.redis_url, "this cluster was started without an explicit --redis-url"

        async def go():
            client = aioredis.Redis.from_url(self.redis_url)
            try:
                return await reader(client, self.namespace)
            finally:
                await client.aclose()
        return asyncio.run(go())

    def worker_status(self) -> list[worker_pb2.WorkerStatus]:
        out = []
        for w in self.workers():
            with grpc.insecure_channel(w.address) as ch:
                out.append(worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.WorkerStatusRequest(), timeout=5,
                                                                    metadata=self.worker_metadata))
        return out

    def wait_idle(self, timeout_s: float = 20.0) -> list[worker_pb2.WorkerStatus]:
        """Every worker has no request left and every KV block free again."""
        def idle():
            st = self.worker_status()
            ok = st and all(s.num_free_blocks == s.num_total_blocks and s.num_running == 0
                            and s.num_waiting == 0 for s in st)
            return st if ok else None
        return until(idle, timeout_s, 0.1, "all workers idle with every block free")


    def child_pids(self, match: str) -> list[int]:
        """Pids of the launcher's children whose command line contains `match`."""
        out = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.proc.pid and match in cmdline:
                out.append(int(pid))
        return out


PORT_TAKEN = re.compile(r"address already in use|is the port in use", re.IGNORECASE)
START_ATTEMPTS = 3


class PortTaken(AssertionError):
    """serve exited during start-up because a port picked for it was taken."""


def start_cluster(tmp_dir: Path, *args: str, redis_url: str | None = None, env: dict | None = None,
                  min_workers: int = 1) -> Cluster:
    """`serve` on free ports, healthy. The ports are picked here and bound by serve's frontend a
    moment later, so another process may take one meanwhile: serve then exits at once saying so,
    and the cluster is started again on other ports (a few times at most)."""
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return _start_cluster(tmp_dir, *args, redis_url=redis_url, env=env, min_workers=min_workers)
        except PortTaken:
            if attempt == START_ATTEMPTS:
                raise


def _start_cluster(tmp_dir: Path, *args: str, redis_url: str | None = None, env: dict | None = None,
                   min_workers: int = 1) -> Cluster:
    http_port, grpc_port = free_port(), free_port()
    # the admin API binds last, after the workers and Redis took their ports: a port picked here
    # was taken by then in one CI run ("Address already in use"); serve picks it and prints it
    argv = [sys.executable, "-m", "splitserve", "serve", "--http-port", str(http_port),
            "--grpc-port", str(grpc_port), "--admin-port", "0", "--device", "cpu", *args]
    if redis_url:
        argv += ["--redis-url", redis_url]
    tmp_dir.mkdir(parents=True, exist_ok=True)
    log_path = tmp_dir / f"serve-{http_port}.log"
    env = dict(os.environ if env is None else env)
    env.setdefault(TOKEN_ENV, secrets.token_urlsafe(16))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    cluster = Cluster(proc, http_port, grpc_port, log_path, redis_url, argv=argv, cluster_token=env[TOKEN_ENV])

    def healthy():
        if proc.poll() is not None:
            why = PortTaken if PORT_TAKEN.search(cluster.log()) else AssertionError
            raise why(f"splitserve serve exited with {proc.returncode}:\n{cluster.log()[-3000:]}")
        if "Splitserve is ready" not in cluster.log():   # every pool member healthy, per the launcher
            return False
        try:
            r = httpx.get(f"{cluster.url}/health", timeout=2)
            return r.status_code == 200 and r.json()["workers"] >= min_workers
        except httpx.HTTPError:
            return False
    try:
        until(healthy, START_TIMEOUT_S, 0.1, "a healthy cluster")
        cluster.admin_port = int(re.search(r"Admin +127\.0\.0\.1:(\d+)", cluster.log()).group(1))
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextmanager
def own_cluster(*args: str, tmp_dir: Path | None = None):
    """A cluster with its own Redis, stopped (and checked to exit cleanly) on leaving."""
    with EmbeddedRedis() as redis:
        c = start_cluster(Path(tmp_dir or tempfile.mkdtemp(prefix="splitserve-test-")), *args,
                          redis_url=redis.url)
        try:
            yield c
        finally:
            code = c.stop()
            assert code == 0, f"splitserve serve exited with {code}:\n{c.log()[-3000:]}"

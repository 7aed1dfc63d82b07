"""`splitserve serve --ray ADDRESS` on a real Ray cluster: one head node on loopback (`ray start
--head`, token auth on, 4 logical CPUs), the mock engine (Ray places processes; the engine is not
what is tested here), the embedded Redis on the head, the SLA planner on (`--planner`; the tests
hold the pool with `pools scale`, so that they set its size). In order, on one cluster:

- completions are served by worker actors: every worker process is the child of a Ray actor
  process, and each took traffic;
- the SLA planner runs as an actor's process with the admin token in its environment only; its
  decisions show in `pools status` and in the frontend's /metrics, its log in serve's; its actor,
  killed, is replaced;
- `pools scale --decode 3` adds actors that take traffic; `--decode 1` drains two while they stream:
  no failed or truncated request, drained actors leave;
- kill -9 of a worker's actor process: the connector replaces it (same name, a new actor), ready
  within REPLACED_WITHIN_S;
- SIGTERM to serve drains and stops every actor's process, the planner's too; serve exits 0.

About a minute on the 2-core CI machine (Ray's head starts in ~10 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

ray = pytest.importorskip("ray")

from proto.splitserve.v1 import admin_pb2, admin_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402
from runtime.admin_auth import read_token_file  # noqa: E402
from runtime.redis_embedded import free_port  # noqa: E402
from tests.integration.cluster import start_cluster, until  # noqa: E402
from tests.integration.streams import failures, prompts, stream_all  # noqa: E402

pytestmark = pytest.mark.slow

DRAIN_TIMEOUT_S = 1.5
REPLACED_WITHIN_S = 60.0          # a new actor process imports torch and loads the model: generous on a loaded 2-core CI
N = 24
PROMPTS = prompts(N, seed=11, lengths=(40, 120))
MAX_TOKENS = [240 if i % 4 == 0 else 16 for i in range(N)]   # a quarter outlive the drain timeout (mock ITL ~7 ms)


def ray_env(tmp: Path) -> dict[str, str]:
    token = tmp / "token"
    token.write_text(os.urandom(32).hex())
    return {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",      # 127.0.0.1, not the machine's address
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    temp_dir = f"/tmp/ssray-{os.getpid()}"            # short: Ray's socket paths must fit 107 bytes
    env = ray_env(tmp_path_factory.mktemp("ray"))
    port = free_port()                      # an ephemeral port: outside Ray's worker ports 10002-19999
    log = tmp_path_factory.mktemp("raylog") / "head.log"
    with open(log, "wb") as out:
        head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--port", str(port),
                                 "--num-cpus", "4", "--num-gpus", "0", "--include-dashboard=false",
                                 "--object-store-memory", str(100 << 20),      # lean: no object is stored
                                 "--temp-dir", temp_dir, "--block"], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        until(lambda: head.poll() is not None or "Ray runtime started" in log.read_text(), 90, 0.2, "Ray's head")
        assert head.poll() is None, log.read_text()[-3000:]
        RAY_ROOTS.add(head.pid)             # its processes (and no other cluster's) are the tests' to find
        yield f"127.0.0.1:{port}", env
    finally:
        head.send_signal(signal.SIGTERM)         # --block: stops the processes it started (no `ray stop`)
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(ray_head, tmp_path_factory):
    address, env = ray_head
    c = start_cluster(tmp_path_factory.mktemp("serve"), "--ray", address, "--mock", "--prefill-workers", "0",
                      "--decode-workers", "2", "--ray-worker-cpus", "0.5", "--ray-frontend-cpus", "0.5",
                      "--drain-timeout-s", str(DRAIN_TIMEOUT_S), "--lease-ttl-s", "2",
                      "--planner", "--planner-interval-s", "1", env=env, min_workers=2)
    # the tests set the sizes: an override holds them against the planner (which, with no load yet,
    # holds the pool where it is anyway), and its decisions still show
    c.cli("pools", "scale", "--decode", "2")
    yield c
    planner_actors = {actor_of(pid)[0] for pid in component_pids("planner")}
    code = c.stop(60)
    assert code == 0, c.log()[-3000:]
    assert worker_pids() == [], "a worker process outlived serve"
    until(lambda: component_pids("planner") == [] and not any(os.path.exists(f"/proc/{p}") for p in planner_actors),
          10, 0.2, "the planner's process and actor gone with serve")


def status(cluster) -> admin_pb2.GetStatusResponse:
    with grpc.insecure_channel(cluster.admin_url) as ch:
        md = [("authorization", f"Bearer {read_token_file(cluster.admin_port)}")]
        return admin_pb2_grpc.AdminStub(ch).GetStatus(admin_pb2.GetStatusRequest(), metadata=md, timeout=10)


def ready(cluster) -> list[admin_pb2.WorkerStatus]:
    return [w for w in status(cluster).workers if w.state == admin_pb2.WORKER_STATE_READY]


def settled(cluster, n: int) -> bool:
    """n ready decode workers and no others, and the frontend routes to all n (it learns of a ready
    worker on its next discovery poll, a moment after the controller does)."""
    p = next(p for p in status(cluster).pools if p.pool == "decode")
    return (p.desired == n and p.ready == n and p.starting == 0 and p.draining == 0
            and httpx.get(f"{cluster.url}/health", timeout=10).json().get("decode") == n)


def load(address: str, metadata) -> worker_pb2.WorkerStatus:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.WorkerStatusRequest(), timeout=5, metadata=metadata)


def _proc(pid: str) -> tuple[int, str]:
    with open(f"/proc/{pid}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return ppid, f.read().replace(b"\0", b" ").decode()


RAY_ROOTS: set[int] = set()      # the Ray head this module started: what the tests look under (and kill)


def component_pids(command: str, name: str = "") -> list[int]:
    """Processes of `splitserve COMMAND` started by an actor of this module's Ray head (their config
    comes through a pipe; a worker's command line ends with its handle's name). Other Ray clusters
    on the machine, another test's, run processes of the same names: they are not looked at."""
    from tests.integration.test_api_key import descendants
    out = []
    for pid in [str(p) for root in RAY_ROOTS for p in descendants(root)]:
        try:
            _, cmd = _proc(pid)
        except (OSError, ValueError, IndexError):
            continue
        if f"{command} --config /dev/stdin" in cmd and (not name or cmd.rstrip().endswith(f"--worker-id {name}")):
            out.append(int(pid))
    return out


def worker_pids(name: str = "") -> list[int]:
    """Worker processes started by a Ray actor."""
    return component_pids("decode-worker", name)


def actor_of(pid: int) -> tuple[int, str]:
    ppid, _ = _proc(str(pid))
    return ppid, _proc(str(ppid))[1]


def listening(pids: set[int]) -> list[str]:
    """The addresses the processes `pids` listen on (TCP), from `ss`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout
    return sorted(line.split()[3] for line in out.splitlines()
                  if {int(p) for p in re.findall(r"pid=(\d+)", line)} & pids)


@pytest.mark.skipif(shutil.which("ss") is None, reason="no ss here")
def test_a_local_ray_run_binds_loopback_and_leaves_nothing_in_tmp(tmp_path):
    """`serve --ray` alone: Ray, the embedded Redis (no password), the workers and the frontend
    listen on loopback only, not on the machine's address; no config file is left in /tmp. It runs
    first, before the module's Ray head starts (two Ray clusters would crowd 2 cores)."""
    from tests.integration.test_api_key import descendants
    before = set(Path("/tmp").glob("splitserve-actor-*"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    t0 = time.monotonic()
    c = start_cluster(tmp_path, "--ray", "--mock", "--prefill-workers", "0", "--decode-workers", "1",
                      "--ray-local-cpus", "2", "--ray-worker-cpus", "0.5", "--ray-frontend-cpus", "0.5", env=env)
    try:
        print(f"local Ray cluster ready in {time.monotonic() - t0:.1f} s")
        workers = json.loads(c.cli("workers", "list", "--json").stdout)
        assert workers and all(w["address"].startswith("127.0.0.1:") for w in workers), workers
        addresses = listening(set(descendants(c.proc.pid)) | {c.proc.pid})
        assert len(addresses) >= 6, addresses           # Ray's own, Redis, a worker, the frontend, admin
        assert all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")) for a in addresses), addresses
        streams = asyncio.run(stream_all(c.url, PROMPTS[:4], 8))
        assert failures(streams, 8) == []
    finally:
        assert c.stop(60) == 0, c.log()[-3000:]
    assert set(Path("/tmp").glob("splitserve-actor-*")) - before == set()


def test_completions_are_served_by_worker_actors(cluster):
    workers = ready(cluster)
    assert sorted(w.name for w in workers) == ["aggregated-0", "aggregated-1"]
    for w in workers:
        [pid] = worker_pids(w.name)
        assert actor_of(pid)[1].startswith("ray::ComponentActor"), actor_of(pid)     # a Ray actor runs it
    streams = asyncio.run(stream_all(cluster.url, PROMPTS, 16))
    assert failures(streams, 16) == []
    served = {w.name: load(w.address, cluster.worker_metadata).num_prompt_tokens for w in workers}
    assert all(v > 0 for v in served.values()), served
    assert "On the Ray cluster at 127.0.0.1:" in cluster.log()


def test_the_sla_planner_runs_as_an_actor_whose_decisions_show_and_which_is_replaced(cluster):
    [pid] = until(lambda: component_pids("planner"), 30, 0.2, "the planner's process")
    actor_pid, cmd = actor_of(pid)
    assert cmd.startswith("ray::ComponentActor"), cmd
    token = read_token_file(cluster.admin_port)
    with open(f"/proc/{pid}/environ", "rb") as f:               # the admin token by environment
        assert f"SPLITSERVE_ADMIN_TOKEN={token}".encode() in f.read().split(b"\0")
    assert token not in cluster.log() + _proc(str(pid))[1]      # not in argv, not logged
    until(lambda: "[override 2 holds until `pools release`]" in cluster.cli("pools", "status").stdout, 30, 0.3,
          "a planner decision in `pools status`")
    until(lambda: [line for line in httpx.get(f"{cluster.url}/metrics", timeout=10).text.splitlines()
                   if line.startswith("splitserve_planner_decisions_total{") and 'pool="decode"' in line],
          10, 0.3, "the planner's metrics in the frontend's")
    until(lambda: re.search(r"planner\[\d+\] planner\.live: planner: ", cluster.log()), 10, 0.2, "its log in serve's")

    os.kill(actor_pid, signal.SIGKILL)                           # the actor's process: Ray reports it dead
    [new_pid] = until(lambda: [p for p in component_pids("planner") if p != pid], 30, 0.2, "a new planner")
    assert "the planner killed by SIGKILL" in cluster.log() and actor_of(new_pid)[0] != actor_pid


def test_pools_scale_adds_and_drains_actors_with_no_failed_request(cluster):
    cluster.cli("pools", "scale", "--decode", "3")
    until(lambda: settled(cluster, 3), 90, 0.2, "three ready decode workers")
    assert len(worker_pids()) == 3
    new = next(w for w in ready(cluster) if w.name == "aggregated-2")
    md = cluster.worker_metadata
    before = load(new.address, md).num_prompt_tokens
    streams = asyncio.run(stream_all(cluster.url, PROMPTS, 16))
    assert failures(streams, 16) == [] and load(new.address, md).num_prompt_tokens > before    # it took traffic

    addresses = [w.address for w in ready(cluster)]

    async def scale_down_when_all_busy():
        deadline = time.monotonic() + 60
        while not all(await asyncio.gather(*(asyncio.to_thread(lambda a=a: load(a, md).num_running) for a in addresses))):
            assert time.monotonic() < deadline, "not every worker got work"
            await asyncio.sleep(0.02)
        await asyncio.to_thread(cluster.cli, "pools", "scale", "--decode", "1")

    streams = asyncio.run(stream_all(cluster.url, PROMPTS, MAX_TOKENS, during=scale_down_when_all_busy))
    assert failures(streams, MAX_TOKENS) == []                     # none failed, none truncated
    until(lambda: settled(cluster, 1), 30, 0.2, "one decode worker left")
    until(lambda: len(worker_pids()) == 1, 10, 0.1, "the drained actors' processes gone")
    assert len(re.findall(r"ray_connector: aggregated-\d exited after its drain \(exit code 0\)", cluster.log())) == 2


def test_a_killed_actor_is_replaced(cluster):
    [survivor] = ready(cluster)
    [pid] = worker_pids(survivor.name)
    actor_pid, cmd = actor_of(pid)
    assert cmd.startswith("ray::")
    os.kill(actor_pid, signal.SIGKILL)                       # the actor's process: Ray reports the actor dead
    t0 = time.monotonic()

    def replaced():
        w = [w for w in ready(cluster) if w.name == survivor.name]
        return w and w[0].worker_id != survivor.worker_id and w[0].restarts == 1
    try:
        until(replaced, REPLACED_WITHIN_S, 0.2, "a replacement actor, ready")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{cluster.log()[-6000:]}") from None
    print(f"killed actor replaced and ready in {time.monotonic() - t0:.1f} s")
    assert re.search(rf"{survivor.name} actor died \(ActorDiedError\) after [\d.]+ s; replacing its actor", cluster.log())
    [new_pid] = worker_pids(survivor.name)
    assert new_pid != pid and actor_of(new_pid)[0] != actor_pid
    streams = asyncio.run(stream_all(cluster.url, PROMPTS[:8], 16))
    assert failures(streams, 16) == []

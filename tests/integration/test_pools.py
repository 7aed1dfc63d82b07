"""Pools that change under traffic, on one real disaggregated cluster (tiny model, CPU, real Redis,
gRPC and NIXL), each step under 32 concurrent streaming requests checked against a reference run:

- `pools status` and `workers list` through the real CLI; the admin API refuses calls without its token;
- `pools scale --decode 3` adds workers that take traffic; `--decode 1` drains two while they stream
  (short requests finish, long ones outlive the 1.5 s drain timeout and move to the survivor):
  no failed request, no truncated stream, the same greedy tokens;
- the same for the prefill pool while it computes prompts and pushes their KV;
- kill -9 of a busy decode worker: no failed request, /health says degraded, a replacement is ready
  within REPLACED_WITHIN_S (docs/operations.md), the dead worker leaves the pool once.

The steps run in order on one cluster (each leaves it at a known size), which keeps this module to
about two minutes on the 2-core CI machine.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import grpc
import httpx
import pytest

pytest.importorskip("nixl")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from proto.splitserve.v1 import admin_pb2, admin_pb2_grpc  # noqa: E402
from runtime.admin_auth import read_token_file  # noqa: E402
from tests.integration.cluster import assert_clean_log, metric, own_cluster, until  # noqa: E402
from tests.integration.streams import failures, prompts, stream_all  # noqa: E402

pytestmark = pytest.mark.slow

DRAIN_TIMEOUT_S = 1.5
REPLACED_WITHIN_S = 30.0        # kill -9 to a ready replacement, on the 2-core CI machine (docs/operations.md)
N = 32
PROMPTS = prompts(N, seed=7, lengths=(150, 450))
MAX_TOKENS = [200 if i % 4 == 0 else 24 for i in range(N)]    # a quarter outlive the drain timeout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # no prefix caching: a rerun of the same prompts is as much work as the first run (a cached prefix
    # would leave the prefill workers idle on the rerun), and routing spreads by load alone
    with own_cluster("--prefill-workers", "1", "--decode-workers", "1", "--remote-prefill-min-tokens", "1",
                     "--max-num-batched-tokens", "64", "--drain-timeout-s", str(DRAIN_TIMEOUT_S), "--no-prefix-caching",
                     "--lease-ttl-s", "2", tmp_dir=tmp_path_factory.mktemp("pools")) as c:
        yield c
    assert_clean_log(c.log())


@pytest.fixture(scope="module")
def reference(cluster) -> list[list[int]]:
    streams = asyncio.run(stream_all(cluster.url, PROMPTS, MAX_TOKENS))
    assert failures(streams, MAX_TOKENS) == []
    return [s.tokens for s in streams]


def admin(cluster) -> tuple[admin_pb2_grpc.AdminStub, list]:
    channel = grpc.insecure_channel(cluster.admin_url)
    return admin_pb2_grpc.AdminStub(channel), [("authorization", f"Bearer {read_token_file(cluster.admin_port)}")]


def status(cluster) -> admin_pb2.GetStatusResponse:
    stub, md = admin(cluster)
    return stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=md, timeout=10)


def pool(cluster, name: str) -> admin_pb2.PoolStatus:
    return next(p for p in status(cluster).pools if p.pool == name)


def settled(cluster, name: str, n: int) -> bool:
    """The pool has n ready workers and no others, and the frontend routes to all n of them (it
    learns of a ready worker on its next discovery poll, a moment after the controller does)."""
    p = pool(cluster, name)
    return (p.desired == n and p.ready == n and p.starting == 0 and p.draining == 0
            and httpx.get(f"{cluster.url}/health", timeout=10).json().get(name) == n)


def busy(cluster, role: str) -> dict[str, int]:
    """Requests on each worker of a role (running + queued), by worker id."""
    ids = {w.worker_id for w in cluster.workers() if w.role == role}
    return {s.worker_id: s.num_running + s.num_waiting for s in cluster.worker_status() if s.worker_id in ids}


def scale(cluster, **sizes: int) -> None:
    stub, md = admin(cluster)
    stub.ScalePool(admin_pb2.ScalePoolRequest(**sizes), metadata=md, timeout=10)


async def when_all_busy(cluster, role: str, n: int, then, busy_now: int | None = None) -> None:
    """Once `busy_now` (default: all) of the `n` workers of `role` have requests at one look, call
    `then()` (fast: the admin API itself). The decode pool's scale-down asks for two of three: its
    prompts reach the workers one prefill at a time, and on a loaded 2-core machine the router may
    leave one worker idle for a whole stream (seen once). A scale-down drains the least loaded
    first, so a busy one is drained either way."""
    deadline = time.monotonic() + 60
    want = n if busy_now is None else busy_now
    looks: list = []
    while True:
        b = await asyncio.to_thread(busy, cluster, role)
        looks.append((round(time.monotonic() - deadline + 60, 2), sorted(b.values())))
        if len(b) == n and sum(1 for k in b.values() if k) >= want:
            break
        assert time.monotonic() < deadline, f"fewer than {want} {role} workers had work at once: {b} {looks[:60]}"
        await asyncio.sleep(0.02)
    await asyncio.to_thread(then)


def probe(address: str) -> tuple[str, str] | None:
    """The two probes Kubernetes runs on a worker's gRPC port: liveness ("") and readiness."""
    try:
        with grpc.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            names = health_pb2.HealthCheckResponse.ServingStatus.Name
            return tuple(names(stub.Check(health_pb2.HealthCheckRequest(service=svc), timeout=2).status)
                         for svc in ("", "splitserve.v1.Worker"))
    except grpc.RpcError:
        return None


def test_status_and_workers_list_through_the_cli(cluster):
    # the launcher's "ready" comes from the workers' health; the controller learns it from their
    # leases on its next tick (0.5 s, longer on a loaded machine): read the pools once it has
    until(lambda: settled(cluster, "decode", 1) and settled(cluster, "prefill", 1), 30, 0.2, "both pools ready")
    table = cluster.cli("pools", "status").stdout
    assert re.search(r"^POOL\s+ROLE\s+DESIRED\s+READY\s+STARTING\s+DRAINING\s+RUNNING\s+QUEUED\s+KV USE\s+"
                     r"TTFT p50/p90\s+ITL p50/p90", table, re.M), table
    assert re.search(r"^decode\s+decode\s+1\s+1\s+0\s+0\s", table, re.M), table
    assert re.search(r"^prefill\s+prefill\s+1\s+1\s+0\s+0\s", table, re.M), table
    ids = {w.worker_id for w in cluster.workers()}
    listed = cluster.cli("workers", "list").stdout
    assert len(ids) == 2 and all(re.search(rf"^{i}\s+\S+\s+\S+\s+ready\s", listed, re.M) for i in ids), listed
    st = status(cluster)
    assert sorted((w.name, w.state, w.managed) for w in st.workers) == [
        ("decode-0", admin_pb2.WORKER_STATE_READY, True), ("prefill-0", admin_pb2.WORKER_STATE_READY, True)]
    health = httpx.get(f"{cluster.url}/health").json()
    assert (health["status"], health["decode"], health["prefill"], health["degraded"]) == ("ok", 1, 1, False)
    assert [probe(w.address) for w in cluster.workers()] == [("SERVING", "SERVING")] * 2
    banner = cluster.log()
    assert f"Admin        {cluster.admin_url}" in banner
    assert read_token_file(cluster.admin_port) not in banner          # the path is printed, never the token


def test_the_admin_api_refuses_calls_without_the_token(cluster):
    stub, md = admin(cluster)
    for bad in ([], [("authorization", "Bearer not-the-token")]):
        with pytest.raises(grpc.RpcError) as e:
            stub.ScalePool(admin_pb2.ScalePoolRequest(decode=2), metadata=bad, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    r = cluster.cli("pools", "scale", "--decode", "2", "--admin-token", "not-the-token", check=False)
    assert r.returncode == 1 and "refused the token" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cluster.cli("pools", "scale", "--decode", "99", check=False)
    assert r.returncode == 1 and "99 decode workers is above the decode pool's max of 8" in r.stderr, r.stderr
    r = cluster.cli("pools", "scale", "--prefill", "2", "--admin-url", "127.0.0.1:1", check=False)
    assert r.returncode == 1 and "cannot reach the admin API at 127.0.0.1:1" in r.stderr, r.stderr
    assert pool(cluster, "decode").desired == 1 and pool(cluster, "prefill").desired == 1


def test_decode_scale_up_takes_traffic_and_scale_down_drains_under_load(cluster, reference):
    cluster.cli("pools", "scale", "--decode", "3")
    # a new worker is visible while it loads its model: alive, not ready
    until(lambda: ("SERVING", "NOT_SERVING") in [probe(w.address) for w in cluster.workers() if w.state == "starting"],
          60, 0.05, "a starting worker that answers liveness but not readiness")
    until(lambda: settled(cluster, "decode", 3), 90, 0.2, "three ready decode workers")
    old = {w.worker_id for w in cluster.workers() if w.role == "decode" and w.name == "decode-0"}
    streams = asyncio.run(stream_all(cluster.url, PROMPTS, MAX_TOKENS))
    assert failures(streams, MAX_TOKENS) == [] and [s.tokens for s in streams] == reference
    served = {s.worker_id: s.num_prompt_tokens for s in cluster.worker_status()}
    new = [w.worker_id for w in cluster.workers() if w.role == "decode" and w.worker_id not in old]
    assert len(new) == 2 and all(served[w] > 0 for w in new), served      # the new workers took traffic

    moved = metric(cluster.url, "splitserve_request_migrations_total", reason="drain")
    decode = [w for w in cluster.workers() if w.role == "decode"]
    probes: list = []

    def scale_down_and_probe():
        scale(cluster, decode=1)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and ("SERVING", "NOT_SERVING") not in probes:
            probes.extend(probe(w.address) for w in decode)

    streams = asyncio.run(stream_all(cluster.url, PROMPTS, MAX_TOKENS,
                                     during=lambda: when_all_busy(cluster, "decode", 3, scale_down_and_probe, busy_now=2)))
    assert failures(streams, MAX_TOKENS) == []                             # none failed, none truncated
    assert [s.tokens for s in streams] == reference                        # the same greedy tokens
    until(lambda: settled(cluster, "decode", 1), 30, 0.2, "one decode worker left")
    assert len([w for w in cluster.workers() if w.role == "decode"]) == 1
    assert ("SERVING", "NOT_SERVING") in probes, probes        # draining: alive, not ready
    # the long requests outlived the drain timeout and continued on the survivor
    assert metric(cluster.url, "splitserve_request_migrations_total", reason="drain") > moved
    assert re.search(r"decode-\d+\[\d+\] runtime.worker_host: drain timeout \(\d s\): handed [1-9]", cluster.log())
    assert metric(cluster.url, "splitserve_request_migrations_total", reason="worker_lost") == 0
    # each drained decode worker had the prefill worker load its KV agent; leaving, it had it removed
    gone = {w.worker_id for w in decode} - {w.worker_id for w in cluster.workers()}
    assert len(gone) == 2, gone
    until(lambda: gone <= set(re.findall(r"prefill-0\[\d+\] prefill_worker.service: decode worker (\S+) "
                                         r"disconnected", cluster.log())), 10, 0.2,
          "the prefill worker to forget the drained decode workers' KV agents")


def test_prefill_scale_up_and_down_while_kv_pushes_are_in_flight(cluster, reference):
    scale(cluster, prefill=2)
    until(lambda: settled(cluster, "prefill", 2), 90, 0.2, "two ready prefill workers")
    pushed = metric(cluster.url, "splitserve_kv_handoffs_total")
    streams = asyncio.run(stream_all(cluster.url, PROMPTS, MAX_TOKENS))
    assert failures(streams, MAX_TOKENS) == [] and [s.tokens for s in streams] == reference
    served = {s.worker_id: s.num_prompt_tokens for s in cluster.worker_status()}
    assert all(served[w] > 0 for w in busy(cluster, "prefill")), served  # both computed prompts
    assert metric(cluster.url, "splitserve_kv_handoffs_total") > pushed

    # long prompts keep both prefill workers busy for seconds, so the one drained has pushes to finish
    long_prompts, n_tokens = prompts(32, seed=8, lengths=(500, 800)), 8
    steady = asyncio.run(stream_all(cluster.url, long_prompts, n_tokens))
    assert failures(steady, n_tokens) == []
    drain_line = re.compile(r" prefill-\d+\[\d+\] runtime.worker_host: draining: (\d+) request")
    before = len(drain_line.findall(cluster.log()))
    streams = asyncio.run(stream_all(cluster.url, long_prompts, n_tokens,
                                     during=lambda: when_all_busy(cluster, "prefill", 2,
                                                                  lambda: scale(cluster, prefill=1))))
    assert failures(streams, n_tokens) == [] and [s.tokens for s in streams] == [s.tokens for s in steady]
    until(lambda: settled(cluster, "prefill", 1), 30, 0.2, "one prefill worker left")
    (in_flight,) = drain_line.findall(cluster.log())[before:]
    assert int(in_flight) > 0, "the prefill worker had nothing in flight when it drained"


def test_kill_9_of_a_busy_decode_worker_is_replaced_with_no_failed_request(cluster, reference):
    scale(cluster, decode=2)
    until(lambda: settled(cluster, "decode", 2), 90, 0.2, "two ready decode workers")
    victim = min((w for w in cluster.workers() if w.role == "decode"), key=lambda w: w.name)
    (pid,) = cluster.child_pids(f"/{victim.name}.json")
    seen: dict[str, object] = {}

    def kill():
        os.kill(pid, signal.SIGKILL)
        seen["killed_at"] = time.monotonic()

    async def during():
        deadline = time.monotonic() + 60
        while not (await asyncio.to_thread(busy, cluster, "decode")).get(victim.worker_id):
            assert time.monotonic() < deadline, "the victim never got work"
            await asyncio.sleep(0.02)
        await asyncio.to_thread(kill)
        async with httpx.AsyncClient() as client:
            while time.monotonic() - seen["killed_at"] < REPLACED_WITHIN_S:
                h = (await client.get(f"{cluster.url}/health", timeout=5)).json()
                if h["degraded"]:
                    seen["degraded"] = h
                elif "degraded" in seen:
                    seen["replaced_s"] = time.monotonic() - seen["killed_at"]
                    return
                await asyncio.sleep(0.1)

    streams = asyncio.run(stream_all(cluster.url, PROMPTS, MAX_TOKENS, during=during))
    assert failures(streams, MAX_TOKENS) == [] and [s.tokens for s in streams] == reference
    assert seen["degraded"]["degraded_pools"] == {"decode": "1 of 2 workers ready"}, seen
    assert seen["degraded"]["status"] == "degraded"
    assert "replaced_s" in seen, f"no ready replacement within {REPLACED_WITHIN_S} s: {seen}"
    until(lambda: settled(cluster, "decode", 2), 10, 0.2, "two ready decode workers again")
    (row,) = [w for w in status(cluster).workers if w.name == victim.name]
    assert row.restarts == 1 and row.worker_id != victim.worker_id and "SIGKILL" in row.detail
    assert metric(cluster.url, "splitserve_worker_restarts_total", pool="decode") == 1
    assert metric(cluster.url, "splitserve_pool_ready_workers", pool="decode") == 2
    assert metric(cluster.url, "splitserve_request_migrations_total", reason="worker_lost") >= 1
    log = cluster.log()
    assert f"{victim.name} killed by SIGKILL" in log and "restarting it in" in log
    # the dead worker left the pool once: no join/leave flapping while its lease ran out
    assert log.count(f"worker {victim.worker_id} left the pool") == 1, log[-3000:]
    assert log.count(f"worker {victim.worker_id} joined") == 1
    print(f"replacement ready {seen['replaced_s']:.1f} s after kill -9")

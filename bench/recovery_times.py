"""How long until a cluster is ready, and until a killed worker is replaced and ready again.

    python bench/recovery_times.py local [--load 0,32]     # serve, tiny model on the CPU, 1 prefill + 1 decode
    python bench/recovery_times.py ray [--load 0,24]       # serve --ray (a local Ray), mock engine, 1 decode

Starts the cluster as a user would (tests/integration/cluster.py: `splitserve serve` in a
subprocess) and records its start-to-ready time (launch to the ready banner and a healthy /health).
Then, for each worker kind and each load (0: idle; N: N concurrent greedy streams kept going), it
kills the worker with SIGKILL (`local`: the worker process; `ray`: its actor's process) and records
the time from the kill until `pools status` (the admin API) shows its pool at its size again, every
worker ready, the killed one replaced; it also counts failed streams. One JSON line per measurement
(git sha, device, host load average), as the docs' figures cite them (docs/operations.md, docs/ray.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proto.splitserve.v1 import admin_pb2, admin_pb2_grpc  # noqa: E402
from runtime.admin_auth import read_token_file  # noqa: E402
from splitserve.bench.records import git_sha  # noqa: E402
from tests.integration.cluster import start_cluster, until  # noqa: E402
from tests.integration.streams import prompts, stream_one  # noqa: E402

READY = admin_pb2.WORKER_STATE_READY


def record(**fields) -> None:
    print(json.dumps({"bench": "recovery_times", "git_sha": git_sha(), "device": f"cpu-{platform.machine()}",
                      "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2), **fields}), flush=True)


def status(cluster) -> admin_pb2.GetStatusResponse:
    with grpc.insecure_channel(cluster.admin_url) as ch:
        md = [("authorization", f"Bearer {read_token_file(cluster.admin_port)}")]
        return admin_pb2_grpc.AdminStub(ch).GetStatus(admin_pb2.GetStatusRequest(), metadata=md, timeout=10)


def replaced(cluster, pool: str, old_id: str) -> bool:
    st = status(cluster)
    p = next(p for p in st.pools if p.pool == pool)
    mine = [w for w in st.workers if w.pool == pool]
    return (p.ready == p.desired and len(mine) == p.desired and all(w.state == READY for w in mine)
            and old_id not in {w.worker_id for w in mine})


class Load:
    """N concurrent greedy streams, each started again when it ends, until `stop()`; counts failures."""

    def __init__(self, url: str, n: int) -> None:
        self.url, self.n, self.done, self.failed = url, n, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        if n:
            self._thread.start()

    async def _run(self) -> None:
        import httpx
        ps = prompts(self.n, seed=3, lengths=(100, 300))
        async with httpx.AsyncClient(timeout=180) as client:
            async def lane(i: int) -> None:
                while not self._stop.is_set():
                    s = await stream_one(client, self.url, ps[i], 48)
                    self.done += 1
                    self.failed += 0 if s.ok else 1
            await asyncio.gather(*(lane(i) for i in range(self.n)))

    def stop(self) -> None:
        self._stop.set()
        if self.n:
            self._thread.join(timeout=300)


def worker_pid(cluster, name: str, ray: bool) -> int:
    """The pid to kill: the worker process (`local`) or its Ray actor's process (`ray`), among this
    cluster's own processes only (other clusters on the machine run workers of the same names)."""
    from tests.integration.test_api_key import descendants
    for pid in map(str, descendants(cluster.proc.pid)):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if ray and cmd.rstrip().endswith(f"--worker-id {name}"):
            return int(stat.rsplit(")", 1)[1].split()[1])            # its parent: the actor
        if not ray and f"/{name}.json" in cmd and "--config" in cmd:
            return int(pid)
    raise RuntimeError(f"no process for {name}")


def kill_and_time(cluster, pool: str, load_n: int, ray: bool, timeout_s: float) -> None:
    def ready_one():
        return next((w for w in status(cluster).workers if w.pool == pool and w.state == READY), None)
    victim = until(ready_one, 60, 0.2, f"a ready {pool} worker in `pools status`")
    load = Load(cluster.url, load_n)
    try:
        if load_n:
            until(lambda: load.done >= load_n, 120, 0.2, "the load running")
        os.kill(worker_pid(cluster, victim.name, ray), signal.SIGKILL)
        t0 = time.monotonic()
        until(lambda: replaced(cluster, pool, victim.worker_id), timeout_s, 0.2, f"{victim.name} replaced")
        took = time.monotonic() - t0
    finally:
        load.stop()
    record(mode="ray" if ray else "local", what="kill -9 to replaced and ready", pool=pool, worker=victim.name,
           concurrent_streams=load_n, seconds=round(took, 1), streams_done=load.done, streams_failed=load.failed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("local", "ray"))
    ap.add_argument("--load", default="0,32", help="concurrent streams per kill, comma-separated (0: idle)")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    a = ap.parse_args()
    ray = a.mode == "ray"
    args = (["--ray", "--mock", "--prefill-workers", "0", "--decode-workers", "1", "--ray-local-cpus", "2",
             "--ray-worker-cpus", "0.5", "--ray-frontend-cpus", "0.5"] if ray
            else ["--model", "tiny", "--prefill-workers", "1", "--decode-workers", "1", "--remote-prefill-min-tokens", "1"])
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    t0 = time.monotonic()
    cluster = start_cluster(Path(tempfile.mkdtemp(prefix="recovery-")), *args, env=env)
    record(mode=a.mode, what="serve start to ready", args=" ".join(args), seconds=round(time.monotonic() - t0, 1))
    try:
        for pool in (["decode"] if ray else ["decode", "prefill"]):
            for n in (int(x) for x in a.load.split(",")):
                kill_and_time(cluster, pool, n, ray, a.timeout_s)
    finally:
        cluster.stop(90)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`splitserve serve` as a user runs it: ready within the limit, says where to connect, stops
cleanly on SIGTERM (exit 0, no process left behind), and takes its children down when killed."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import pytest

from runtime.redis_embedded import free_port

from .conftest import start_cluster, until
from .test_api_key import descendants

pytestmark = pytest.mark.slow

READY_WITHIN_S = 60.0      # on a 2-core CI machine the tiny model is ready in ~5-10 s


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"     # a zombie has exited
    except OSError:
        return False


def names(pids: list[int]) -> dict[int, str]:
    out = {}
    for pid in pids:
        try:
            out[pid] = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:200]
        except OSError:
            pass
    return out


def free_range(n: int) -> int:
    """The first of `n` consecutive free loopback ports (checked now; the test takes them at once)."""
    while True:
        base = free_port()
        if base + n > 65535:
            continue
        try:
            socks = [socket.create_server(("127.0.0.1", base + i)) for i in range(n)]
        except OSError:
            continue
        for s in socks:
            s.close()
        return base


def test_ready_in_time_prints_where_to_connect_and_sigterm_stops_everything(tmp_path):
    """Also on the ports it is given: the embedded Redis on --redis-port, each worker's gRPC and
    metrics ports from --worker-ports."""
    start = time.monotonic()
    redis_port, base = free_port(), free_range(4)
    c = start_cluster(tmp_path, "--model", "tiny", "--redis-port", str(redis_port), "--worker-ports",
                      f"{base}-{base + 3}")
    try:
        assert time.monotonic() - start < READY_WITHIN_S
        assert socket.create_connection(("127.0.0.1", redis_port), timeout=5)
        workers = json.loads(c.cli("workers", "list", "--json").stdout)
        ports = sorted(int(w["address"].rsplit(":", 1)[1]) for w in workers)
        assert len(ports) == 2 and all(base <= p <= base + 3 for p in ports), (ports, base)
        banner = until(lambda: "Splitserve is ready" in c.log() and c.log(), 10, what="the ready banner")
        assert f"http://127.0.0.1:{c.http_port}/v1" in banner
        assert f"127.0.0.1:{c.grpc_port}" in banner
        r = httpx.post(f"{c.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        kids = descendants(c.proc.pid)
        cmdlines = names(kids)
        assert any("redis-server" in v for v in cmdlines.values()), cmdlines
        assert any("frontend" in v for v in cmdlines.values()), cmdlines
        assert any("decode-worker" in v for v in cmdlines.values()), cmdlines
    except BaseException:
        c.stop()
        raise
    t0 = time.monotonic()
    assert c.stop(timeout_s=30) == 0, c.log()[-3000:]
    stop_s = time.monotonic() - t0
    left = [p for p in kids if alive(p)]
    assert not left, names(left)
    assert stop_s < 20, stop_s
    assert "Traceback" not in c.log(), c.log()[-3000:]


def test_sigkill_of_the_launcher_takes_its_children_down(tmp_path):
    c = start_cluster(tmp_path, "--model", "tiny")
    kids = descendants(c.proc.pid)
    try:
        assert len(kids) >= 3, names(kids)
        os.kill(c.proc.pid, signal.SIGKILL)
        c.proc.wait(timeout=10)
        until(lambda: not any(alive(p) for p in kids), 15, 0.1, "every child to exit after SIGKILL")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{c.url}/health", timeout=2)
    finally:
        for p in kids:          # never leave an orphan behind, even when the test fails
            if alive(p):
                os.kill(p, signal.SIGKILL)

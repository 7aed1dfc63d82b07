"""`splitserve serve` as a user runs it: ready within the limit, says where to connect, stops
cleanly on SIGTERM (exit 0, no process left behind), and takes its children down when killed."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

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


def test_ready_in_time_prints_where_to_connect_and_sigterm_stops_everything(tmp_path):
    start = time.monotonic()
    c = start_cluster(tmp_path, "--model", "tiny")
    try:
        assert time.monotonic() - start < READY_WITHIN_S
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

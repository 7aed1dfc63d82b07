"""Faults users meet, on a real `splitserve serve` (tiny model, CPU), under concurrent streams:

- kill -9 of the embedded Redis: serve starts a new one on its port; the workers re-register, the
  frontend's KV-event reader notices the new stream and resyncs, no request fails, and the log gets
  a few throttled warnings, not hundreds;
- kill -9 of the frontend: serve restarts it on its ports while the workers keep running;
- a burst of long prompts against prefill workers with a short lease: refused or timed-out remote
  prefills are computed locally and counted, never an ERROR or a traceback;
- SIGTERM to serve with open streams: short ones finish, the rest end with an error event, none is
  cut, and serve exits 0 with every child gone.

Token parity of drains and kill -9 of workers is in test_pools.py; the controller's restart and
crash-loop logic, fast, in test_controller.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest

from tests.integration.cluster import assert_clean_log, own_cluster, start_cluster, until
from tests.integration.streams import failures, prompts, stream_all
from tests.integration.test_api_key import descendants
from tests.integration.test_serve_lifecycle import alive

pytestmark = pytest.mark.slow

N = 24
PROMPTS = prompts(N, seed=3)
MAX_TOKENS = 24


def redis_port(pid: int) -> str:
    """redis-server names itself `redis-server 127.0.0.1:PORT`."""
    return re.search(r"127\.0\.0\.1:(\d+)", cmdline(pid)).group(1)


def cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two aggregated workers, serve's own embedded Redis (found among its children)."""
    c = start_cluster(tmp_path_factory.mktemp("faults"), "--prefill-workers", "0", "--decode-workers", "2",
                      "--drain-timeout-s", "3", "--lease-ttl-s", "2", min_workers=2)
    try:
        (redis_pid,) = [p for p in descendants(c.proc.pid) if "redis-server" in cmdline(p)]
        c.redis_url = f"redis://127.0.0.1:{redis_port(redis_pid)}/0"
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def reference(cluster) -> list[list[int]]:
    streams = asyncio.run(stream_all(cluster.url, PROMPTS, MAX_TOKENS))
    assert failures(streams, MAX_TOKENS) == []
    return [s.tokens for s in streams]


def cached_tokens(url: str, prompt: list[int]) -> int:
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_killed_redis_is_restarted_and_the_cluster_recovers_under_load(cluster, reference):
    (redis_pid,) = [p for p in descendants(cluster.proc.pid) if "redis-server" in cmdline(p)]
    port = redis_port(redis_pid)
    mark = len(cluster.log())

    async def kill_redis():
        await asyncio.sleep(0.5)
        os.kill(redis_pid, signal.SIGKILL)

    streams = asyncio.run(stream_all(cluster.url, PROMPTS, MAX_TOKENS, during=kill_redis))
    assert failures(streams, MAX_TOKENS) == [] and [s.tokens for s in streams] == reference
    until(lambda: f"the embedded Redis exited (killed by SIGKILL); starting a new one on port {port}"
          in cluster.log()[mark:], 10, what="serve to restart Redis")
    # the new server answers once serve says so (this test's own discovery reads need it up)
    until(lambda: f"Redis is back on port {port}" in cluster.log()[mark:], 10, what="the new Redis to listen")
    # the workers re-register in the new server, and the frontend's KV-event reader resyncs
    until(lambda: sorted(w.state for w in cluster.workers()) == ["ready", "ready"], 10, 0.2, "re-registration")
    until(lambda: "Redis restarted: reading KV events from the start of its new stream" in cluster.log()[mark:],
          10, what="the KV-event reader to notice the new stream")
    assert httpx.get(f"{cluster.url}/health").json()["status"] == "ok"
    # routing by prefix works on the new stream: a prompt's continuation lands where its prefix is cached
    for i, p in enumerate(prompts(4, seed=11, lengths=(96, 97))):
        cached_tokens(cluster.url, p)
        until(lambda: cached_tokens(cluster.url, p + [7, 8, 9]) >= 80, 10, 0.3, f"a prefix hit for prompt {i}")
    time.sleep(5)                # whatever the outage still causes, it shows up by now
    warnings = [line for line in cluster.log()[mark:].splitlines() if " WARNING " in line]
    assert len(warnings) <= 15, "\n".join(warnings)


def test_a_killed_frontend_is_restarted_while_the_workers_keep_running(cluster, reference):
    kids = {p: cmdline(p) for p in descendants(cluster.proc.pid)}
    (frontend,) = [p for p, cmd in kids.items() if "/frontend.json" in cmd]
    workers = sorted(p for p, cmd in kids.items() if "decode-worker" in cmd)
    os.kill(frontend, signal.SIGKILL)
    until(lambda: "the frontend killed by SIGKILL" in cluster.log(), 10, what="serve to notice")

    def healthy():
        try:
            return httpx.get(f"{cluster.url}/health", timeout=2).json()["decode"] == 2
        except (httpx.HTTPError, ValueError):
            return False
    until(healthy, 30, 0.2, "the restarted frontend to see both workers")
    streams = asyncio.run(stream_all(cluster.url, PROMPTS, MAX_TOKENS))
    assert failures(streams, MAX_TOKENS) == [] and [s.tokens for s in streams] == reference
    assert sorted(p for p in descendants(cluster.proc.pid) if "decode-worker" in cmdline(p)) == workers
    cluster.wait_idle()


def test_sigterm_with_open_streams_finishes_or_ends_each_with_an_error_event(cluster):
    """Short streams finish within the 3 s drain; long ones cannot, and end with an error event."""
    max_tokens = [16 if i % 2 else 1500 for i in range(N)]

    async def stop_serve():
        await asyncio.sleep(1.5)
        cluster.proc.send_signal(signal.SIGTERM)

    kids = descendants(cluster.proc.pid)
    t0 = time.monotonic()
    streams = asyncio.run(stream_all(cluster.url, PROMPTS, max_tokens, during=stop_serve))
    assert [(i, s) for i, s in enumerate(streams) if not s.ended_cleanly] == []      # none cut
    short = [s for s, m in zip(streams, max_tokens) if m == 16]
    assert all(s.ok and len(s.tokens) == 16 for s in short)
    long = [s for s, m in zip(streams, max_tokens) if m > 16]
    assert all(s.error and s.error["code"] == 503 and s.done for s in long), long[0]
    assert cluster.proc.wait(timeout=30) == 0
    assert time.monotonic() - t0 < 30
    until(lambda: not any(alive(p) for p in kids), 10, 0.1, "every child to exit")
    log = cluster.log()
    assert_clean_log(log)


def test_a_burst_of_long_prompts_on_short_prefill_leases_is_counted_not_an_error(tmp_path):
    """Most prompts outlive a 0.3 s lease: the prefill worker refuses them (once its pace is known) or
    answers DEADLINE_EXCEEDED, the decode worker computes them, and both sides count it."""
    pytest.importorskip("nixl")
    with own_cluster("--prefill-workers", "1", "--decode-workers", "1", "--remote-prefill-min-tokens", "1",
                     "--max-num-batched-tokens", "64", "--prefill-lease-s", "0.3", tmp_dir=tmp_path) as c:
        burst = prompts(16, seed=5, lengths=(400, 700))
        streams = asyncio.run(stream_all(c.url, burst, 4))
        assert failures(streams, 4) == []
        text = httpx.get(f"{c.url}/metrics", timeout=10).text

        def total(name: str, label: str = "") -> float:
            return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*{label}[^}}]*}} (\S+)$", text, re.M))
        timeouts, refused = total("splitserve_prefill_timeouts_total"), total("splitserve_prefill_refused_total")
        assert timeouts + refused >= 1, text
        fallbacks = total("splitserve_prefill_fallback_total")
        assert total("splitserve_prefill_fallback_total", 'reason="timeout"') + \
            total("splitserve_prefill_fallback_total", 'reason="saturated"') == fallbacks >= 1
    log = c.log()
    assert_clean_log(log, also=("Unexpected",))

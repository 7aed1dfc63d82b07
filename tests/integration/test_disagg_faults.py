"""Disaggregated serving survives kill -9 of any worker while it works: every request completes with
the tokens one aggregated worker gives, the dead worker is replaced under its name, and the pools
return to idle. Real processes, Redis, gRPC and NIXL transfers (UCX over host memory)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

pytest.importorskip("nixl")

from tests.integration.cluster import metric, own_cluster, until  # noqa: E402
from tests.integration.streams import complete_all  # noqa: E402

pytestmark = pytest.mark.slow


def fault_prompts(n: int = 50, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(rng.randrange(40, 200))] for _ in range(n)]


@pytest.fixture(scope="module")
def fault_reference() -> list[list[int]]:
    with own_cluster("--prefill-workers", "0") as c:
        return asyncio.run(complete_all(c.url, fault_prompts(), 24))


@pytest.mark.parametrize("victim", ["prefill-worker", "decode-worker"])
def test_kill_worker_under_load(fault_reference, victim):
    with own_cluster("--prefill-workers", "2", "--decode-workers", "2", "--remote-prefill-min-tokens", "1",
                     "--max-num-batched-tokens", "256", "--lease-ttl-s", "2") as c:
        name = "prefill-0" if victim == "prefill-worker" else "decode-0"
        (pid,) = c.child_pids(f"/{name}.json")      # serve runs it with --config DIR/NAME.json
        (info,) = [w for w in c.workers() if w.worker_id.startswith(name + "-")]

        def busy() -> bool:
            return any(s.worker_id == info.worker_id and s.num_running > 0 for s in c.worker_status())

        async def kill_soon():
            # kill it while it is working on requests, not before or after
            deadline = time.monotonic() + 30
            while not await asyncio.to_thread(busy):
                assert time.monotonic() < deadline, "the victim never got work"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
            os.kill(pid, signal.SIGKILL)

        got = asyncio.run(complete_all(c.url, fault_prompts(), 24, during=kill_soon))
        assert got == fault_reference
        # the dead worker leaves the pool when its lease expires, serve starts a replacement under its
        # name, and every worker returns to idle
        deadline = time.monotonic() + 15
        while info.worker_id in {w.worker_id for w in c.workers()} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert info.worker_id not in {w.worker_id for w in c.workers()}
        until(lambda: sorted(w.name for w in c.workers() if w.ready) == ["decode-0", "decode-1", "prefill-0",
                                                                         "prefill-1"], 60, 0.2, "a replacement")
        statuses = c.wait_idle()
        assert all(s.num_free_blocks == s.num_total_blocks for s in statuses)
        if victim == "decode-worker":
            assert metric(c.url, "splitserve_request_migrations_total") >= 1
        else:   # the decode side's handoffs to the dead worker fell back to local prefill
            assert metric(c.url, "splitserve_prefill_fallback_total") >= 1

"""The GPU allocator and the local connector's placement: each worker its own GPUs (all of a
tensor-parallel worker's distinct), shares only when asked, freed when the worker is gone for good,
and a start that does not fit refused with what is free."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from pools.book import PoolName
from pools.connector import ConnectorError, HandleState
from pools.gpus import GpuAllocator, NoGpus, Placement, plan_fits
from pools.local_connector import LocalProcessConnector
from pools.restarts import RestartPolicy

D, P = PoolName.DECODE, PoolName.PREFILL


def test_whole_gpus_are_never_shared_and_a_tp_worker_gets_distinct_ones():
    a = GpuAllocator([0, 1, 2, 3])
    assert a.allocate(1).gpus == (0,)
    tp2 = a.allocate(2)
    assert tp2.gpus == (1, 2) and tp2.visible_devices == "1,2"
    assert a.allocate(1).gpus == (3,)
    with pytest.raises(NoGpus, match=r"a worker needs 1 GPU; 0 of the 4 GPUs in the inventory \(0,1,2,3\) have "
                                     r"that free \(free capacity on none\)"):
        a.allocate(1)
    a.release(tp2)
    assert a.allocate(2).gpus == (1, 2)


def test_fractions_share_a_gpu_and_fill_the_fullest_first():
    """Two half-GPU workers land on one GPU, leaving the other whole for a worker that needs it."""
    a = GpuAllocator([0, 1])
    assert a.allocate(1, 0.5).gpus == (0,)
    assert a.allocate(1, 0.5).gpus == (0,)
    assert a.allocate(1).gpus == (1,)
    with pytest.raises(NoGpus, match=r"needs 1 GPU \(0.5 of each\)"):
        a.allocate(1, 0.5)


def test_bad_requests_are_errors():
    with pytest.raises(ValueError, match="listed twice"):
        GpuAllocator([0, 0])
    with pytest.raises(ValueError):
        GpuAllocator([0]).allocate(0)
    with pytest.raises(ValueError):
        GpuAllocator([0]).allocate(1, 1.5)


def test_an_oversubscribed_plan_names_what_it_needs_and_what_there_is():
    plan_fits([0, 1, 2, 3], [(1, 1), (1, 2)], 1.0)
    with pytest.raises(NoGpus, match=r"the workers need 5 GPUs \(1 x 1 \+ 2 x 2\); the inventory holds 4 \(0,1,2,3\)"):
        plan_fits([0, 1, 2, 3], [(1, 1), (2, 2)], 1.0)
    with pytest.raises(NoGpus, match=r"need 1.5 GPUs \(3 x 1 at 0.5 of a GPU each\); the inventory holds 1 \(7\)"):
        plan_fits([7], [(0, 1), (3, 1)], 0.5)


def _connector(code: str, placement: Placement, **kw) -> tuple[LocalProcessConnector, list]:
    spawned = []

    def spawn(pool, name, gpus):
        spawned.append((name, gpus.visible_devices if gpus else None))
        return subprocess.Popen([sys.executable, "-c", code])
    return LocalProcessConnector(spawn, {D: "decode", P: "prefill"}, placement=placement, **kw), spawned


def test_the_connector_gives_each_worker_its_gpus_and_takes_them_back_when_it_leaves():
    placement = Placement(GpuAllocator([0, 1, 2]), {D: 2, P: 1})
    c, spawned = _connector("import time; time.sleep(60)", placement)

    async def go():
        d = await c.start(D)
        p = await c.start(P)
        assert (d.gpus, p.gpus) == ("0,1", "2") and spawned == [("decode-0", "0,1"), ("prefill-0", "2")]
        with pytest.raises(ConnectorError, match="cannot start another prefill worker: a worker needs 1 GPU; 0 of the 3"):
            await c.start(P)
        await c.stop("decode-0")                      # killed on request: gone, its GPUs free again
        c._slots["decode-0"].proc.wait()
        await c.refresh()
        assert [h.name for h in c.list()] == ["prefill-0"]
        assert (await c.start(D)).gpus == "0,1"
        c.kill_all()
    asyncio.run(go())


def test_a_crashed_worker_keeps_its_gpus_for_its_restart_and_a_failed_one_frees_them():
    now = [0.0]
    placement = Placement(GpuAllocator([0]), {D: 1, P: 1})
    c, spawned = _connector("raise SystemExit(1)", placement,
                            policy=RestartPolicy(backoff_s=1.0, crash_loop_restarts=1), clock=lambda: now[0])

    async def crash(at: float) -> None:
        now[0] = at
        c._slots["decode-0"].proc.wait()
        await c.refresh()

    async def go():
        await c.start(D)
        await crash(2.0)
        assert c.list()[0].state == HandleState.BACKOFF and placement.allocator.free(0) == 0.0
        now[0] = 3.0
        await c.refresh()                             # restarted, on the same GPU
        assert spawned == [("decode-0", "0"), ("decode-0", "0")]
        await crash(3.5)
        assert c.list()[0].state == HandleState.FAILED and placement.allocator.free(0) == 1.0
    asyncio.run(go())

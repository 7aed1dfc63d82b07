"""The pool controller's decision core (pools/book.py) and the restart policy (pools/restarts.py):
desired sizes within limits, overrides held and released, what to start and what to drain, and when
a crashing worker stops being restarted (and what the local-process connector makes of that: its
workers here are real processes that exit at once, its clock a variable)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from pools.connector import HandleState
from pools.local_connector import LocalProcessConnector
from pools.book import Drain, PoolBook, PoolName, PoolSpec, Start, Stop, WorkerView
from pools.restarts import CrashHistory, RestartPolicy
from runtime.errors import InvalidRequest, NotFound
from runtime.lifecycle import WorkerState as S

D, P = PoolName.DECODE, PoolName.PREFILL


def book(decode=2, prefill=1) -> PoolBook:
    return PoolBook({D: PoolSpec(decode, 1, 4), P: PoolSpec(prefill, 0, 3)})


def w(name, pool=D, state=S.READY, load=0, age=100.0, managed=True) -> WorkerView:
    return WorkerView(name, pool, state, load, age, managed)


def test_missing_workers_are_started_and_surplus_ones_drained_least_loaded_youngest_first():
    b = book()
    assert b.plan([]) == [Start(D), Start(D), Start(P)]
    assert b.plan([w("d0"), w("d1"), w("p0", P)]) == []
    b.scale({"decode": 1})
    assert b.plan([w("d0", load=5), w("d1", load=2, age=10), w("d2", load=2, age=50), w("p0", P)]) == \
        [Drain("d1"), Drain("d2")]


def test_failed_then_starting_workers_go_first_and_failed_ones_are_removed_not_drained():
    b = book()
    b.scale({"decode": 1})
    views = [w("d0", load=0), w("d1", state=S.STARTING), w("d2", state=S.FAILED), w("p0", P)]
    assert b.plan(views) == [Stop("d2"), Drain("d1")]


def test_draining_workers_count_for_nothing_and_failed_ones_hold_their_place():
    b = book()
    assert b.plan([w("d0"), w("d1", state=S.DRAINING), w("p0", P)]) == [Start(D)]     # replaced
    assert b.plan([w("d0"), w("d1", state=S.FAILED), w("p0", P)]) == []              # not replaced (crash loop)
    assert b.plan([w("d0"), w("x", managed=False), w("p0", P)]) == [Start(D)]         # not ours: not counted


def test_an_override_wins_until_released_and_the_planner_moves_the_target():
    b = book()
    b.scale({"decode": 3})
    b.set_target("decode", 1, "load fell")
    assert b.spec("decode").desired == 3
    b.release(["decode"])
    assert b.spec("decode").desired == 1 and b.spec("decode").last_decision == "load fell"
    b.set_target("decode", 99)
    assert b.spec("decode").desired == 4            # within max


def test_sizes_outside_the_limits_are_refused_with_the_way_out_and_nothing_changes():
    b = book()
    with pytest.raises(InvalidRequest, match=r"5 decode workers is above the decode pool's max of 4 \(raise it "
                                             r"first: splitserve pools limits --decode-max N\)"):
        b.scale({"prefill": 2, "decode": 5})
    assert b.spec("prefill").override is None        # all or nothing
    with pytest.raises(InvalidRequest, match="below the decode pool's min of 1"):
        b.scale({"decode": 0})
    with pytest.raises(NotFound):
        b.scale({"gpu": 1})


def test_limits_are_bounded_and_keep_an_override_inside_them():
    b = book()
    b.set_limits("decode", 0, 6)
    b.scale({"decode": 6})
    with pytest.raises(InvalidRequest, match="held at 6 by an override"):
        b.set_limits("decode", max_=5)
    for lo, hi in ((3, 2), (-1, 2), (0, 10_000)):
        with pytest.raises(InvalidRequest, match="0 <= min <= max"):
            b.set_limits("prefill", lo, hi)
    b.release()
    assert b.set_limits("decode", 3, 5).min == 3 and b.spec("decode").desired == 3


def test_a_fixed_pool_says_why_it_cannot_change():
    b = PoolBook({D: PoolSpec(1, 1, 4), P: PoolSpec(0, 0, 0, fixed="aggregated serving")})
    with pytest.raises(InvalidRequest, match="cannot be scaled: aggregated serving"):
        b.scale({"prefill": 1})
    with pytest.raises(InvalidRequest, match="limits cannot change: aggregated serving"):
        b.set_limits("prefill", max_=2)
    b.scale({"prefill": 0, "decode": 2})


def test_restarts_back_off_and_a_crash_loop_stops_them():
    h = CrashHistory(RestartPolicy(backoff_s=1.0, max_backoff_s=5.0, crash_loop_restarts=4, stable_after_s=60))
    assert [h.crashed(2.0) for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, None]
    assert h.restarts == 4


def test_a_worker_that_ran_stably_before_crashing_starts_the_count_again():
    h = CrashHistory(RestartPolicy(backoff_s=1.0, crash_loop_restarts=2, stable_after_s=60))
    assert h.crashed(1.0) == 1.0 and h.crashed(1.0) == 2.0
    assert h.crashed(3600.0) == 1.0                 # a day-long run, then a crash: promptly restarted
    assert h.crashed(1.0) == 2.0 and h.crashed(1.0) is None


def test_a_connector_backs_off_a_crashed_worker_then_leaves_a_crash_loop_failed(caplog):
    now = [0.0]
    loops = []
    spawn = lambda pool, name, gpus: subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])   # noqa: E731
    c = LocalProcessConnector(spawn, {D: "decode", P: "prefill"}, RestartPolicy(backoff_s=1.0, crash_loop_restarts=1),
                              on_crash_loop=loops.append, clock=lambda: now[0])

    def crash(at: float) -> None:
        now[0] = at
        c._slots["decode-0"].proc.wait()
        asyncio.run(c.refresh())

    asyncio.run(c.start(D))
    crash(2.0)
    [h] = c.list()
    assert h.state == HandleState.BACKOFF and h.detail == "exit code 3 after 2.0 s" and h.restarts == 1
    assert "decode-0 exit code 3 after 2.0 s; restarting it in 1.0 s (restart 1)" in caplog.text
    now[0] = 3.0
    asyncio.run(c.refresh())                         # the backoff is over: launched again
    assert c.list()[0].state == HandleState.RUNNING
    crash(4.5)
    [h] = c.list()
    assert h.state == HandleState.FAILED and loops == [D]
    assert h.detail == "crash loop: 2 crashes in a row, the last exit code 3 after 1.5 s"
    assert ("decode-0 keeps crashing (crash loop: 2 crashes in a row, the last exit code 3 after 1.5 s); not "
            "restarting it. See its log above; `splitserve workers drain decode-0` clears it") in caplog.text


def test_a_crash_while_restarts_are_off_fails_the_worker_at_once_and_quietly(caplog):
    spawn = lambda pool, name, gpus: subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])   # noqa: E731
    c = LocalProcessConnector(spawn, {D: "decode", P: "prefill"}, clock=lambda: 0.5)
    c.restart_crashed = False                        # serve's start-up: a crash means a bad model or flag
    asyncio.run(c.start(D))
    c._slots["decode-0"].proc.wait()
    asyncio.run(c.refresh())
    [h] = c.failed()
    assert h.detail == "exit code 1 after 0.0 s" and h.restarts == 0
    assert "decode-0" not in caplog.text             # serve reports it, not the connector


def test_a_negative_size_is_refused_as_such_not_as_below_the_min():
    b = PoolBook({D: PoolSpec(1, 1, 4), P: PoolSpec(1, 0, 4)})
    for n in (-1, 10_000):
        with pytest.raises(InvalidRequest, match=f"number of workers from 0 to 256 \\(got {n} for the decode"):
            b.scale({"decode": n, "prefill": 2})
    assert b.spec("prefill").override is None          # all or nothing

"""runtime/process.py: a stuck clean-up step is left behind with where it is stuck; kill -USR1
prints a process's stacks; die_with_parent works in a child of a threaded parent; a signal that
lands while a component's event loop closes is not a fault in the log."""

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from runtime.process import awaiting, bounded, die_with_parent


async def _stuck_inner(gate: asyncio.Event) -> None:
    await gate.wait()


async def _stuck_outer(gate: asyncio.Event) -> None:
    await _stuck_inner(gate)


def test_bounded_leaves_a_stuck_step_and_names_where_it_waits(caplog):
    async def go():
        gate = asyncio.Event()
        t0 = time.monotonic()
        ok = await bounded("closing the thing", _stuck_outer(gate), 0.2)
        took = time.monotonic() - t0
        gate.set()
        finished = await bounded("closing the thing again", _stuck_outer(gate), 1.0)
        return ok, took, finished
    with caplog.at_level(logging.WARNING, logger="runtime.process"):
        ok, took, finished = asyncio.run(go())
    assert ok is False and 0.2 <= took < 1.0 and finished is True
    text = caplog.text
    assert "closing the thing did not finish within 0 s" in text
    assert "_stuck_outer -> " in text and "_stuck_inner" in text and "test_process.py:" in text


def test_bounded_reports_a_failed_step_without_raising(caplog):
    async def boom():
        raise RuntimeError("no such channel")
    with caplog.at_level(logging.WARNING, logger="runtime.process"):
        assert asyncio.run(bounded("closing the channel", boom(), 1.0)) is True
    assert "closing the channel failed: RuntimeError('no such channel')" in caplog.text


def test_awaiting_follows_the_chain_of_awaits():
    async def go():
        gate = asyncio.Event()
        task = asyncio.create_task(_stuck_outer(gate))
        await asyncio.sleep(0.01)
        where = awaiting(task)
        gate.set()
        await task
        return where
    where = asyncio.run(go())
    assert where.index("_stuck_outer") < where.index("_stuck_inner") < where.index(" wait")


def test_sigusr1_prints_every_threads_stack():
    code = ("import threading, time\n"
            "from runtime.process import enable_stack_dumps\n"
            "enable_stack_dumps()\n"
            "def parked_helper():\n    time.sleep(30)\n"
            "threading.Thread(target=parked_helper, daemon=True).start()\n"
            "print('ready', flush=True)\n"
            "time.sleep(30)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
    finally:
        p.kill()
    err = p.stderr.read()
    assert "parked_helper" in err and "Thread 0x" in err, err


def test_die_with_parent_in_a_child_of_a_threaded_parent():
    """The child gets SIGTERM when its parent dies, and the fork from a parent with busy threads
    does not hang (the prctl symbol was resolved before the fork)."""
    stop = threading.Event()
    threads = [threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        middle = ("import subprocess, sys, time\n"
                  "from runtime.process import die_with_parent\n"
                  "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], preexec_fn=die_with_parent)\n"
                  "print(c.pid, flush=True)\n"
                  "time.sleep(60)\n")
        m = subprocess.Popen([sys.executable, "-c", middle], stdout=subprocess.PIPE, text=True)
        child = int(m.stdout.readline())
        m.kill()
        m.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            raise AssertionError("the grandchild outlived its parent")
    finally:
        stop.set()


# A component whose loop closes while a SIGTERM lands: the hook sends the signal right after the
# loop closed its wake-up socket and before asyncio removes its handlers (the window a pool
# controller's SIGTERM hit when a worker was already stopping after a drain).
_LATE_SIGNAL = """
import asyncio, os, signal, sys
from runtime.process import install_stop_handlers, run_component

async def main():
    install_stop_handlers(asyncio.Event())
    loop = asyncio.get_running_loop()
    close_pipe = loop._close_self_pipe
    def close_then_signal():
        close_pipe()
        os.kill(os.getpid(), signal.SIGTERM)
    loop._close_self_pipe = close_then_signal
    return 0

runner = run_component if sys.argv[1] == "run_component" else asyncio.run
sys.exit(runner(main()))
"""


def _late_signal(runner: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _LATE_SIGNAL, runner], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_a_signal_while_the_loop_closes_is_quiet():
    bare = _late_signal("asyncio.run")
    assert "Bad file descriptor" in bare.stderr, (bare.returncode, bare.stderr)   # the fault, reproduced
    r = _late_signal("run_component")
    assert r.returncode == 0 and r.stderr == "", (r.returncode, r.stderr)

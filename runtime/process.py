"""Process hygiene shared by every component: die with the parent, stop cleanly on signals, and
never let a stuck clean-up step hold a shutdown up (`bounded`, which says where it was stuck)."""

from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
T = TypeVar("T")


def _has_prctl() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl is not None
    except (OSError, AttributeError):
        return False


_HAS_PRCTL = _has_prctl()

# Runs as `python -I -S -c _TRAMPOLINE PARENT_PID ARGV...`: takes SIGTERM's default action back (a
# launcher may have left it ignored, and an ignored signal stays ignored across exec: nohup, some CI
# runners), asks for SIGTERM when the parent dies, checks the parent did not die first (then it was
# re-parented: end as that signal would have), and becomes ARGV (exec keeps the request).
_TRAMPOLINE = f"""import ctypes, os, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_DFL)
ctypes.CDLL(None, use_errno=True).prctl({PR_SET_PDEATHSIG}, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):
    os.kill(os.getpid(), signal.SIGTERM)
os.execv(sys.argv[2], sys.argv[2:])
"""


def with_parent_death(argv: list[str]) -> list[str]:
    """The command line that runs `argv` (its first item a path) so that it gets SIGTERM when this
    process dies, even by kill -9: no orphans (Linux; elsewhere `argv` itself).

    Not a `preexec_fn`: that makes subprocess fork() and run the libraries' at-fork handlers in
    the child, and gRPC's restart its poller threads there; `close_fds` then closed their epoll fd
    under them and the child died before its exec ("epoll_wait error: Bad file descriptor", seen
    starting the embedded Redis from a process serving gRPC). A short Python trampoline sets the
    signal after a clean spawn instead (about 20 ms)."""
    if not _HAS_PRCTL:
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), *argv]


def enable_stack_dumps() -> None:
    """`kill -USR1 PID` prints every thread's stack to stderr (the component's log): what a
    process that seems stuck is doing, with no debugger and no restart."""
    if not hasattr(signal, "SIGUSR1"):
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (AttributeError, ValueError, OSError):     # no stderr file descriptor (embedded, closed)
        pass


def awaiting(task: asyncio.Task) -> str:
    """Where a task is suspended: its chain of awaits, outermost first (file:line function). A
    future that is not a task (a gather's) has no coroutine: its repr."""
    get_coro = getattr(task, "get_coro", None)
    if get_coro is None:
        return repr(task)
    steps, coro = [], get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            steps.append(type(coro).__name__)
            break
        steps.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " -> ".join(steps)


async def bounded(what: str, aw, timeout_s: float) -> bool:
    """Await `aw` for at most `timeout_s`; past that, log what it and every other task are waiting
    on, leave it running and return False. For clean-up steps whose hang must not stop the rest."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if done:
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s failed: %r", what, task.exception())
        return True
    others = [t for t in asyncio.all_tasks() if t is not task and t is not asyncio.current_task() and not t.done()]
    log.warning("%s did not finish within %.0f s; going on without it. It waits at %s%s", what, timeout_s,
                awaiting(task), "".join(f"\n  task {t.get_name()}: {awaiting(t)}" for t in others))
    return False


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere 0.0)."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def install_stop_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


def install_signal_events(first: asyncio.Event, second: asyncio.Event) -> None:
    """SIGINT/SIGTERM set `first` (stop gracefully); another one after it sets `second` (stop now)."""
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        (second if first.is_set() else first).set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)


def run_component(main: Coroutine[Any, Any, T], loop_factory=None) -> T:
    """`asyncio.run(main)`, with SIGINT/SIGTERM taken off the loop before it closes.

    The loop closes its signal wake-up socket before it removes its handlers. A signal that lands
    in between (a pool controller's SIGTERM to a worker already stopping after its drain, or the
    parent-death signal) printed "Exception ignored ... Bad file descriptor" into the log. Once
    `main` has returned, the process is past its clean-up: a late SIGINT/SIGTERM is ignored and the
    process exits on its own (SIGKILL still ends it). `loop_factory`: another event loop (uvloop's)."""
    async def guarded() -> T:
        try:
            return await main
        finally:
            quiet_late_signals()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(guarded())


def quiet_late_signals() -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)       # also drops the wake-up fd once none is left
        signal.signal(sig, signal.SIG_IGN)

"""Process hygiene shared by every component: die with the parent, stop cleanly on signals."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """On Linux, get SIGTERM when the launching process dies (even by kill -9): no orphans."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass


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

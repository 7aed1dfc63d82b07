"""When to restart a crashed process, and when to stop trying: backoff and crash-loop detection.

A crash is an exit nobody asked for. The n-th crash in a row is restarted after `backoff_s * 2**(n-1)`
(capped at `max_backoff_s`); a process that ran `stable_after_s` before crashing starts the count
again, so a worker killed once a day is always restarted promptly. After `crash_loop_restarts`
restarts in a row the next crash is a crash loop: no more restarts; the caller reports it.
`CrashHistory` is pure (the caller passes the uptime); used for workers and for `serve`'s frontend.
`record_crash` is what a connector does with a worker's crash (pools/local_connector.py,
pools/ray_connector.py): one place that decides backoff or failed and says so in the same words.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from pools.connector import HandleState


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    crash_loop_restarts: int = 5
    stable_after_s: float = 60.0


@dataclass(slots=True)
class CrashHistory:
    policy: RestartPolicy
    in_a_row: int = 0            # crashes since the last stable run
    restarts: int = 0            # every restart so far

    def crashed(self, uptime_s: float) -> float | None:
        """A crash after `uptime_s` of running: the delay before restarting, or None (crash loop)."""
        if uptime_s >= self.policy.stable_after_s:
            self.in_a_row = 0
        self.in_a_row += 1
        if self.in_a_row > self.policy.crash_loop_restarts:
            return None
        self.restarts += 1
        return min(self.policy.backoff_s * 2 ** (self.in_a_row - 1), self.policy.max_backoff_s)


def record_crash(slot: Any, why: str, now: float, restart: bool, log: logging.Logger,
                 on_crash_loop: Callable[[Any], None] | None, restarting: str, hint: str = "") -> None:
    """A connector's worker `slot` exited unasked (`why`, e.g. "exit code 1", at monotonic `now`).

    It goes to BACKOFF until `slot.restart_at`, or to FAILED: at once while `restart` is off (serve's
    start-up, where a crash means a bad model or flag), or as a crash loop, which is logged as an
    ERROR and passed to `on_crash_loop(pool)`. `slot` is the connector's own record of the worker:
    name, pool, history (CrashHistory), state, launched_at, restart_at and detail. The connector's
    `log` and words keep its lines its own: `restarting` says how it restarts ("restarting it"),
    `hint` where to look before clearing a crash loop.
    """
    uptime = now - slot.launched_at
    slot.detail = f"{why} after {uptime:.1f} s"
    delay = slot.history.crashed(uptime) if restart else None
    if delay is None:
        slot.state = HandleState.FAILED
        if restart:
            slot.detail = f"crash loop: {slot.history.in_a_row} crashes in a row, the last {slot.detail}"
            log.error(f"%s keeps crashing (%s); not restarting it. {hint}`splitserve workers drain %s` clears it",
                      slot.name, slot.detail, slot.name)
            if on_crash_loop:
                on_crash_loop(slot.pool)
        return
    log.warning(f"%s %s; {restarting} in %.1f s (restart %d)", slot.name, slot.detail, delay, slot.history.restarts)
    slot.state, slot.restart_at = HandleState.BACKOFF, now + delay

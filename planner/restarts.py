"""When to restart a crashed process, and when to stop trying: backoff and crash-loop detection.

A crash is an exit nobody asked for. The n-th crash in a row is restarted after `backoff_s * 2**(n-1)`
(capped at `max_backoff_s`); a process that ran `stable_after_s` before crashing starts the count
again, so a worker killed once a day is always restarted promptly. After `crash_loop_restarts`
restarts in a row the next crash is a crash loop: no more restarts; the caller reports it. Pure:
the caller passes the uptime; used for workers (planner/local_connector.py) and for `serve`'s
frontend.
"""

from __future__ import annotations

from dataclasses import dataclass


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

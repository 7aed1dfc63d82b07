"""Logging set up once per process, with the component name in every line."""

from __future__ import annotations

import logging
import os
import sys
import time

_configured = False
_component = ""


def component_name() -> str:
    """The component named in this process's log lines ("" before `setup_logging`)."""
    return _component


def setup_logging(component: str, level: str | None = None) -> None:
    global _configured, _component
    if _configured:
        return
    _configured, _component = True, component
    level = (level or os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {component}[%(process)d] %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class Throttled:
    """Warnings that repeat while a peer is down, one line per `interval_s` per kind at most.

    The first occurrence of a kind is logged at once; later ones within the interval are counted,
    and the next line that gets through says how many were held back. A Redis outage thus costs a
    few lines a minute, not one per retry (the embedded Redis's restart once logged 207 a minute).
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 30.0) -> None:
        self._log, self._interval_s = logger, interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args) -> None:
        self.log(logging.WARNING, kind, msg, *args)

    def info(self, kind: str, msg: str, *args) -> None:
        self.log(logging.INFO, kind, msg, *args)

    def log(self, level: int, kind: str, msg: str, *args) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        if held:
            msg += f" ({held} more like this in the last {now - last:.0f} s)"
        self._log.log(level, msg, *args)

    def clear(self, kind: str) -> None:
        """The condition is over: its next occurrence is logged at once."""
        self._last.pop(kind, None)
        self._held.pop(kind, None)

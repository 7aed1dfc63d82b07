"""Logging set up once per process, with the component name in every line."""

from __future__ import annotations

import logging
import os
import sys

_configured = False


def setup_logging(component: str, level: str | None = None) -> None:
    global _configured
    if _configured:
        return
    _configured = True
    level = (level or os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {component}[%(process)d] %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

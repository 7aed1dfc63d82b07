"""Loopback ports for the processes this host starts (the embedded Redis, a tensor-parallel
worker's process-group store, benches and tests)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port free now (the caller binds it a moment later: another process may take it
    meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

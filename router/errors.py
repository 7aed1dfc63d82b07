"""The router's exceptions: bad requests from callers, not bugs of the router itself.

Callers (the frontend) map these to gRPC status / HTTP codes in one place.
"""

from __future__ import annotations


class RouterError(Exception):
    """Base of every error the router raises on bad input or an empty pool."""


class NoWorkerAvailable(RouterError):
    """No registered worker can take a request of this role (all absent or excluded)."""


class UnknownWorker(RouterError):
    """A call named a worker the router does not know."""


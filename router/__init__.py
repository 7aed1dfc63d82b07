"""KV-aware router: prefix index fed by KV events, cost function, worker selection."""

from router.config import LOWER_TIER_WEIGHT, RouterConfig, RoutingPolicy, WorkerRole
from router.errors import NoWorkerAvailable, RouterError, UnknownWorker
from router.index import ApplyResult, PrefixIndex
from router.router import RouteDecision, Router

__all__ = ["LOWER_TIER_WEIGHT", "ApplyResult", "NoWorkerAvailable", "PrefixIndex", "RouteDecision", "Router",
           "RouterConfig", "RouterError", "RoutingPolicy", "UnknownWorker",
           "WorkerRole"]

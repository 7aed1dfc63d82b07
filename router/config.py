"""The router's configuration and the small enums its API speaks.

Plain data only; what the router does with it lives in selection.py, index.py and router.py. The
policy names and the lower-tier weight's default are the frontend's settings, declared once in
runtime/config.py (its flags choose among them) and used here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvstore.events import Tier
from perf.profile import StepTiming
from runtime.config import LOWER_TIER_WEIGHT, RoutingPolicy


class WorkerRole(Enum):
    """What a worker does. A DECODE worker prefills locally when it is not sent a prefill worker."""
    DECODE = "decode"
    PREFILL = "prefill"
    AGGREGATED = "aggregated"

    # Members are singletons that compare by identity, so identity can hash them: Enum's own
    # __hash__ is a Python-level call, and the router looks a role up on every decision.
    __hash__ = object.__hash__


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: RoutingPolicy = RoutingPolicy.KV
    timing: StepTiming | None = None   # KV: the workers' step-time profile (None: the default curve)
    chunk_tokens: int = 2048           # KV: the workers' max_num_batched_tokens (prefill chunk)
    max_session_keys: int = 65_536     # KV: routing-hint keys whose pin is remembered
    busy_period_weight: bool = True    # KV: weigh prefill seconds by 1/(1 - utilisation) (router.py)
    use_hints: bool = True             # KV: honour routing hints (prompt_cache_key / user)
    decode_delay: bool = True          # KV: count the delay a prefill imposes on a worker's decodes
    overlap_weight: float = 1.0        # KV_BLOCKS: cost per prompt block still to prefill
    temperature: float = 0.0           # 0 = pick the cheapest; >0 = softmax over -cost/normaliser
    approximate: bool = False          # no KV events: assume routed prompts stay cached for a while
    approx_ttl_s: float = 120.0
    gap_max_buffered: int = 64         # early batches held while waiting for a missing one ...
    gap_timeout_s: float = 1.0         # ... or for this long, before the worker needs a resync
    tiers: tuple[Tier, ...] = (Tier.GPU,)   # tiers whose blocks count as cached
    lower_tier_weight: float = LOWER_TIER_WEIGHT   # blocks only on a slower tier count this fraction of a hit

    def __post_init__(self) -> None:
        if self.overlap_weight < 0 or self.temperature < 0 or not 0 <= self.lower_tier_weight <= 1:
            raise ValueError(f"bad router config: {self}")
        if self.chunk_tokens < 1 or self.max_session_keys < 1:
            raise ValueError(f"bad router config: {self}")
        if self.gap_max_buffered < 1 or self.gap_timeout_s <= 0 or self.approx_ttl_s <= 0:
            raise ValueError(f"bad router config: {self}")
        if not self.tiers:
            raise ValueError("router config needs at least one tier")

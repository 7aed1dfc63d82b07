"""Worker selection: a pure function of candidates, prefix overlaps and loads (plus a seeded RNG).

The KV policy's cost (Dynamo's formula) is

    cost(w) = overlap_weight * (prompt blocks w would still have to prefill) + load(w)

where load is a decode worker's active KV blocks or a prefill worker's queued prefill blocks.
The cheapest worker wins, ties broken at random; with ``temperature > 0`` the pick is sampled
from softmax(-cost / (max cost * temperature)), which spreads load among near-equal workers.
The other policies ignore the cache and exist as baselines.

It knows nothing of how overlaps or loads are measured.
"""

from __future__ import annotations

import math
import random
from typing import Mapping, Sequence

from router.config import RouterConfig, RoutingPolicy

_TIE_EPS = 1e-9


class Selector:
    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self._config = config
        self._rng = rng
        self._next_rr = 0

    def select(self, candidates: Sequence[str], prompt_blocks: int,
               overlaps: Mapping[str, float], load: Mapping[str, float]) -> tuple[str, float]:
        """Pick one of ``candidates`` (non-empty); returns it with its KV cost."""
        assert candidates
        policy = self._config.policy
        if policy is RoutingPolicy.ROUND_ROBIN:
            self._next_rr += 1
            w = candidates[(self._next_rr - 1) % len(candidates)]
        elif policy is RoutingPolicy.RANDOM:
            w = self._rng.choice(candidates)
        elif policy is RoutingPolicy.LEAST_LOADED:
            w = self._cheapest(candidates, [load[c] for c in candidates])
        else:
            costs = self.costs(candidates, prompt_blocks, overlaps, load)
            if self._config.temperature > 0:
                return self._sample(candidates, costs)
            w = self._cheapest(candidates, costs)
            return w, costs[candidates.index(w)]
        return w, self.cost(w, prompt_blocks, overlaps, load)

    def cost(self, worker_id: str, prompt_blocks: int, overlaps: Mapping[str, float],
             load: Mapping[str, float]) -> float:
        to_prefill = max(0.0, prompt_blocks - overlaps.get(worker_id, 0))
        return self._config.overlap_weight * to_prefill + load[worker_id]

    def costs(self, candidates: Sequence[str], prompt_blocks: int,
              overlaps: Mapping[str, float], load: Mapping[str, float]) -> list[float]:
        weight = self._config.overlap_weight
        base = weight * prompt_blocks
        costs = [base + load[c] for c in candidates]
        if overlaps:   # usually few workers hold any of the prompt: correct only theirs
            for i, c in enumerate(candidates):
                if c in overlaps:
                    costs[i] -= weight * min(overlaps[c], prompt_blocks)
        return costs

    def _cheapest(self, candidates: Sequence[str], costs: list[float]) -> str:
        best = min(costs)
        tied = [c for c, x in zip(candidates, costs) if x <= best + _TIE_EPS]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def _sample(self, candidates: Sequence[str], costs: list[float]) -> tuple[str, float]:
        scale = max(max(costs), 1.0) * self._config.temperature
        best = min(costs)
        weights = [math.exp(-(c - best) / scale) for c in costs]
        i = self._rng.choices(range(len(candidates)), weights=weights)[0]
        return candidates[i], costs[i]

"""Worker selection: a pure function of candidates, prefix overlaps and loads (plus a seeded RNG).

The KV policy predicts each worker's time to first token for the prompt and takes the soonest:

    cost(w) = wait(w) + prefill_s(prompt tokens not cached on w)

wait(w) is when w would start the prompt (router/queues.py) and prefill_s comes from the workers'
timing profile (router/cost.py), so a cached block is worth exactly the compute it saves and a
queue is worth exactly its time. The KV_BLOCKS policy is Dynamo's formula, kept as a baseline:

    cost(w) = overlap_weight * (prompt blocks w would still have to prefill) + load(w)

where load is a decode worker's active KV blocks or a prefill worker's queued prefill blocks: two
units (blocks to compute, blocks held by running requests) traded one for one.

The cheapest worker wins; ties go to the preferred worker (a session's pin) if it is among them,
else at random; with ``temperature > 0`` the pick is sampled from
softmax(-(cost - min) / (max cost * temperature)), which spreads load among near-equal workers.
The other policies ignore the cache and exist as baselines.

It knows nothing of how overlaps, queues or loads are measured.
"""

from __future__ import annotations

import math
import random
from typing import Mapping, Sequence

from router.config import RouterConfig, RoutingPolicy
from router.cost import PrefillCost

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
        else:   # KV_BLOCKS (the KV policy is select_ttft)
            costs = self.costs(candidates, prompt_blocks, overlaps, load)
            if self._config.temperature > 0:
                return self._sample(candidates, costs)
            w = self._cheapest(candidates, costs)
            return w, costs[candidates.index(w)]
        return w, self.cost(w, prompt_blocks, overlaps, load)

    def select_ttft(self, candidates: Sequence[str], num_tokens: int, block_size: int,
                    overlaps: Mapping[str, float], busy_until: Mapping[str, float], now: float,
                    prefill: PrefillCost, prefer: str | None = None,
                    prefill_weight: float = 1.0,
                    positions: Mapping[str, int] | None = None,
                    decoding: Mapping[str, int] | None = None) -> tuple[str, float, int]:
        """The KV policy: the soonest predicted first token. Returns (worker, its predicted TTFT in
        seconds, the prompt tokens it holds). ``positions``: candidate -> its index in
        ``candidates`` (the router keeps one per candidate list)."""
        assert candidates
        cold_s = prefill.seconds(0, num_tokens)
        cold = prefill_weight * cold_s
        # cost - (cold - now): when the worker would start the prompt, corrected below for what
        # it holds and for the requests it is decoding; the constant is added back to the winner
        costs = [b if (b := busy_until[c]) > now else now for c in candidates]
        if decoding:            # each running decode waits out the prompt's prefill steps too
            for i, c in enumerate(candidates):
                d = decoding.get(c)
                if d:
                    costs[i] += d * cold_s
        cached = None
        if overlaps:   # workers holding a prefix: one prefill estimate per distinct prefix length
            max_hit = (num_tokens - 1) // block_size * block_size
            cached = {}
            saved: dict[int, float] = {}
            pos = positions if positions is not None else {c: i for i, c in enumerate(candidates)}
            for c, blocks in overlaps.items():
                i = pos.get(c)
                if i is None or not blocks:
                    continue
                hit = int(blocks) * block_size
                if hit > max_hit:
                    hit = max_hit
                cached[c] = hit
                d = saved.get(hit)
                if d is None:
                    d = saved[hit] = prefill.seconds(hit, num_tokens) - cold_s
                costs[i] += d * (prefill_weight + (decoding.get(c, 0) if decoding else 0))
        if self._config.temperature > 0:
            w, cost = self._sample(candidates, [x - now + cold for x in costs])
        else:
            w = self._cheapest(candidates, costs, prefer)
            cost = costs[candidates.index(w)] - now + cold
        return w, cost, cached.get(w, 0) if cached else 0

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

    def _cheapest(self, candidates: Sequence[str], costs: list[float], prefer: str | None = None) -> str:
        best = min(costs)
        tied = [c for c, x in zip(candidates, costs) if x <= best + _TIE_EPS]
        if len(tied) == 1:
            return tied[0]
        return prefer if prefer in tied else self._rng.choice(tied)

    def _sample(self, candidates: Sequence[str], costs: list[float]) -> tuple[str, float]:
        scale = max(max(costs), 1.0) * self._config.temperature
        best = min(costs)
        weights = [math.exp(-(c - best) / scale) for c in costs]
        i = self._rng.choices(range(len(candidates)), weights=weights)[0]
        return candidates[i], costs[i]

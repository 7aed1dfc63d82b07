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

import numpy as np

from router.config import RouterConfig, RoutingPolicy
from router.cost import PrefillCost
from router.pool import CandidatePool

_TIE_EPS = 1e-9

# Workers that cache the same leading blocks of a prompt: their candidate positions (an array, or
# one int), the blocks, and for an array the index slots' mask (membership in one operation).
Holder = tuple["np.ndarray | int", float, int]


def holder_blocks(holders: Sequence[Holder], position: int, slot: int | None) -> float:
    """The cached leading blocks of the candidate at ``position`` (index slot ``slot``): 0 if it
    is in no group."""
    for pos, blocks, bits in holders:
        if pos == position if type(pos) is int else slot is not None and bits >> slot & 1:
            return blocks
    return 0


def cached_tokens(blocks: float, num_tokens: int, block_size: int) -> int:
    """The prompt tokens ``blocks`` cached leading blocks spare (at least one token is computed)."""
    return min(int(blocks) * block_size, (num_tokens - 1) // block_size * block_size)


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

    def select_ttft(self, pool: CandidatePool, num_tokens: int, block_size: int,
                    holders: Sequence[Holder], busy_until: np.ndarray, now: float,
                    prefill: PrefillCost, prefer: str | None = None,
                    prefill_weight: float = 1.0,
                    decoding: np.ndarray | None = None) -> tuple[int, float]:
        """The KV policy: the soonest predicted first token. Returns the winner's position in the
        pool and its predicted TTFT in seconds.

        ``holders``: groups of candidates caching the same leading blocks, disjoint. ``busy_until`` and ``decoding`` are the queues' arrays, indexed by
        the pool's rows (``decoding`` None: ignore decodes). One pass of array arithmetic over
        every candidate, then one more per group of holders: per worker the same floating-point
        operations, in the same order, as the cost in the module docstring spelled out."""
        cold_s = prefill.seconds(0, num_tokens)
        cold = prefill_weight * cold_s
        # cost - (cold - now): when the worker would start the prompt, corrected below for what
        # it holds and for the requests it is decoding; the constant is added back to the winner
        rows = pool.rows
        costs = np.maximum(busy_until[rows], now)
        dec = None
        if decoding is not None:   # each running decode waits out the prompt's prefill steps too
            dec = decoding[rows]
            costs += dec * cold_s
        for pos, blocks, _ in holders:      # one prefill estimate per group
            if blocks:
                d = prefill.seconds(cached_tokens(blocks, num_tokens, block_size), num_tokens) - cold_s
                if type(pos) is int:        # one worker: plain floats, no array operations
                    costs[pos] = costs.item(pos) + (d * prefill_weight if dec is None
                                                    else d * (prefill_weight + dec.item(pos)))
                else:
                    costs[pos] += d * prefill_weight if dec is None else d * (prefill_weight + dec[pos])
        if self._config.temperature > 0:
            w, cost = self._sample(pool.names, [x - now + cold for x in costs.tolist()])
            return pool.position[w], cost
        i = int(costs.argmin())
        best = costs.item(i)
        tied = (costs <= best + _TIE_EPS).nonzero()[0]
        if len(tied) > 1:       # the preferred worker if tied, else one at random (in pool order)
            p = pool.position.get(prefer, -1) if prefer is not None else -1
            i = p if p >= 0 and costs.item(p) <= best + _TIE_EPS else int(self._rng.choice(tied))
        return i, costs.item(i) - now + cold

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

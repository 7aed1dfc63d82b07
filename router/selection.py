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

# Workers that cache the same leading blocks of a prompt: candidate positions (an array, or one
# int) and the blocks.
Holder = tuple["np.ndarray | int", float]


def holder_blocks(holders: Sequence[Holder], position: int) -> float:
    """The cached leading blocks of the candidate at ``position`` (0 if it is in no group)."""
    for pos, blocks in holders:
        if type(pos) is int:
            if pos == position:
                return blocks
        else:
            k = int(np.searchsorted(pos, position))
            if k < len(pos) and pos[k] == position:
                return blocks
    return 0


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
                    decoding: np.ndarray | None = None) -> tuple[str, float, int, float]:
        """The KV policy: the soonest predicted first token. Returns (worker, its predicted TTFT in
        seconds, the prompt tokens it holds, its overlap in blocks).

        ``holders``: (candidate positions, cached leading blocks) groups, disjoint; the positions
        an array, or one int. ``busy_until`` and ``decoding`` are the queues' arrays, indexed by
        the pool's rows (``decoding`` None: ignore decodes). One pass of array arithmetic over
        every candidate, then one more per group of holders: per worker the same floating-point
        operations, in the same order, as the cost in the module docstring spelled out."""
        cold_s = prefill.seconds(0, num_tokens)
        cold = prefill_weight * cold_s
        # cost - (cold - now): when the worker would start the prompt, corrected below for what
        # it holds and for the requests it is decoding; the constant is added back to the winner
        costs = busy_until[pool.rows]
        np.maximum(costs, now, out=costs)
        dec = None
        if decoding is not None:   # each running decode waits out the prompt's prefill steps too
            dec = decoding[pool.rows]
            costs += dec * cold_s
        max_hit = (num_tokens - 1) // block_size * block_size
        for pos, blocks in holders:     # one prefill estimate per group
            if not blocks:
                continue
            hit = int(blocks) * block_size
            if hit > max_hit:
                hit = max_hit
            d = prefill.seconds(hit, num_tokens) - cold_s
            costs[pos] += d * prefill_weight if dec is None else d * (prefill_weight + dec[pos])
        names = pool.names
        if self._config.temperature > 0:
            w, cost = self._sample(names, [x - now + cold for x in costs.tolist()])
            i = pool.position[w]
        else:
            tied = np.flatnonzero(costs <= costs.min() + _TIE_EPS)
            if len(tied) == 1:
                i = int(tied[0])
            else:
                tied_names = [names[j] for j in tied]
                i = pool.position[prefer if prefer in tied_names else self._rng.choice(tied_names)]
            w, cost = names[i], float(costs[i]) - now + cold
        blocks = holder_blocks(holders, i)
        if not blocks:
            return w, cost, 0, 0
        return w, cost, min(int(blocks) * block_size, max_hit), blocks

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

"""A deterministic router workload for the placement-equivalence test (test_router_replay.py).

It drives the real Router through every input that moves a decision: chained KV events (stores
continuing a parent, out-of-order stores that leave orphans, interior and tail removals, clears,
snapshots), routing with and without hints and exclusions, first tokens, finishes, worker load
reports, and workers leaving and joining (their index slots reused), on a virtual clock. Each
decision is recorded exactly (worker, overlap, cost as a float, blocks to prefill), so that a
faster router can be checked to place every request as the recorded one did.

`python -m tests.unit.bench.router_replay` rewrites the recorded decisions; do that only when a change
is MEANT to move placement, and say so in the commit.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvstore.events import AllCleared, BlockRemoved, BlockStored, KvEventBatch, Tier
from router import Router, RouterConfig, RoutingPolicy, WorkerRole

RECORDED = Path(__file__).parent / "data" / "router_replay_decisions.json"
BLOCK_SIZE = 16

# name -> router config; each replays the same workload. All but kv_lower_tier are tier-unaware
# (lower_tier_weight 0, as they were recorded), whatever the router's default weight.
_TIER_UNAWARE = 0.0
CONFIGS: dict[str, RouterConfig] = {
    "kv": RouterConfig(lower_tier_weight=_TIER_UNAWARE),
    "kv_no_decode_delay": RouterConfig(decode_delay=False, busy_period_weight=False, lower_tier_weight=_TIER_UNAWARE),
    "kv_lower_tier": RouterConfig(lower_tier_weight=0.5),
    "kv_two_tiers": RouterConfig(tiers=(Tier.GPU, Tier.HOST), lower_tier_weight=_TIER_UNAWARE),
    "kv_temperature": RouterConfig(temperature=0.2, lower_tier_weight=_TIER_UNAWARE),
    "kv_approximate": RouterConfig(approximate=True, approx_ttl_s=3.0, lower_tier_weight=_TIER_UNAWARE),
    "kv_blocks": RouterConfig(policy=RoutingPolicy.KV_BLOCKS, lower_tier_weight=_TIER_UNAWARE),
}


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def replay(config: RouterConfig, seed: int = 0, steps: int = 700) -> list[list]:
    """Run the workload through a fresh Router; returns one record per decision."""
    rng = random.Random(seed)
    clock = _Clock()
    r = Router(config, block_size=BLOCK_SIZE, seed=seed, clock=clock)
    roles = {f"d{i}": WorkerRole.DECODE for i in range(10)}
    roles.update({f"a{i}": WorkerRole.AGGREGATED for i in range(3)})
    roles.update({f"p{i}": WorkerRole.PREFILL for i in range(4)})
    for w, role in roles.items():
        r.add_worker(w, role)
    seq = dict.fromkeys(roles, 0)
    held: dict[str, list[list[int]]] = {w: [] for w in roles}      # chains each worker stored
    systems = [[rng.getrandbits(62) for _ in range(rng.randint(2, 12))] for _ in range(5)]
    convs: list[list[int]] = []                                      # growing sessions
    in_flight: list[tuple[str, str]] = []                            # (request id, worker)
    out: list[list] = []
    next_worker = len(roles)

    def publish(w: str, events: list) -> None:
        seq[w] += 1
        r.apply_events(KvEventBatch(w, seq[w], events))

    def store(w: str, chain: list[int]) -> None:
        # in events of 1-5 blocks, sometimes out of order (the later part first: orphans)
        parts, i = [], 0
        while i < len(chain):
            n = rng.randint(1, 5)
            parts.append((tuple(chain[i:i + n]), chain[i - 1] if i else None))
            i += n
        if len(parts) > 1 and rng.random() < 0.2:
            parts[0], parts[1] = parts[1], parts[0]
        tier = Tier.HOST if rng.random() < 0.15 else Tier.GPU
        for hs, parent in parts:
            publish(w, [BlockStored(hs, parent, tier)])
        held[w].append(chain)

    def prompt() -> tuple[list[int], str | None]:
        k = rng.random()
        if k < 0.35 and convs:                       # a session's next turn
            c = rng.randrange(len(convs))
            convs[c] = convs[c] + [rng.getrandbits(62) for _ in range(rng.randint(1, 6))]
            return convs[c], f"s{c}"
        if k < 0.7:                                  # a system prompt and a new tail
            hs = rng.choice(systems) + [rng.getrandbits(62) for _ in range(rng.randint(0, 20))]
            if rng.random() < 0.3:
                convs.append(hs)
                return hs, f"s{len(convs) - 1}"
            return hs, None
        return [rng.getrandbits(62) for _ in range(rng.randint(1, 30))], None

    for step in range(steps):
        clock.t += rng.expovariate(40.0)
        k = rng.random()
        if k < 0.45:
            hs, hint = prompt()
            role = rng.choice((WorkerRole.DECODE, WorkerRole.DECODE, WorkerRole.AGGREGATED,
                               WorkerRole.PREFILL))
            serving = [w for w, ro in r.workers().items()
                       if (ro is WorkerRole.PREFILL) == (role is WorkerRole.PREFILL)]
            exclude = set(rng.sample(serving, 1)) if rng.random() < 0.1 and len(serving) > 1 else set()
            rid = f"r{step}"
            tokens = len(hs) * BLOCK_SIZE - rng.randint(0, BLOCK_SIZE - 1)
            d = r.route(rid, hs, tokens, role, exclude=exclude, hint=hint)
            out.append([step, d.worker_id, d.overlap_blocks, d.cost, d.prefill_blocks])
            in_flight.append((rid, d.worker_id))
            if rng.random() < 0.5:        # the worker will cache what it computed
                store(d.worker_id, hs)
        elif k < 0.6 and in_flight:
            rid, w = in_flight[rng.randrange(len(in_flight))]
            r.first_token(rid)
        elif k < 0.72 and in_flight:
            rid, w = in_flight.pop(rng.randrange(len(in_flight)))
            r.finished(rid, w if rng.random() < 0.3 else None)
        elif k < 0.8:
            w = rng.choice(list(r.workers()))
            r.update_worker_load(w, rng.randint(0, 400), rng.choice((0, 0, rng.randint(0, 9000))))
        elif k < 0.92:                               # evictions
            w = rng.choice(list(r.workers()))
            if held[w]:
                chain = rng.choice(held[w])
                cut = rng.randrange(len(chain))
                gone = chain[cut:] if rng.random() < 0.7 else chain[cut:cut + 1]   # tail, or a hole
                publish(w, [BlockRemoved(tuple(reversed(gone)) if rng.random() < 0.5
                                         else tuple(gone), rng.choice((Tier.GPU, Tier.HOST)))])
        elif k < 0.94:
            w = rng.choice(list(r.workers()))
            publish(w, [AllCleared(rng.choice((Tier.GPU, Tier.HOST)))])
        elif k < 0.96:                               # a snapshot: some of what it stored
            w = rng.choice(list(r.workers()))
            chains = rng.sample(held[w], min(3, len(held[w])))
            entries = [(h, c[i - 1] if i else None) for c in chains for i, h in enumerate(c)]
            rng.shuffle(entries)
            r.apply_snapshot(w, seq[w], [(Tier.GPU, entries)])
            held[w] = chains
        elif k < 0.975:                              # a worker leaves, another joins
            w = rng.choice(list(r.workers()))
            role = r.workers()[w]
            r.remove_worker(w)
            in_flight = [(q, x) for q, x in in_flight if x != w]
            new = f"n{next_worker}"
            next_worker += 1
            r.add_worker(new, role)
            seq[new], held[new] = 0, []
        else:
            clock.t += rng.uniform(0.0, 2.0)         # a lull: queues drain, TTLs expire
    return out


def record_all() -> dict[str, list[list]]:
    return {name: replay(cfg) for name, cfg in CONFIGS.items()}


if __name__ == "__main__":
    RECORDED.write_text(json.dumps(record_all(), separators=(",", ":")) + "\n")
    print(f"wrote {RECORDED}")

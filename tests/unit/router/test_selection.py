"""Router facade and selection: who gets a request, and how load spreads."""

from __future__ import annotations

from collections import Counter

import pytest

from kvstore.events import BlockStored, KvEventBatch, Tier
from kvstore.hashing import block_hashes
from router.cost import PrefillCost
from perf.profile import CurveTiming
from router import NoWorkerAvailable, Router, RouterConfig, RoutingPolicy, UnknownWorker, WorkerRole

BS = 16


def make_router(n: int = 4, role: WorkerRole = WorkerRole.DECODE, **cfg) -> Router:
    r = Router(RouterConfig(**cfg), block_size=BS, seed=1)
    for i in range(n):
        r.add_worker(f"w{i}", role)
    return r


def cache(r: Router, worker: str, hashes, seq: int = 1, tier: Tier = Tier.GPU,
          parent: int | None = None) -> None:
    r.apply_events(KvEventBatch(worker, seq, [BlockStored(tuple(hashes), parent, tier)]))


def prompt(seed: int, num_tokens: int = 256) -> list[int]:
    return [(seed * 7919 + i) % 4096 for i in range(num_tokens)]


def test_kv_policy_sends_a_prompt_to_the_worker_holding_its_prefix():
    r = make_router()
    toks = prompt(1)
    hs = block_hashes(toks, BS)
    cache(r, "w2", hs[:12])
    cache(r, "w3", hs[:4])
    d = r.route("req", hs, len(toks), WorkerRole.DECODE)
    assert (d.worker_id, d.overlap_blocks, d.prefill_blocks) == ("w2", 12, 4)
    # the KV policy's cost is the predicted time to first token: no queue, 4 blocks to prefill
    assert d.cost == pytest.approx(PrefillCost(CurveTiming()).seconds(12 * BS, 256))
    blocks = make_router(policy=RoutingPolicy.KV_BLOCKS)      # Dynamo's formula, in blocks
    cache(blocks, "w2", hs[:12])
    d = blocks.route("req", hs, len(toks), WorkerRole.DECODE)
    assert (d.worker_id, d.cost) == ("w2", pytest.approx(4.0))


def test_load_keeps_a_shared_system_prompt_from_piling_onto_one_worker():
    r = make_router(n=4)
    system = prompt(0, 128)                     # 8 blocks every request shares
    for i in range(4):
        cache(r, f"w{i}", block_hashes(system, BS))
    picks = Counter()
    for i in range(400):
        toks = system + prompt(1000 + i, 128)
        picks[r.route(f"r{i}", block_hashes(toks, BS), len(toks), WorkerRole.DECODE).worker_id] += 1
    assert set(picks) == {"w0", "w1", "w2", "w3"}
    assert max(picks.values()) - min(picks.values()) <= 2


def test_finishing_requests_releases_load_and_reports_replace_the_router_estimate():
    r = make_router(n=2, policy=RoutingPolicy.KV_BLOCKS)
    hs = block_hashes(prompt(3), BS)
    d = r.route("a", hs, 256, WorkerRole.DECODE)
    assert r.load(d.worker_id) == 16
    r.finished("a")
    r.finished("a")                              # a cancel racing the finish is harmless
    assert r.load(d.worker_id) == 0
    r.update_worker_load("w0", active_blocks=100, waiting_prefill_tokens=0)
    assert r.route("b", hs, 256, WorkerRole.DECODE).worker_id == "w1"
    with pytest.raises(UnknownWorker):
        r.update_worker_load("nope", 1, 0)


def test_a_reported_prefill_queue_counts_as_decode_load():
    # a worker whose requests still wait for prefill holds few blocks, but is not idle
    r = make_router(n=2)
    hs = block_hashes(prompt(3), BS)
    r.update_worker_load("w0", active_blocks=0, waiting_prefill_tokens=64 * BS)
    r.update_worker_load("w1", active_blocks=10, waiting_prefill_tokens=0)
    assert r.load("w0") == 64
    assert r.route("a", hs, 256, WorkerRole.DECODE).worker_id == "w1"


def test_a_busy_worker_loses_to_an_idle_one_once_load_outweighs_the_cached_prefix():
    r = make_router(n=2, overlap_weight=1.0, policy=RoutingPolicy.KV_BLOCKS)
    hs = block_hashes(prompt(4), BS)             # 16 blocks
    cache(r, "w0", hs)
    r.update_worker_load("w0", active_blocks=10, waiting_prefill_tokens=0)
    assert r.route("a", hs, 256, WorkerRole.DECODE).worker_id == "w0"      # 10 < 16
    r.update_worker_load("w0", active_blocks=20, waiting_prefill_tokens=0)
    assert r.route("b", hs, 256, WorkerRole.DECODE).worker_id == "w1"      # 20 > 16


def test_prefill_workers_are_chosen_by_queued_prefill_and_roles_are_kept_apart():
    r = Router(RouterConfig(), block_size=BS)
    r.add_worker("p0", WorkerRole.PREFILL)
    r.add_worker("p1", WorkerRole.PREFILL)
    r.add_worker("d0", WorkerRole.DECODE)
    hs = block_hashes(prompt(5), BS)
    r.update_worker_load("p0", active_blocks=0, waiting_prefill_tokens=64 * BS)
    assert r.route("a", hs, 256, WorkerRole.PREFILL).worker_id == "p1"
    assert r.route("a", hs, 256, WorkerRole.DECODE).worker_id == "d0"
    r.finished("a", "p1")                        # prefill half done; decode half still held
    assert r.load("p1") == 0 and r.load("d0") == 16


def test_no_worker_of_the_role_raises_a_router_error():
    r = make_router(n=2)
    hs = block_hashes(prompt(6), BS)
    with pytest.raises(NoWorkerAvailable):
        r.route("a", hs, 256, WorkerRole.PREFILL)
    with pytest.raises(NoWorkerAvailable):
        r.route("a", hs, 256, WorkerRole.DECODE, exclude={"w0", "w1"})
    assert r.route("a", hs, 256, WorkerRole.DECODE, exclude={"w0"}).worker_id == "w1"
    r.remove_worker("w1")
    assert r.route("b", hs, 256, WorkerRole.DECODE).worker_id == "w0"


def test_baseline_policies():
    hs = block_hashes(prompt(7), BS)
    rr = make_router(n=3, policy=RoutingPolicy.ROUND_ROBIN)
    assert [rr.route(f"r{i}", hs, 256, WorkerRole.DECODE).worker_id for i in range(6)] == \
        ["w0", "w1", "w2", "w0", "w1", "w2"]
    ll = make_router(n=3, policy=RoutingPolicy.LEAST_LOADED)
    ll.update_worker_load("w0", 5, 0)
    ll.update_worker_load("w1", 1, 0)
    ll.update_worker_load("w2", 3, 0)
    assert ll.route("a", hs, 256, WorkerRole.DECODE).worker_id == "w1"
    picks = [make_router(n=8, policy=RoutingPolicy.RANDOM).route("a", hs, 256, WorkerRole.DECODE)
             .worker_id for _ in range(3)]
    assert len(set(picks)) == 1                 # seeded: the same seed picks the same worker


def test_temperature_spreads_picks_among_near_equal_workers_but_avoids_expensive_ones():
    r = make_router(n=3, temperature=0.5)
    hs = block_hashes(prompt(8), BS)
    cache(r, "w0", hs[:15])
    cache(r, "w1", hs[:14])
    picks = Counter()
    for i in range(300):
        picks[r.route(f"r{i}", hs, 256, WorkerRole.DECODE).worker_id] += 1
        r.finished(f"r{i}")
    assert picks["w0"] > picks["w2"] and picks["w1"] > picks["w2"]
    assert picks["w1"] > 30


def test_host_tier_counts_only_when_weighted():
    hs = block_hashes(prompt(9), BS)
    for weight, expect in ((0.0, "w1"), (0.8, "w0")):
        r = make_router(n=2, lower_tier_weight=weight)
        cache(r, "w0", hs, tier=Tier.HOST)       # all 16 blocks, but in host RAM
        cache(r, "w1", hs[:4])
        assert r.route("a", hs, 256, WorkerRole.DECODE).worker_id == expect


def test_the_default_weight_routes_as_tier_unaware_until_a_block_leaves_the_gpu():
    """The default weight (0.5) changes nothing while every block is on the GPU: the same choices
    and overlaps as weight 0; once a worker holds a block only in host RAM, that block counts half."""
    hs = block_hashes(prompt(11), BS)
    routers = {w: make_router(n=3, **({} if w is None else {"lower_tier_weight": w})) for w in (None, 0.0)}
    for r in routers.values():
        cache(r, "w0", hs[:6])
        cache(r, "w1", hs[:10])
    picks = {w: [r.route(f"q{i}", hs, 256, WorkerRole.DECODE).worker_id for i in range(6)]
             for w, r in routers.items()}
    assert picks[None] == picks[0.0] and routers[None].overlaps(hs) == {"w0": 6, "w1": 10}
    r = routers[None]
    cache(r, "w2", hs, tier=Tier.HOST)
    assert r.overlaps(hs)["w2"] == 0.5 * len(hs)


def test_router_reports_workers_needing_resync():
    r = make_router(n=1, gap_max_buffered=1)
    cache(r, "w0", [1], seq=1)
    cache(r, "w0", [3], seq=3)
    assert r.apply_events(KvEventBatch("w0", 4, [])).needs_resync
    assert r.workers_needing_resync() == ["w0"]
    r.apply_snapshot("w0", 4, [(Tier.GPU, [(1, None), (2, 1), (3, 2)])])
    assert r.workers_needing_resync() == [] and r.overlaps([1, 2, 3]) == {"w0": 3}


def test_bad_config_is_rejected():
    with pytest.raises(ValueError):
        RouterConfig(overlap_weight=-1)
    with pytest.raises(ValueError):
        RouterConfig(gap_max_buffered=0)


def test_kv_policy_leaves_a_cached_prefix_once_the_queue_there_costs_more_than_recomputing_it():
    r = make_router(n=2)
    cost = PrefillCost(CurveTiming())
    hs = block_hashes(prompt(4), BS)             # 16 blocks, all cached on w0
    cache(r, "w0", hs)
    saved = cost.seconds(0, 256) - cost.seconds(15 * BS, 256)
    tokens_per_s = 2048 / cost.seconds(0, 2048)
    below = int(0.5 * saved * tokens_per_s)      # queued work worth half the saving
    r.update_worker_load("w0", active_blocks=0, waiting_prefill_tokens=below)
    assert r.route("a", hs, 256, WorkerRole.DECODE).worker_id == "w0"
    r.finished("a")
    r.update_worker_load("w0", active_blocks=0, waiting_prefill_tokens=4 * below + 4096)
    assert r.route("b", hs, 256, WorkerRole.DECODE).worker_id == "w1"


def test_a_routing_hint_pins_a_session_to_one_worker_while_load_allows():
    def one_by_one(r: Router, hint: str | None) -> set[str]:
        """Unrelated prompts, each done before the next is sent: every worker costs the same."""
        picks = set()
        for i in range(12):
            picks.add(r.route(f"s{i}", block_hashes(prompt(100 + i), BS), 256, WorkerRole.DECODE,
                              hint=hint).worker_id)
            r.first_token(f"s{i}")
            r.finished(f"s{i}")
        return picks

    picks = one_by_one(make_router(n=4), "key:conv-1")
    assert len(picks) == 1                       # the pin breaks the ties
    assert len(one_by_one(make_router(n=4), None)) > 1       # without it, ties spread at random
    # the pinned worker gets busy: a short queue is worth less than recomputing the session's
    # context, so the session stays; a long one moves it, and the pin moves with it
    pinned = picks.pop()
    r2 = make_router(n=4)
    turn1 = prompt(7, 1024)
    turn2 = turn1 + prompt(8, 64)
    first = r2.route("t1", block_hashes(turn1, BS), len(turn1), WorkerRole.DECODE, hint="key:c").worker_id
    for w in r2.workers():                       # a busy fleet: every other worker has a queue too
        if w != first:
            r2.update_worker_load(w, active_blocks=0, waiting_prefill_tokens=512)
    # turn 1 is still queued (no first token, no KV event yet): turn 2 follows it anyway
    d = r2.route("t2", block_hashes(turn2, BS), len(turn2), WorkerRole.DECODE, hint="key:c")
    assert d.worker_id == first and d.overlap_blocks == 64
    r2.first_token("t1")
    r2.first_token("t2")
    r2.update_worker_load(first, active_blocks=0, waiting_prefill_tokens=1_000_000)
    turn3 = turn2 + prompt(9, 64)
    moved = r2.route("t3", block_hashes(turn3, BS), len(turn3), WorkerRole.DECODE, hint="key:c").worker_id
    assert moved != first
    # turn 3 still queued there, the other workers less busy than it: turn 4 follows the pin
    for w in r2.workers():
        if w not in (first, moved):
            r2.update_worker_load(w, active_blocks=0, waiting_prefill_tokens=1024)
    turn4 = turn3 + prompt(10, 64)
    assert r2.route("t4", block_hashes(turn4, BS), len(turn4), WorkerRole.DECODE,
                    hint="key:c").worker_id == moved
    assert pinned in {"w0", "w1", "w2", "w3"}


def test_hints_are_ignored_when_turned_off_and_forgotten_with_their_worker():
    r = make_router(n=2, use_hints=False)
    turn1 = prompt(11, 1024)
    first = r.route("a", block_hashes(turn1, BS), len(turn1), WorkerRole.DECODE, hint="k").worker_id
    d = r.route("b", block_hashes(turn1 + prompt(12, 64), BS), 1088, WorkerRole.DECODE, hint="k")
    assert d.worker_id != first and d.overlap_blocks == 0   # its queue makes the other one sooner
    r = make_router(n=2)
    first = r.route("a", block_hashes(turn1, BS), len(turn1), WorkerRole.DECODE, hint="k").worker_id
    r.remove_worker(first)
    d = r.route("b", block_hashes(turn1, BS), len(turn1), WorkerRole.DECODE, hint="k")
    assert d.worker_id != first and d.overlap_blocks == 0


def test_a_worker_busy_decoding_costs_the_delay_a_prefill_would_impose_on_its_decodes():
    r = make_router(n=2)
    system = prompt(20, 512)
    for w in ("w0", "w1"):
        cache(r, w, block_hashes(system, BS))            # both hold the shared prefix
    for i in range(20):                                  # w0 decodes 20 requests of this router
        d = r.route(f"d{i}", block_hashes(prompt(300 + i, 64), BS), 64, WorkerRole.DECODE,
                    exclude={"w1"})
        r.first_token(f"d{i}")
    picks = Counter()
    for i in range(10):
        toks = system + prompt(400 + i, 128)
        picks[r.route(f"n{i}", block_hashes(toks, BS), len(toks), WorkerRole.DECODE).worker_id] += 1
        r.first_token(f"n{i}")
        r.finished(f"n{i}")
    assert picks == {"w1": 10}
    for i in range(20):
        r.finished(f"d{i}")                              # w0's decodes end: both cost the same again
    picks = Counter()
    for i in range(40):
        toks = system + prompt(500 + i, 128)
        picks[r.route(f"m{i}", block_hashes(toks, BS), len(toks), WorkerRole.DECODE).worker_id] += 1
        r.first_token(f"m{i}")
        r.finished(f"m{i}")
    assert set(picks) == {"w0", "w1"}

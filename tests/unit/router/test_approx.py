"""Approximate mode: the router's own decisions stand in for KV events, for a TTL."""

from __future__ import annotations

from kvstore.hashing import block_hashes
from router import Router, RouterConfig, WorkerRole

BS = 16


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_router(clock: FakeClock) -> Router:
    r = Router(RouterConfig(approximate=True, approx_ttl_s=10.0), block_size=BS, seed=3, clock=clock)
    for i in range(4):
        r.add_worker(f"w{i}", WorkerRole.DECODE)
    return r


def test_a_repeated_prompt_follows_the_first_one_until_the_ttl_expires():
    clock = FakeClock()
    r = make_router(clock)
    hs = block_hashes(list(range(512)), BS)
    first = r.route("a", hs, 512, WorkerRole.DECODE)
    r.finished("a")
    assert first.overlap_blocks == 0
    clock.t = 9.0
    again = r.route("b", hs, 512, WorkerRole.DECODE)
    r.finished("b")
    assert (again.worker_id, again.overlap_blocks) == (first.worker_id, len(hs))
    clock.t = 18.5            # the second route refreshed the blocks until t=19
    assert r.overlaps(hs) == {first.worker_id: len(hs)}
    clock.t = 19.5
    assert r.overlaps(hs) == {}


def test_refresh_keeps_only_the_blocks_routed_again():
    clock = FakeClock()
    r = make_router(clock)
    long = block_hashes(list(range(512)), BS)        # 32 blocks
    w = r.route("a", long, 512, WorkerRole.DECODE).worker_id
    r.finished("a")
    clock.t = 5.0
    r.route("b", long[:8], 128, WorkerRole.DECODE, exclude={x for x in r.workers() if x != w})
    clock.t = 12.0
    assert r.overlaps(long) == {w: 8}


def test_removed_worker_leaves_the_approximate_index():
    clock = FakeClock()
    r = make_router(clock)
    hs = block_hashes(list(range(64)), BS)
    w = r.route("a", hs, 64, WorkerRole.DECODE).worker_id
    r.remove_worker(w)
    assert r.overlaps(hs) == {}
    clock.t = 20.0
    assert r.overlaps(hs) == {}

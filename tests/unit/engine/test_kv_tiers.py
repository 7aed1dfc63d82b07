"""The KV tiers in a real engine on the CPU (the tiny model, a tiny G1 that forces offload): outputs
are token-identical to an unconstrained run while prefixes come back from host RAM and from disk;
a new engine on the same --kv-disk-dir serves a prompt seen before from disk; flipped bytes and a
truncated slab turn the damaged blocks into counted misses and the outputs stay correct."""

from __future__ import annotations

import json
import os
import random
import time

import pytest

from engine.engine import Engine
from engine.kv_tiers import MOCK_SLOT_BYTES, TierConfigError
from kvstore.movers.disk_pool import DiskError
from kvstore.events import Tier
from runtime.config import EngineConfig
from runtime.metrics import WorkerMetrics
from runtime.types import EngineRequest, SamplingParams
from splitserve.models import resolve_model

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def model():
    return resolve_model("tiny")


@pytest.fixture(scope="module")
def block_bytes(model):
    return Engine(EngineConfig(model=model, device="cpu", num_blocks=4)).runner.block_bytes


def prompts(n: int, seed: int) -> list[list[int]]:
    """n prompts of 3 full blocks and 4 tokens (4 blocks with their 3 outputs)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 200) for _ in range(3 * BLOCK + 4)] for _ in range(n)]


def tiered(model, block_bytes, disk_dir, g1=8, host=10, disk=64, onboard="always") -> Engine:
    return Engine(EngineConfig(model=model, device="cpu", num_blocks=g1, kv_host_gib=host * block_bytes / 2**30,
                               kv_disk_gib=disk * block_bytes / 2**30, kv_disk_dir=str(disk_dir) if disk else None,
                               kv_onboard=onboard, kv_host_copy="torch"))


def run(eng: Engine, seq: list[list[int]], tag: str) -> list[list[int]]:
    """One request at a time, to completion, disk write-back drained after each (deterministic)."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(seq):
        assert eng.add_request(EngineRequest(f"{tag}{i}", p, GREEDY)) is None
        while eng.has_work:
            for o in eng.step().outputs:
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        if eng.tier_io is not None:
            eng.tiers.drain()
    return [out[f"{tag}{i}"] for i in range(len(seq))]


def reference(model, seq):
    return run(Engine(EngineConfig(model=model, device="cpu", num_blocks=256)), seq, "ref")


def test_a_tiny_gpu_pool_serves_host_and_disk_hits_with_identical_tokens(model, block_bytes, tmp_path):
    a, b, f1, f2 = prompts(4, seed=1)
    # A twice (a second use: worth a disk write), B, two fillers (A and B leave G1; A leaves host
    # RAM, B stays), then B (a host hit) and A (a disk hit)
    seq = [a, a, b, f1, f2, b, a]
    eng = tiered(model, block_bytes, tmp_path)
    try:
        got = run(eng, seq, "t")
        st = eng.stats()
        m = WorkerMetrics("w")
        m.observe(st)
        hits = {s.labels["tier"]: s.value for s in m.registry.collect() if s.name == "splitserve_kv_hits"
                for s in s.samples if s.name.endswith("_total")}
        assert hits["device"] == 3                               # A's second use
        # B's third use: 3 host hits; A's third: 3 blocks from disk and host RAM (blocks saved on
        # disk leave host RAM first, so part of A may still be there: each block from its fastest tier)
        assert hits["host"] + hits["disk"] == 6 and hits["host"] >= 3 and hits["disk"] >= 1
        assert st.tiers.errors.get(DiskError.CHECKSUM, 0) == 0
        assert eng.pool.num_free == eng.pool.num_blocks          # every offload landed and let go
    finally:
        eng.close()
    assert got == reference(model, seq)


def test_a_new_engine_on_the_same_disk_dir_serves_from_disk_and_damage_is_a_counted_miss(model, block_bytes,
                                                                                         tmp_path):
    a, = prompts(1, seed=2)
    want = reference(model, [a])[0]
    eng = tiered(model, block_bytes, tmp_path, host=4)
    try:
        assert run(eng, [a, a], "w") == [want, want]
        assert eng.tiers.stats().blocks[Tier.DISK] == 3
    finally:
        eng.close()

    eng = tiered(model, block_bytes, tmp_path, host=4)          # a restart: G1 and host RAM are empty
    try:
        assert run(eng, [a], "r") == [want]
        assert eng.stats().tiers.loaded_blocks[Tier.DISK] == 3
    finally:
        eng.close()

    slab = tmp_path / "slab-000000.kv"
    with open(slab, "r+b") as f:                                 # bit rot in every block
        for off in range(0, os.path.getsize(slab), block_bytes):
            f.seek(off + 100)
            byte = f.read(1)
            f.seek(off + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
    eng = tiered(model, block_bytes, tmp_path, host=4)
    try:
        assert run(eng, [a], "c") == [want]                      # recomputed, not served damaged
        st = eng.stats().tiers
        assert st.errors[DiskError.CHECKSUM] >= 1 and st.blocks[Tier.DISK] < 3
        run(eng, [a], "c2")                                      # written again: intact on disk
        assert eng.stats().tiers.blocks[Tier.DISK] == 3
    finally:
        eng.close()

    os.truncate(slab, block_bytes // 2)                          # a torn file: every block cut off
    eng = tiered(model, block_bytes, tmp_path, host=4)
    try:
        assert run(eng, [a], "t") == [want]
        st = eng.stats().tiers
        assert st.loaded_blocks[Tier.DISK] == 0 or st.errors.get(DiskError.TRUNCATED, 0) >= 1
    finally:
        eng.close()


def test_auto_recomputes_a_hit_that_loads_slower_and_counts_both_choices(model, block_bytes, tmp_path):
    a, f1, f2 = prompts(3, seed=3)
    eng = tiered(model, block_bytes, tmp_path, host=10, onboard="auto")
    try:
        from kvstore.pools.tier_policy import PrefillSpeed
        eng.scheduler.prefill_speed = PrefillSpeed(1e12)        # recomputing is free: never load
        eng._prefill_meter.observe = lambda *a: None             # keep it so
        got = run(eng, [a, f1, f2, a], "x")
        st = eng.stats().tiers
        assert st.loaded_blocks[Tier.HOST] == 0 and st.recomputed_blocks[Tier.HOST] == 3
    finally:
        eng.close()
    assert got == reference(model, [a, f1, f2, a])


def test_bad_tier_flags_are_start_up_errors(model, tmp_path):
    for kw, match in (({"kv_disk_gib": 1.0}, "needs --kv-disk-dir"),
                      ({"kv_disk_dir": str(tmp_path)}, "needs --kv-disk-gib"),
                      ({"kv_disk_gib": 1.0, "kv_disk_dir": str(tmp_path)}, "needs the host tier")):
        with pytest.raises(TierConfigError, match=match):
            Engine(EngineConfig(model=model, device="cpu", num_blocks=8, **kw))
    with pytest.raises(Exception, match="(?i)not exist|no such|missing"):
        Engine(EngineConfig(model=model, device="cpu", num_blocks=8, kv_host_gib=0.001, kv_disk_gib=0.01,
                            kv_disk_dir=str(tmp_path / "nowhere")))


def test_a_request_aborted_while_its_blocks_load_releases_everything(model, block_bytes, tmp_path):
    from engine.request import Request
    a, = prompts(1, seed=4)
    want = reference(model, [a])[0]
    eng = tiered(model, block_bytes, tmp_path, host=8)
    try:
        run(eng, [a, a], "w")
        req = Request.new("h", a, GREEDY)
        eng.scheduler._update_hashes(req)
        host = eng.tiers.host.slots
        host.drop([s for s in (host.find(h) for h in req.block_hashes) if s is not None])   # on disk only
        eng.pool.reset_cache()
        for phase in range(3):          # aborted: while reading, once ready, after its copy started
            eng.add_request(EngineRequest(f"x{phase}", a, GREEDY))
            for _ in range(phase):
                eng.step()
            eng.abort_request(f"x{phase}")
            while eng.has_work:
                eng.step()
            eng.tiers.drain()
            assert not eng.scheduler.onboarding.waiting and not eng.scheduler.tier_busy
            assert eng.pool.num_free == eng.pool.num_blocks
            eng.pool.check_invariants()
            eng.tiers.host.slots.check_invariants()
            assert all(host.pins(s) == 0 for s in range(host.num_usable))
            eng.pool.reset_cache()
        assert run(eng, [a], "y") == [want]
    finally:
        eng.close()


def test_the_mock_engine_models_the_host_tier(model):
    """--mock with --kv-host-gib: real tier bookkeeping (hits, events), copies timed by the profile."""
    eng = Engine(EngineConfig(model=model, mock=True, num_blocks=8, kv_host_gib=40 * (2 << 20) / 2**30,
                              kv_onboard="always", max_model_len=4096))
    try:
        assert eng.tiers.host.num_slots == 40                     # 2 MiB blocks of the 8B profile
        a, f1, f2 = prompts(3, seed=5)
        run(eng, [a, f1, f2, a], "m")
        st = eng.stats()
        assert st.tiers.loaded_blocks[Tier.HOST] == 3
        assert st.tiers.path_seconds[next(p for p in st.tiers.path_seconds if p.value == "g2_to_g1")] \
            == pytest.approx(3 * (2 << 20) / 55e9, rel=0.01)
        assert len(dict(eng.tiers.snapshot())[Tier.HOST]) == 9    # A, F1, F2: what a router snapshot lists
    finally:
        eng.close()
    with pytest.raises(TierConfigError, match="holds no block"):       # less than one 2 MiB block
        Engine(EngineConfig(model=model, mock=True, num_blocks=8, kv_host_gib=0.1, kv_disk_gib=1 / 1024,
                            kv_disk_dir="/tmp"))


MOCK_BLOCK = 2 << 20                                     # the 8B profile's modelled block
DISK_BLOCK_S = 0.04                                      # modelled disk time of one block in these tests


def mock_tiered(model, disk_dir, profile, onboard="always") -> Engine:
    """A mock engine with a G1 of 8 blocks, a host tier of 4 modelled blocks and a disk of 64."""
    return Engine(EngineConfig(model=model, mock=True, num_blocks=8, kv_host_gib=4 * MOCK_BLOCK / 2**30,
                               kv_disk_gib=64 * MOCK_BLOCK / 2**30, kv_disk_dir=str(disk_dir), mock_profile=str(profile),
                               kv_onboard=onboard, max_model_len=4096))


def mock_profile(tmp_path, disk_gbps: float):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"curve": {}, "tiers": {"disk_gbps": disk_gbps}}))
    return path


def test_the_mock_engine_runs_the_disk_tier_in_modelled_time_and_finds_it_after_a_restart(model, tmp_path):
    """--mock with --kv-disk-gib: the real disk tier (slab files, index, admission) over the mock's
    slots. A prefix used twice is written back to disk once fillers push it out of G1 and host RAM;
    it comes back as a disk hit no sooner than the profile's disk needs for its 3 modelled blocks,
    while the step loop keeps stepping; a new mock engine on the same directory still finds it."""
    from kvstore.pools.tier_policy import TierPath
    profile = mock_profile(tmp_path, MOCK_BLOCK / DISK_BLOCK_S / 1e9)
    disk = tmp_path / "kv"
    disk.mkdir()
    a, f1, f2, f3 = prompts(4, seed=7)
    eng = mock_tiered(model, disk, profile)
    try:
        assert eng.tiers.disk.num_slots == 64
        run(eng, [a, a, f1, f2, f3], "m")
        assert eng.tiers.lookup(_hashes(a)) == [Tier.DISK] * 3          # on disk only, not in G1 or G2
        assert eng.pool.lookup(_hashes(a)) == []
        st = eng.stats().tiers
        assert st.path_seconds[TierPath.G2_TO_G3] >= 3 * DISK_BLOCK_S   # written back in modelled time
        assert st.blocks[Tier.DISK] == 3                                 # the fillers were seen once

        t0 = time.perf_counter()
        assert eng.add_request(EngineRequest("again", a, GREEDY)) is None
        steps, first_token_s = [], None
        while eng.has_work:
            s0 = time.perf_counter()
            outputs = eng.step().outputs
            steps.append(time.perf_counter() - s0)
            if outputs and first_token_s is None:
                first_token_s = time.perf_counter() - t0
        st = eng.stats().tiers
        assert st.loaded_blocks[Tier.DISK] == 3
        assert first_token_s >= 3 * DISK_BLOCK_S                         # not before the modelled read
        assert st.path_seconds[TierPath.G3_TO_G2] == pytest.approx(3 * DISK_BLOCK_S, rel=0.01)
        assert max(steps) < 1.5 * DISK_BLOCK_S                           # the read never held a step
    finally:
        eng.close()
    assert (disk / "index.sqlite").exists() and (disk / "slab-000000.kv").stat().st_size == 64 * MOCK_SLOT_BYTES

    eng = mock_tiered(model, disk, profile)                              # a restart: G1 and G2 empty
    try:
        assert eng.tiers.lookup(_hashes(a)) == [Tier.DISK] * 3
        run(eng, [a], "r")
        assert eng.stats().tiers.loaded_blocks[Tier.DISK] == 3
    finally:
        eng.close()


@pytest.mark.parametrize("disk_gbps, loads", [(1.3, False), (100.0, True)])
def test_the_mock_cost_model_weighs_the_profiles_disk_rate(model, tmp_path, disk_gbps, loads):
    """`auto` on the mock decides from the profile's disk rate scaled to its slots: a 1.3 GB/s disk
    (1.6 ms a 2 MiB block) loses to recomputing 16 tokens at the engine's first 20k tokens/s (0.8
    ms), a 100 GB/s one wins."""
    disk = tmp_path / "kv"
    disk.mkdir()
    a, f1, f2, f3 = prompts(4, seed=8)
    eng = mock_tiered(model, disk, mock_profile(tmp_path, disk_gbps), onboard="auto")
    try:
        run(eng, [a, a, f1, f2, f3], "m")
        assert eng.tiers.lookup(_hashes(a)) == [Tier.DISK] * 3
        run(eng, [a], "again")
        st = eng.stats().tiers
        assert (st.loaded_blocks[Tier.DISK], st.recomputed_blocks[Tier.DISK]) == ((3, 0) if loads else (0, 3))
    finally:
        eng.close()


def test_a_mock_profile_with_a_bad_disk_rate_is_refused(tmp_path):
    from perf.profile import load_tier_timing
    assert load_tier_timing(mock_profile(tmp_path, 2.5)).disk_gbps == 2.5
    assert load_tier_timing(None).disk_gbps == 1.3
    with pytest.raises(ValueError, match="bad tiers"):
        load_tier_timing(mock_profile(tmp_path, 0))


def test_offload_copies_nothing_while_g1_has_room_and_saves_what_eviction_would_lose(model, block_bytes, tmp_path):
    """G1 -> G2 offload ahead of eviction: a decode with room in G1 copies nothing; a long prompt
    arriving that eats through a finished request's cached blocks has them copied down before it
    reuses them (while it runs, not when the engine goes idle), and that request comes back as host
    hits with the same tokens."""
    from kvstore.pools.tier_policy import TierPath
    a, = prompts(1, seed=6)                                  # 4 blocks
    b = [7] * BLOCK                                          # 1 block + 60 outputs: 5 blocks
    c = [9] * (18 * BLOCK)                                   # 19 blocks: with B's, every block of G1
    eng = Engine(EngineConfig(model=model, device="cpu", num_blocks=24, max_num_batched_tokens=64,
                              kv_host_gib=32 * block_bytes / 2**30, kv_onboard="always", kv_host_copy="torch"))
    try:
        offloaded = lambda: eng.tiers.stats().path_bytes[TierPath.G1_TO_G2]   # noqa: E731
        eng.add_request(EngineRequest("a", a, GREEDY))
        eng.add_request(EngineRequest("b", b, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)))
        room_steps, copied_with_room, copied_under_way = 0, None, 0
        while eng.has_work:
            eng.step()
            running = [r.request_id for r in eng.scheduler.running]
            if running == ["b"] and copied_with_room is None:    # A done, B decoding, G1 has room
                room_steps += 1
                if room_steps == 20:
                    copied_with_room = offloaded()
                    eng.add_request(EngineRequest("c", c, GREEDY))
            if "b" in running:
                copied_under_way = offloaded()
        assert copied_with_room == 0
        assert copied_under_way >= 3 * block_bytes             # A's 3 full blocks, while B and C ran
        assert eng.pool.num_free == eng.pool.num_blocks
        eng.pool.check_invariants()
        eng.tiers.host.slots.check_invariants()
        assert eng.pool.lookup(_hashes(a)) == []              # C's blocks took A's place in G1 ...
        assert eng.tiers.lookup(_hashes(a)) == [Tier.HOST] * 3   # ... A's sit in G2 ...
        got = run(eng, [a], "again")
        assert eng.stats().tiers.loaded_blocks[Tier.HOST] == 3   # ... and A comes back from there
    finally:
        eng.close()
    assert got == reference(model, [a])


def _hashes(prompt: list[int]) -> list[int]:
    """The chained block hashes the scheduler gives this prompt."""
    from kvstore.hashing import block_hashes
    return block_hashes(prompt, BLOCK)


def _in_host_only(eng: Engine, prompt: list[int]) -> None:
    """The prompt's blocks leave G1 (they stay in G2)."""
    eng.pool.reset_cache()
    assert eng.tiers.lookup(_hashes(prompt)) == [Tier.HOST] * 3


def _steps_until_onboard(eng: Engine, rid: str) -> tuple:
    """Step until a plan carries onboard copies; returns it and `rid`'s tokens so far."""
    out, plans, schedule = [], [], eng.scheduler.schedule
    eng.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]     # keep each step's plan
    try:
        for _ in range(50):
            out += [t for o in eng.step().outputs if o.request_id == rid for t in o.new_token_ids]
            if plans and any(c.dst_tier == Tier.GPU for c in plans[-1].copies):
                return plans[-1], out
    finally:
        del eng.scheduler.schedule
    raise AssertionError("no onboard copy was planned")


def test_an_idle_engine_admits_a_loaded_prefix_in_the_step_that_queues_its_copy(model, block_bytes, tmp_path):
    """With an ordered mover (torch) and nothing running, the request runs in the copy's step (the
    compute stream waits for the copy); with a request running, it waits for the copy to land and
    the running one's step is not held up. Same tokens either way, and with the mover treated as
    unordered (NIXL's case)."""
    a, = prompts(1, seed=7)
    want = reference(model, [a])[0]
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for ordered in (True, False):
        eng = tiered(model, block_bytes, tmp_path / f"o{ordered}", g1=16, disk=0)
        try:
            assert eng.scheduler.onboarding.ordered is True        # the CPU torch mover copies in order
            eng.scheduler.onboarding.ordered = ordered
            run(eng, [a], "first")
            _in_host_only(eng, a)
            eng.add_request(EngineRequest("idle", a, GREEDY))
            plan, out = _steps_until_onboard(eng, "idle")
            assert plan.wait_onboard is ordered
            assert ("idle" in [r.request_id for r in plan.rows]) is ordered
            while eng.has_work:
                out += [t for o in eng.step().outputs if o.request_id == "idle" for t in o.new_token_ids]
            assert out == want

            _in_host_only(eng, a)
            eng.add_request(EngineRequest("busy", [5] * 20, long))
            eng.step()
            eng.add_request(EngineRequest("loaded", a, GREEDY))
            plan, out = _steps_until_onboard(eng, "loaded")
            assert not plan.wait_onboard and [r.request_id for r in plan.rows] == ["busy"]
            while eng.has_work:
                out += [t for o in eng.step().outputs if o.request_id == "loaded" for t in o.new_token_ids]
            assert out == want
            assert eng.stats().tiers.loaded_blocks[Tier.HOST] == 6
            assert eng.pool.num_free == eng.pool.num_blocks
            eng.pool.check_invariants()
            eng.tiers.host.slots.check_invariants()
        finally:
            eng.close()


def test_an_onboard_that_fails_after_its_request_was_admitted_fails_the_step_and_empties_g1(model, block_bytes,
                                                                                             tmp_path):
    """Admitted on its copy, the request would read blocks the copy never wrote: the step fails,
    G1 forgets its prefixes (none may be served from those blocks), and the next request computes."""
    from kvstore.movers.host_copy import HostCopyError
    a, = prompts(1, seed=8)
    want = reference(model, [a])[0]
    eng = tiered(model, block_bytes, tmp_path, g1=16, disk=0)
    try:
        run(eng, [a], "first")
        _in_host_only(eng, a)
        mover = eng.tier_io.mover
        real = mover.onboard

        def broken(slots, blocks):
            mover.onboard = real                 # fails once
            raise RuntimeError("injected: the copy could not be queued")
        mover.onboard = broken
        eng.add_request(EngineRequest("x", a, GREEDY))
        with pytest.raises(HostCopyError, match="onboarding 3 blocks failed"):
            for _ in range(50):
                eng.step()
        assert eng.tier_io.copy_errors == 1 and eng.pool.num_cached() == 0
        eng.abort_request("x")                   # what the engine loop does to a failed step's requests
        while eng.has_work:
            eng.step()
        assert eng.pool.num_free == eng.pool.num_blocks
        eng.pool.check_invariants()
        assert all(eng.tiers.host.slots.pins(s) == 0 for s in range(eng.tiers.host.slots.num_usable))
        assert run(eng, [a], "after") == [want]
    finally:
        eng.close()

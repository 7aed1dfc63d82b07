"""The routing bench's pieces: the pooled-cache oracle, the multi-turn workload, the simulator."""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytest

from kvstore.hashing import block_hashes
from router import RouterConfig, RoutingPolicy
from perf.profile import CurveTiming
from splitserve.bench import replay, routesim
from sim.oracle import OracleTier, PooledCacheOracle
from sim.route.simulator import SimConfig, Simulation
from sim.route.worker import SimRequest
from splitserve.bench.workloads import BenchInputError
from splitserve.bench.sessions import AzureRow, session_specs

BS = 4


def toks(*parts: tuple[int, int]) -> list[int]:
    """A prompt of segments (seed, length): equal seeds give equal tokens."""
    return [t for seed, n in parts for t in np.random.default_rng(seed).integers(0, 1000, n).tolist()]


def observe(o: PooledCacheOracle, prompt: list[int]) -> list[int]:
    return o.observe(block_hashes(prompt, BS), len(prompt))


def test_oracle_counts_leading_hits_capped_so_the_last_token_is_computed():
    o = PooledCacheOracle.for_fleet(BS, num_workers=2, blocks_per_worker=8)
    a = toks((1, 16))
    assert observe(o, a) == [0]
    assert observe(o, a) == [12]                       # 4 blocks held, the last token recomputed
    assert observe(o, a[:8] + toks((2, 8))) == [8]     # a shared head only
    assert observe(o, toks((3, 4)) + a[4:]) == [0]     # a different first block: nothing
    assert o.totals.prompt_tokens == 64 and o.totals.hit_tokens == [20]


def test_oracle_is_one_lru_of_the_fleets_capacity():
    o = PooledCacheOracle.for_fleet(BS, num_workers=2, blocks_per_worker=4)   # 8 blocks in all
    a, b, c = toks((1, 16)), toks((2, 16)), toks((3, 16))
    observe(o, a)
    observe(o, b)                      # 8 blocks: both fit the pool (neither fits a worker twice)
    assert observe(o, a) == [12]
    observe(o, c)                      # evicts b, the least recently used
    assert observe(o, b) == [0]
    assert o.totals.unbounded_hit_rate() > o.totals.hit_rate()


def test_oracle_tiers_demote_instead_of_dropping():
    o = PooledCacheOracle(BS, [OracleTier("gpu", 4), OracleTier("host", 8)])
    a, b = toks((1, 16)), toks((2, 16))
    observe(o, a)
    observe(o, b)                      # a goes down to host
    assert observe(o, a) == [0, 12]
    assert o.summary()["oracle_hit_rate_by_tier"]["host"] > 0


def test_sessions_keep_the_traces_arrivals_and_lengths_and_grow_each_context():
    rows = [AzureRow(t, n, 20) for t, n in [(0, 300), (1, 200), (10, 700), (12, 900), (30, 1500)]]
    specs, facts = session_specs(rows, vocab_size=1000, seed=3)
    assert [s.arrival_s for s in specs] == [r.arrival_s for r in rows]
    assert [(s.prompt_len, s.max_tokens) for s in specs] == [(r.context_tokens, 20) for r in rows]
    prompts = {}
    continued = 0
    for s in specs:
        p = s.make_prompt()
        assert len(p) == s.prompt_len
        last = prompts.get(s.cache_key)
        if last is not None:                # a later turn starts with the whole last prompt
            assert np.array_equal(p[: len(last)], last)
            continued += 1
        prompts[s.cache_key] = p
    assert continued == sum(1 for s in specs) - facts["sessions"] and continued >= 1


def replay_args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    replay.add_arguments(p)
    args = p.parse_args([])
    for k, v in kw.items():
        setattr(args, k.replace("-", "_"), v)
    return args


def test_offered_util_sets_the_arrival_compression():
    args = replay_args(workload="shared-prefix", num_requests=50, prefix_len=256, tail_len=64,
                       offered_util=0.5, workers=2)
    specs, workload = replay.make_specs(args)
    assert replay.offered_prefill_util(specs, args) == pytest.approx(0.5, abs=0.01)
    assert workload["speedup"] > 0
    with pytest.raises(BenchInputError):
        replay.make_specs(replay_args(workload="shared-prefix", offered_util=-1))
    with pytest.raises(BenchInputError):
        replay.make_specs(replay_args(workload="sessions"))     # no --azure-trace


def test_replay_gives_each_policys_mock_workers_a_fresh_disk_tier(tmp_path):
    """--kv-disk-gib/--kv-disk-dir reach `serve` (which gives each worker its own subdirectory), in
    a directory of its own per policy, gone after the run; inconsistent flags are input errors."""
    from splitserve.cli import build_parser
    args = replay_args(kv_host_gib=1.0, kv_disk_gib=4.0, kv_disk_dir=str(tmp_path))
    replay.check_tier_args(args)
    with replay.disk_dir_for(args, "kv") as d1, replay.disk_dir_for(args, "kv") as d2:
        assert d1 != d2 and os.path.dirname(d1) == str(tmp_path) and os.listdir(d1) == []
        argv = replay.serve_argv(args, "kv", "redis://x", "ns", 1, 2, d1)
        ns = vars(build_parser().parse_args(argv))
        assert [ns[f"engine.{k}"] for k in ("kv_disk_gib", "kv_disk_dir", "kv_host_gib", "mock")] == [4.0, d1, 1.0, True]
    assert os.listdir(tmp_path) == []
    with replay.disk_dir_for(replay_args(), "kv") as none:
        assert none is None and "--kv-disk-dir" not in replay.serve_argv(replay_args(), "kv", "r", "n", 1, 2, none)
    for bad in ({"kv_disk_gib": 4.0}, {"kv_disk_dir": str(tmp_path)},
                {"kv_disk_gib": 4.0, "kv_disk_dir": str(tmp_path)},                  # no host tier
                {"kv_host_gib": 1.0, "kv_disk_gib": 4.0, "kv_disk_dir": str(tmp_path / "missing")},
                {"kv_host_gib": -1.0}):
        with pytest.raises(BenchInputError):
            replay.check_tier_args(replay_args(**bad))


def test_replay_oracle_fields_match_the_oracle_and_exclude_refused_requests():
    args = replay_args(workload="shared-prefix", num_requests=20, prefix_len=256, tail_len=64,
                       workers=2, num_blocks=1000)
    specs, _ = replay.make_specs(args)
    fields = replay.oracle_fields(specs, args)
    # 20 prompts share 256 tokens: every prompt but the first hits them all
    assert fields["oracle_hit_rate"] == pytest.approx(19 * 256 / (20 * 320), abs=1e-4)
    args.max_model_len = 300                 # now the server refuses them all
    assert replay.oracle_fields(specs, args)["oracle_hit_rate"] == 0
    assert replay.share_of_oracle(0.1, 0.2) == 0.5 and replay.share_of_oracle(0.1, 0.0) is None


def test_simulated_kv_routing_reuses_what_round_robin_cannot():
    rng = np.random.default_rng(0)
    system = [rng.integers(0, 1000, 512) for _ in range(8)]   # 32 blocks each
    reqs = []
    for i in range(160):
        p = np.concatenate([system[int(rng.integers(8))], rng.integers(0, 1000, 128)])
        reqs.append(SimRequest(i, i * 0.01, len(p), 4, block_hashes(p, 16), prompt=p))
    cfg = SimConfig(workers=4, num_blocks=100)   # a worker holds 2 or 3 of them, the fleet all
    out = {}
    for name in ("kv", "round_robin"):
        fields, _ = routesim.VARIANTS[name]
        sim = Simulation(cfg, RouterConfig(**fields), reqs, CurveTiming())
        out[name] = sim.run()
        assert out[name]["unfinished"] == 0 and out[name]["errors"] == 0
        assert out[name]["oracle_hit_rate"] == pytest.approx(out["kv"]["oracle_hit_rate"])
    assert out["kv"]["oracle_share"] > 0.85 > out["round_robin"]["oracle_share"] + 0.3
    assert out["kv"]["prefix_hit_rate"] <= out["kv"]["oracle_unbounded_hit_rate"]


def test_routesim_variants_are_valid_router_configs():
    for name, (fields, _) in routesim.VARIANTS.items():
        assert isinstance(RouterConfig(**fields).policy, RoutingPolicy), name


def test_simulated_frontends_route_together_and_keep_most_of_the_reuse():
    rng = np.random.default_rng(0)
    system = [rng.integers(0, 1000, 512) for _ in range(8)]
    reqs = []
    for i in range(160):
        p = np.concatenate([system[int(rng.integers(8))], rng.integers(0, 1000, 128)])
        reqs.append(SimRequest(i, i * 0.01, len(p), 4, block_hashes(p, 16), prompt=p))
    out = {}
    for n in (1, 2):
        sim = Simulation(SimConfig(workers=4, num_blocks=100, frontends=n, report_interval_s=0.05),
                         RouterConfig(), reqs, CurveTiming())
        out[n] = sim.run()
        assert out[n]["unfinished"] == 0 and out[n]["errors"] == 0
        assert len(sim.routers) == n
    # each router sees the others' queued prompts only through reports: on this tight cache (a worker
    # holds 2-3 of the 8 system prompts) two routers keep ~93% of one's reuse, far above round robin
    assert out[2]["oracle_share"] >= 0.9 * out[1]["oracle_share"]

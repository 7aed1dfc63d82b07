"""The load-or-recompute cost model (kvstore/pools/tier_policy.py): its decisions and counters."""

from __future__ import annotations

import statistics

import pytest

from kvstore.events import Tier
from kvstore.pools.tier_policy import (LatencyMeter, OnboardCounters, OnboardMode, PathRate, PrefillSpeed, RateMeter,
                                 TierRates, decide_onboard)

H, D = Tier.HOST, Tier.DISK
MIB2 = 2 << 20                                  # an 8B bf16 block: 16 tokens x 128 KiB
BS = 16
H100 = TierRates(g2_to_g1=PathRate(55e9, 20e-6), g3_to_g2=PathRate(1.3e9, 200e-6))
PREFILL_8B = PrefillSpeed(40_000)               # tokens/s, no attention term


def decide(hit, first=0, rates=H100, prefill=PREFILL_8B, mode=OnboardMode.AUTO):
    return decide_onboard(hit, first, MIB2, BS, rates, prefill, mode)


def test_a_host_hit_is_loaded_and_predicted_about_ten_times_faster():
    d = decide([H] * 512)                        # an 8k-token prefix in host RAM
    assert d.num_load == 512 and d.num_host == 512
    assert d.recompute_s == pytest.approx(512 * 16 / 40_000)
    assert d.recompute_s / d.load_s > 8          # the G2 goal, as the model predicts it


def test_a_slow_disk_hit_is_recomputed_when_prefill_is_fast():
    d = decide([D] * 512)
    assert d.num_load == 0 and d.load_s == 0.0


def test_the_disk_pays_once_prefill_slows_with_context():
    slow = PrefillSpeed(40_000, attn_pair_s=1.3e-9)     # perf/profile.py's H100 curve
    early = decide([D] * 64, first=0, prefill=slow)
    mid = decide([D] * 64, first=2048, prefill=slow)    # from 32k tokens: 1.1 ms to recompute a block
    late = decide([D] * 64, first=4096, prefill=slow)   # from 64k tokens: 1.8 ms, vs 1.65 ms to load
    assert early.num_load == 0 and mid.num_load == 0 and late.num_load == 64


def test_host_blocks_then_disk_blocks_load_the_host_part_only():
    d = decide([H] * 100 + [D] * 100)
    assert d.num_load == 100 and d.num_disk == 0


def test_a_fast_disk_is_worth_loading():
    nvme = TierRates(PathRate(55e9, 20e-6), PathRate(25e9, 100e-6))
    d = decide([H] * 10 + [D] * 100, rates=nvme)
    assert d.num_load == 110 and d.num_disk == 100


def test_a_tiny_hit_is_not_worth_a_transfers_latency():
    lat = TierRates(PathRate(55e9, 5e-3), None)  # 5 ms to start a copy
    assert decide([H], rates=lat).num_load == 0
    assert decide([H] * 200, rates=lat).num_load == 200


def test_a_per_load_latency_turns_a_load_that_bandwidth_favours_into_a_recompute():
    # the H100's fp8 1k-token case: 64 blocks of 1 MiB, read at 3 GB/s (the page cache), recomputed
    # in 25.6 ms; by bandwidth 23.6 ms to load, but a load from disk took 63 ms end to end
    page_cache = TierRates(PathRate(55e9, 20e-6), PathRate(3e9, 200e-6))
    by_bandwidth = decide_onboard([D] * 64, 0, 1 << 20, BS, page_cache, PREFILL_8B, OnboardMode.AUTO)
    assert by_bandwidth.num_load == 64 and by_bandwidth.load_s < by_bandwidth.recompute_s
    measured = TierRates(PathRate(55e9, 20e-6), PathRate(3e9, 200e-6), host_load_s=20e-6, disk_load_s=40e-3)
    d = decide_onboard([D] * 64, 0, 1 << 20, BS, measured, PREFILL_8B, OnboardMode.AUTO)
    assert d.num_load == 0
    # the latency is per load, not per block: a long enough hit still pays it off
    assert decide_onboard([D] * 4096, 0, 1 << 20, BS, measured, PREFILL_8B, OnboardMode.AUTO).num_load == 4096
    # and a host hit pays the host tier's latency only
    assert decide_onboard([H] * 64, 0, 1 << 20, BS, measured, PREFILL_8B, OnboardMode.AUTO).num_load == 64


def test_a_latency_meter_keeps_its_seed_until_loads_are_measured():
    m = LatencyMeter(0.0)
    m.seed(1e-3)
    assert m.seconds == 1e-3
    for _ in range(20):
        m.observe(wall_s=0.05, bandwidth_s=0.01)  # 40 ms beyond what the bandwidth explains
    m.seed(1e-3)                                   # a later probe does not undo measurements
    assert m.seconds == pytest.approx(0.04, rel=0.01) and m.samples == 20
    m.observe(wall_s=0.01, bandwidth_s=0.02)       # faster than the bandwidth predicts: no negative cost
    assert m.seconds >= 0.0


def test_always_loads_every_hit():
    d = decide([D] * 10 + [H] * 3, mode=OnboardMode.ALWAYS)
    assert d.num_load == 13 and (d.num_host, d.num_disk) == (3, 10)


def test_counters_count_both_choices_in_blocks_per_tier():
    c = OnboardCounters()
    hit = [H] * 4 + [D] * 6
    c.count(hit, decide(hit))                    # loads the 4 host blocks, recomputes 6 disk ones
    c.count([D] * 2, decide([D] * 2))
    assert c.loaded == {H: 4, D: 0} and c.recomputed == {H: 0, D: 8}
    assert (c.requests_loaded, c.requests_recomputed) == (1, 1)


def test_a_rate_meter_follows_observed_transfers_and_keeps_totals():
    m = RateMeter(PathRate(1e9))
    for _ in range(30):
        m.observe(10 << 20, (10 << 20) / 4e9)     # transfers at 4 GB/s
    m.observe(4096, 1.0)                          # small: latency, counted but not fitted
    assert m.rate.bytes_per_s == pytest.approx(4e9, rel=0.01)
    assert m.count == 31 and m.total_bytes == 30 * (10 << 20) + 4096


def test_the_prefill_meter_reports_what_one_more_token_costs_not_the_mean_rate():
    """Steps cost a + b * tokens (the H100 8B: ~11 ms + 27 us a token). A loaded prefix saves
    only b per token; the mean rate of 1k-token steps (half of 1/b) made a 1k-token disk hit look
    cheaper to load than to recompute."""
    from engine.kv_tiers import PrefillMeter
    a, b = 0.011, 27e-6
    m = PrefillMeter(40_000)
    for _ in range(5):                                   # alike steps: no slope yet, the mean rate
        speed = m.observe(1024, a + b * 1024)
    assert speed.tokens_per_s == pytest.approx(1024 / (a + b * 1024))
    for n in (8192, 2048, 4096, 1024, 8192, 512):
        speed = m.observe(n, a + b * n)
    assert speed.tokens_per_s == pytest.approx(1 / b, rel=0.02)
    assert m.observe(10, 1.0) is None                    # too small to be a prefill step
    # with the marginal speed, 64 blocks (1k tokens, 2 MiB each) from a 2.1 GB/s disk lose to recomputing
    rates = TierRates(PathRate(38.9e9), PathRate(2.1e9))
    hit = [Tier.DISK] * 64
    assert decide_onboard(hit, 0, 2 << 20, 16, rates, speed, OnboardMode.AUTO).num_load == 0
    mean = PrefillSpeed(13_246)        # the mean rate the H100 meter held then (ae45720's record) loaded it
    assert decide_onboard(hit, 0, 2 << 20, 16, rates, mean, OnboardMode.AUTO).num_load == 64


def test_the_prefill_meter_is_not_moved_by_a_step_that_compiled_kernels():
    """The H100 fp8 run's first prefill also built FlashInfer's fp8 kernels (seconds): one such
    step must not drag the speed down for the decisions after it."""
    from engine.kv_tiers import PrefillMeter
    a, b = 0.011, 27e-6
    m = PrefillMeter(40_000)
    m.observe(1024, 5.0)                                 # the step that compiled
    for n in (1024, 64, 1024, 512, 1024):
        speed = m.observe(n, a + b * n)
    assert speed.tokens_per_s == pytest.approx(1 / b, rel=0.02)


def test_the_prefill_meter_takes_the_faster_of_its_first_two_steps():
    """A fresh engine's first prefill may also compile kernels: with two steps seen, the rate is not
    their mean (half the true rate) but the faster one's, so a first short disk hit is recomputed."""
    from engine.kv_tiers import PrefillMeter
    m = PrefillMeter(40_000)
    m.observe(512, 4.0)                                  # warm-up step that compiled
    speed = m.observe(1024, 0.038)
    assert speed.tokens_per_s == pytest.approx(1024 / 0.038)
    rates = TierRates(PathRate(38.9e9), PathRate(1.9e9))
    assert decide_onboard([Tier.DISK] * 64, 0, 2 << 20, 16, rates, speed, OnboardMode.AUTO).num_load == 0


def test_the_prefill_meter_keeps_the_median_rate_when_the_fit_is_not_a_cost():
    from engine.kv_tiers import PrefillMeter
    m = PrefillMeter(40_000)
    for n, t in ((1024, 0.05), (8192, 0.04), (2048, 0.05), (4096, 0.045)):   # bigger steps faster: noise
        speed = m.observe(n, t)
    assert speed.tokens_per_s == pytest.approx(statistics.median([1024 / 0.05, 8192 / 0.04, 2048 / 0.05, 4096 / 0.045]))

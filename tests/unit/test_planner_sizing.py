"""Pool sizing: the queueing formulas against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.sizing import (DecodeWorkload, decode_attainment, decode_batch, decode_batch_cap, erlang_c,
                            prefill_attainment, prefill_wait, size_decode, size_prefill)
from runtime.profile import CurveTiming


def test_erlang_c_matches_hand_values():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)             # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)           # (a^2/2 * 2) / (1 + 1 + 1)
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(3, 0.0) == 0.0
    assert erlang_c(400, 300.0) < erlang_c(400, 390.0) < 1


def test_mm1_wait_and_the_prefill_tail():
    service = np.full(1000, 0.1)                              # deterministic: cs2 = 0
    p_wait, wait = prefill_wait(1, 5.0, service, burst=1.0)   # M/D/1 = M/M/1 * (1 + 0) / 2
    assert p_wait == pytest.approx(0.5)
    assert wait == pytest.approx(0.5 / (10 - 5) / 2)
    s = prefill_attainment(1, 5.0, service, target_s=1.0)
    assert s.attainment == pytest.approx(1 - 0.5 * math.exp(-0.9 * 0.5 / wait))
    assert s.utilization == pytest.approx(0.5)
    assert prefill_attainment(1, 10.0, service, 1.0).attainment == 0.0     # unstable


def test_size_prefill_is_the_least_count_that_reaches_the_goal():
    rng = np.random.default_rng(0)
    service = rng.lognormal(np.log(0.05), 0.8, 4000)
    for rate, burst in ((50.0, 1.0), (200.0, 1.0), (200.0, 8.0)):
        s = size_prefill(rate, service, 2.0, 0.995, burst)
        assert s.attainment >= 0.995 * (service < 2.0).mean()
        below = prefill_attainment(s.workers - 1, rate, service, 2.0, burst)
        assert below.attainment < 0.995 * (service < 2.0).mean()
    assert size_prefill(200.0, service, 2.0, 0.995, 8.0).workers > size_prefill(200.0, service, 2.0, 0.995).workers
    assert size_prefill(0.0, service, 2.0, 0.995).workers == 0


def test_requests_that_cannot_meet_the_target_do_not_make_the_pool_grow_forever():
    service = np.array([0.1] * 90 + [5.0] * 10)               # 10% take longer than the target alone
    s = size_prefill(5.0, service, 2.0, 0.99, max_workers=64)
    assert s.workers < 64 and s.attainment <= 0.9


def test_decode_batch_cap_and_fixed_point_on_the_linear_curve():
    curve = CurveTiming()
    step = curve.decode_step_s
    cap, limit = decode_batch_cap(step, 2000.0, 0.05, 256, 450_000, 1500.0)
    # f(B) = 7 ms + B (40 us + 44 ns * 2000) = 7 ms + 128 us B <= 50 ms  ->  B <= 335 > 256
    assert (cap, limit) == (256, "max_num_seqs")
    assert decode_batch_cap(step, 2000.0, 0.02, 256, 450_000, 1500.0) == (101, "itl")
    assert decode_batch_cap(step, 2000.0, 0.05, 256, 450_000, 2100.0) == (214, "kv")   # 450k / 2100
    assert decode_batch_cap(step, 20000.0, 0.05, 256, 450_000, 21000.0) == (21, "kv")
    wl = DecodeWorkload(np.full(100, 199.0), 2000.0, 2100.0)  # L = 199 steps
    b = decode_batch(2, 10.0, wl, step, ceiling=1e9)
    # B = lam L (a + b B) / D  ->  B = lam L a / (D - lam L b)
    k = 10.0 * 199
    assert b == pytest.approx(k * 0.007 / (2 - k * 128e-6), rel=1e-3)


def test_decode_attainment_absorbs_waits_in_the_mean_itl():
    step = CurveTiming().decode_step_s
    wl = DecodeWorkload.from_lengths(np.full(1000, 1000.0), np.full(1000, 200.0))
    cap, limit = decode_batch_cap(step, wl.context, 0.05, 256, 450_000, wl.reserved)
    low = decode_attainment(2, 20.0, wl, step, 0.05, cap, limit)
    assert low.attainment == pytest.approx(1.0) and low.itl_s < 0.05
    full = decode_attainment(1, 60.0, wl, step, 0.05, cap, limit)       # more than 256 sequences
    assert full.attainment == 0.0 and math.isinf(full.batch)
    s = size_decode(60.0, wl, step, 0.05, 0.995)
    assert s.attainment >= 0.995
    assert decode_attainment(s.workers - 1, 60.0, wl, step, 0.05, s.batch_cap, s.limit).attainment < 0.995

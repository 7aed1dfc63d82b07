"""Pool sizing: the queueing formulas against values worked out by hand, and the queue with
patience against its closed form and a simulated queue."""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.sizing import (DecodeWorkload, deadline_miss, decode_attainment, decode_batch, decode_batch_cap,
                            erlang_c, prefill_attainment, prefill_attainment_deadline, prefill_wait, size_decode,
                            size_prefill)
from perf.profile import CurveTiming


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


def test_deadline_miss_is_erlang_a_with_fixed_patience():
    # M/M/1 with patience tau: the virtual wait's density is p0 lam e^((lam - mu) v) below tau and
    # p0 lam e^(lam tau - mu v) above it, with p0 the idle probability; an arrival misses above tau
    lam, mu, tau = 0.5, 1.0, 2.0
    below = lam * math.expm1((lam - mu) * tau) / (lam - mu)
    above = lam / mu * math.exp((lam - mu) * tau)
    assert deadline_miss(1, lam, 1 / mu, np.full(7, tau)) == pytest.approx(above / (1 + below + above))
    # M/M/2 at a = 2 (the exponent vanishes): idle states 1 + a = 3, pi(1) = a = 2, the part
    # below tau is lam tau = 2 and above it lam / (c mu) = 1: miss = 2 * 1 / (3 + 2 * (2 + 1))
    assert deadline_miss(2, 2.0, 1.0, np.full(3, 1.0)) == pytest.approx(2 / 9)
    assert deadline_miss(0, 1.0, 1.0, np.ones(3)) == 1.0 and deadline_miss(3, 0.0, 1.0, np.ones(3)) == 0.0
    # overloaded, it stays finite: the misses carry the excess (at 4x capacity at least 3/4 miss)
    assert 0.75 <= deadline_miss(1, 4.0, 1.0, np.full(5, 0.5)) < 1.0


def test_deadline_miss_matches_a_simulated_queue_with_patience():
    """c FIFO servers; an arrival that could not start within its patience (drawn from a spread
    sample) leaves without using a server: the queue the deadline order approximates."""
    rng = np.random.default_rng(0)
    patience = np.linspace(0.05, 0.6, 40)
    c, mean_s, n = 4, 0.03, 200_000
    for rate in (110.0, 130.0, 150.0):        # utilization 0.83, 0.98, 1.13
        arrive = np.cumsum(rng.exponential(1 / rate, n))
        service = rng.exponential(mean_s, n)
        limit = rng.choice(patience, n)
        free = np.zeros(c)
        missed = 0
        for t, s, p in zip(arrive, service, limit):
            k = int(np.argmin(free))
            start = max(t, free[k])
            if start - t > p:
                missed += 1
            else:
                free[k] = start + s
        assert deadline_miss(c, rate, mean_s, patience) == pytest.approx(missed / n, rel=0.15, abs=2e-3)


def test_deadline_order_attainment_grows_with_workers_and_beats_fifo_near_capacity():
    service = np.random.default_rng(1).gamma(2.0, 0.015, 4096)          # mean 30 ms, cs2 0.5
    rate = 3.8 / 0.03                                                    # 3.8 workers' worth
    fifo = [prefill_attainment(c, rate, service, 2.0, burst=8.0).attainment for c in (4, 5, 6)]
    dl = [prefill_attainment_deadline(c, rate, service, 2.0, burst=8.0).attainment for c in (3, 4, 5, 6)]
    assert dl == sorted(dl) and dl[0] < 0.9 < 0.995 < dl[1]     # 3 workers overloaded; 4 enough
    assert fifo[0] < 0.99 < dl[1]                                # FIFO at 4: the queue's whole tail misses
    assert size_prefill(rate, service, 2.0, 0.995, burst=8.0, deadline=True).workers < \
        size_prefill(rate, service, 2.0, 0.995, burst=8.0).workers


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
    cap, limit = decode_batch_cap(step, 2000.0, 0.05, 256)
    # f(B) = 7 ms + B (40 us + 44 ns * 2000) = 7 ms + 128 us B <= 50 ms  ->  B <= 335 > 256
    assert (cap, limit) == (256, "max_num_seqs")
    assert decode_batch_cap(step, 2000.0, 0.02, 256) == (101, "itl")
    wl = DecodeWorkload.from_lengths(np.full(100, 1900.0), np.full(100, 200.0))   # L = 199 steps
    b = decode_batch(2, 10.0, wl, step, ceiling=1e9)
    # B = lam L (a + b B) / D  ->  B = lam L a / (D - lam L b), at the step-weighted context 2000
    assert wl.context == pytest.approx(2000.0)
    k = 10.0 * 199
    assert b == pytest.approx(k * 0.007 / (2 - k * 128e-6), rel=1e-3)


def test_a_wait_for_a_decode_worker_delays_the_first_token():
    """A decode worker admits a request before its prefill, so a full pool makes requests wait
    before their first token: they meet the TTFT target only if the wait fits their slack."""
    step = CurveTiming().decode_step_s
    n = 1000
    wl = DecodeWorkload.from_lengths(np.full(n, 1000.0), np.full(n, 200.0), np.full(n, 0.3), 1.7)
    cap, limit = decode_batch_cap(step, wl.context, 0.05, 256)
    low = decode_attainment(2, 20.0, wl, step, 0.05, cap, limit, kv_capacity=450_000)
    assert low.attainment == pytest.approx(1.0) and low.itl_s < 0.05
    full = decode_attainment(1, 60.0, wl, step, 0.05, cap, limit, kv_capacity=450_000)   # > 256 sequences
    assert full.attainment == 0.0 and math.isinf(full.batch)
    s = size_decode(60.0, wl, step, 0.05, 0.995, kv_tokens=450_000)
    assert s.attainment >= 0.995
    assert decode_attainment(s.workers - 1, 60.0, wl, step, 0.05, s.batch_cap, s.limit,
                             kv_capacity=450_000).attainment < 0.995
    # eight sequences a worker: at 4 req/s one worker keeps 1.7 s of slack, not 0.2 s
    loose = size_decode(4.0, wl, step, 0.05, 0.995, max_num_seqs=8, kv_tokens=450_000)
    tight = DecodeWorkload.from_lengths(np.full(n, 1000.0), np.full(n, 200.0), np.full(n, 0.3), 0.2)
    assert (loose.workers, size_decode(4.0, tight, step, 0.05, 0.995, max_num_seqs=8).workers) == (1, 2)
    none = DecodeWorkload.from_lengths(np.full(n, 1000.0), np.full(n, 200.0), np.full(n, 0.3), -0.1)
    assert size_decode(60.0, none, step, 0.05, 0.995).attainment == 0.0   # no slack: nothing to size for


def test_the_kv_held_through_the_prefill_bounds_the_decode_pool():
    """Long prompts with short outputs: the KV a request holds from its admission through its
    prefill, not the batch, decides how many decode workers it takes."""
    step = CurveTiming().decode_step_s
    n = 1000
    short_hold = DecodeWorkload.from_lengths(np.full(n, 8000.0), np.full(n, 20.0), np.full(n, 0.2), 1.5)
    long_hold = DecodeWorkload.from_lengths(np.full(n, 8000.0), np.full(n, 20.0), np.full(n, 2.0), 1.5)
    a = size_decode(40.0, short_hold, step, 0.05, 0.995, kv_tokens=450_000)
    b = size_decode(40.0, long_hold, step, 0.05, 0.995, kv_tokens=450_000)
    assert b.limit == "kv" and b.workers > a.workers
    # 40 req/s x 2.3 s held x 8,020 tokens = 738k tokens in flight: more than one worker's 450k
    assert b.workers >= 2

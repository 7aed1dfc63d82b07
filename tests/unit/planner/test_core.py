"""The planner core in closed loop with a make-believe pool: what an operator would notice
(oscillation, limits, corrections, scale-down while starting, reasons), on the CPU in seconds."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from planner import (Bound, DecodeStats, Observation, Planner, PlannerConfig, PoolLimits, PoolState,
                     PrefillRecord, RequestSample)
from perf.profile import CURVE_PROFILE_PATH, load_profile

INTERVAL = 30.0
# The analytic H100 curve, not the default profile: the loads below are chosen to cross its pools'
# step boundaries, and a re-measured default must not move them.
PROFILE = load_profile(CURVE_PROFILE_PATH)


def config(**kw) -> PlannerConfig:
    base = dict(ttft_target_s=2.0, itl_target_s=0.05, interval_s=INTERVAL,
                prefill=PoolLimits(1, 64), decode=PoolLimits(1, 64))
    return PlannerConfig(**(base | kw))


def arrivals(rng, now: float, rate: float) -> tuple[RequestSample, ...]:
    n = rng.poisson(rate * INTERVAL)
    times = np.sort(rng.uniform(now - INTERVAL, now, n))
    prompt = np.clip(rng.lognormal(np.log(1000), 0.7, n), 16, 16000).astype(int)
    output = np.clip(rng.lognormal(np.log(200), 0.7, n), 2, 2000).astype(int)
    return tuple(RequestSample(float(t), int(p), int(o)) for t, p, o in zip(times, prompt, output))


def observe(now: float, reqs, prefill: PoolState, decode: PoolState, **kw) -> Observation:
    return Observation(now, INTERVAL, len(reqs), prefill, decode, reqs, **kw)


def closed_loop(planner: Planner, rates, seed: int = 0, starting_decode: int = 0):
    """Run the planner against pools that become what it asks at once; returns the decisions."""
    rng = np.random.default_rng(seed)
    p, d = 0, 0
    out = []
    for k, rate in enumerate(rates):
        now = (k + 1) * INTERVAL
        dec = planner.decide(observe(now, arrivals(rng, now, rate), PoolState(p), PoolState(d, starting_decode)))
        p, d = dec.desired_prefill, dec.desired_decode - starting_decode
        out.append(dec)
    return out


def reversals(sizes: list[int]) -> int:
    steps = [b - a for a, b in zip(sizes, sizes[1:]) if b != a]
    return sum(1 for a, b in zip(steps, steps[1:]) if (a > 0) != (b > 0))


@pytest.mark.parametrize("level", [25.0, 40.0, 55.0, 85.0])
def test_no_oscillation_when_the_load_sits_still(level):
    """Levels every 15 req/s cross several step boundaries of both pools; Poisson noise around each
    must never make a pool go up and down again."""
    decisions = closed_loop(Planner(config(), PROFILE), [level] * 30, seed=int(level))
    for pool in ("prefill", "decode"):
        sizes = [getattr(d, pool).desired for d in decisions[1:]]
        assert reversals(sizes) == 0, (pool, sizes)


def test_no_oscillation_exactly_at_a_step_boundary():
    """Find a load where the prefill requirement flips between N and N+1, then sit on it."""
    rng = np.random.default_rng(7)
    probe = Planner(config(), PROFILE)
    probe.warm_start([], arrivals(rng, 0.0, 60.0))
    service = np.array([s[3] for s in probe._samples])
    from planner.sizing import size_prefill
    rates = np.linspace(20, 80, 241)
    need = [size_prefill(r, service, 2.0, probe.config.pool_goal).workers for r in rates]
    edge = rates[next(i for i in range(1, len(need)) if need[i] > need[i - 1])]
    decisions = closed_loop(Planner(config(arrival_quantile=0.5), PROFILE), [edge] * 40, seed=3)
    sizes = [d.prefill.desired for d in decisions[1:]]
    assert reversals(sizes) == 0, sizes
    assert any(d.prefill.bound in (Bound.HYSTERESIS, Bound.DOWN_DELAY) for d in decisions) or len(set(sizes)) == 1


def test_scaling_down_accounts_for_the_load_the_survivors_absorb():
    """After the load halves the pools shrink, and the survivors are predicted to meet the goal at
    the load they now carry: the next decisions at that load do not come back up."""
    cfg = config()
    decisions = closed_loop(Planner(cfg, PROFILE), [80.0] * 10 + [40.0] * 20, seed=1)
    high, low = decisions[9], decisions[-1]
    assert low.prefill.desired < high.prefill.desired and low.decode.desired <= high.decode.desired
    for d in decisions[-8:]:
        assert d.prefill.predicted >= cfg.pool_goal * 0.99        # attainment at the new size
        assert d.decode.predicted <= cfg.itl_target_s             # ITL at the new size
    assert reversals([d.prefill.desired for d in decisions[10:]]) == 0


def _sizes_as_the_load_falls(cfg: PlannerConfig, pool: str) -> list[tuple[int, int]]:
    """(required, desired) of one pool at 80 req/s for eight decisions, then 15 req/s."""
    planner = Planner(cfg, PROFILE)
    rng = np.random.default_rng(4)
    p = d = 0
    sizes = []
    for k, rate in enumerate([80.0] * 8 + [15.0] * 4):
        now = (k + 1) * INTERVAL
        dec = planner.decide(observe(now, arrivals(rng, now, rate), PoolState(p), PoolState(d)))
        p, d = dec.desired_prefill, dec.desired_decode
        sizes.append((getattr(dec, pool).required, getattr(dec, pool).desired))
    return sizes


@pytest.mark.parametrize("pool, delays, held", [
    ("decode", {}, True),                                   # default: one start-up
    ("prefill", {}, False),                                 # default: none, the margin alone
    ("prefill", {"prefill_down_delay_s": 16.5}, True),
    ("decode", {"decode_down_delay_s": 0.0}, False),
])
def test_a_worker_is_released_only_after_a_whole_down_delay_unneeded(pool, delays, held):
    """Decisions 30 s apart, down delay 16.5 s (one start-up): a worker the model stops needing at
    one decision has been unneeded for somewhere between 0 and 30 s, so it is kept; at the next
    decision it has been unneeded for at least 30 s and goes. Before, the window held only the
    latest decision whenever decisions were further apart than the delay: no cooldown at all.
    With no delay (prefill's default) it goes at the first decision that does not need it."""
    sizes = _sizes_as_the_load_falls(config(startup_s=16.5, **delays), pool)
    high = sizes[7][1]
    drop = next(k for k in range(8, 12) if sizes[k][0] < high)     # the first decision that needs fewer
    if held:
        assert sizes[drop][1] == high                               # kept: not yet a whole delay unneeded
        assert sizes[drop + 1][1] < high                            # released one decision later
    else:
        assert sizes[drop][1] < high


def test_the_budget_and_the_pool_limits_hold():
    cfg = config(prefill=PoolLimits(1, 4), decode=PoolLimits(2, 10), gpu_budget=7)
    planner = Planner(cfg, PROFILE)
    rng = np.random.default_rng(2)
    for k in range(5):
        now = (k + 1) * INTERVAL
        d = planner.decide(observe(now, arrivals(rng, now, 300.0), PoolState(4), PoolState(3)))
        assert 1 <= d.desired_prefill <= 4 and 2 <= d.desired_decode <= 10
        assert d.desired_prefill + d.desired_decode <= 7
    assert d.prefill.required > 4 and d.prefill.bound in (Bound.MAX, Bound.BUDGET)
    # workers still draining hold GPUs of the budget
    d = planner.decide(observe(6 * INTERVAL, arrivals(rng, 6 * INTERVAL, 300.0), PoolState(4, draining=2),
                               PoolState(3)))
    assert d.desired_prefill + d.desired_decode <= 5
    assert Bound.BUDGET in (d.prefill.bound, d.decode.bound)
    quiet = Planner(config(prefill=PoolLimits(3, 8), decode=PoolLimits(2, 8)), PROFILE)
    d = closed_loop(quiet, [0.5] * 6)[-1]
    assert (d.desired_prefill, d.desired_decode) == (3, 2) and d.prefill.bound is Bound.MIN


def test_corrections_converge_to_the_observed_ratio():
    # FIFO prefill queues: at this load the deadline order's model would hold 3 workers either way
    planner = Planner(config(prefill_deadline=False), PROFILE)
    rng = np.random.default_rng(4)
    for k in range(30):
        now = (k + 1) * INTERVAL
        reqs = arrivals(rng, now, 30.0)
        done = tuple(PrefillRecord(r.prompt_tokens, 0, 0.0, 1.5 * PROFILE.prefill_s(r.prompt_tokens)) for r in reqs)
        stats = DecodeStats(5000, 60.0, 1500.0, 0.8 * PROFILE.decode_step_s(60.0, 1500.0))
        d = planner.decide(observe(now, reqs, PoolState(4), PoolState(2), prefills=done, decode_stats=stats))
    assert planner.service_correction.value == pytest.approx(1.5, rel=0.01)
    assert planner.decode_correction.value == pytest.approx(0.8, rel=0.01)
    assert d.prefill.correction == pytest.approx(1.5, rel=0.01)
    uncorrected = closed_loop(Planner(config(prefill_deadline=False), PROFILE), [30.0] * 30, seed=4)[-1]
    assert d.prefill.required > uncorrected.prefill.required      # 1.5x slower prefill needs more


def test_the_wait_correction_learns_waits_the_model_misses():
    planner = Planner(config(), PROFILE)
    rng = np.random.default_rng(5)
    for k in range(25):
        now = (k + 1) * INTERVAL
        reqs = arrivals(rng, now, 60.0)
        done = tuple(PrefillRecord(r.prompt_tokens, 0, 0.5, PROFILE.prefill_s(r.prompt_tokens)) for r in reqs)
        planner.decide(observe(now, reqs, PoolState(6), PoolState(2), prefills=done))
    assert planner.wait_correction.value > 2.0                      # 0.5 s observed, far above the model


def test_scale_down_while_other_workers_are_still_starting():
    """Decode has workers starting (a slow start, or an earlier decision); the load is low for
    longer than the down delay: the planner shrinks decode anyway (the caller cancels starting
    workers first) and prefill too, instead of waiting for everyone to be ready."""
    planner = Planner(config(prefill_down_delay_s=60.0, decode_down_delay_s=60.0), PROFILE)
    rng = np.random.default_rng(6)
    for k in range(8):
        now = (k + 1) * INTERVAL
        d = planner.decide(observe(now, arrivals(rng, now, 2.0), PoolState(6), PoolState(ready=4, starting=4)))
    assert d.decode.current == 8 and d.desired_decode < 8
    assert d.desired_prefill < 6


def test_decisions_carry_their_reasons():
    d = closed_loop(Planner(config(), PROFILE), [20.0] * 4)[-1]
    text = d.summary()
    assert "prefill" in text and "decode" in text and "req/s" in text
    m = d.metrics()
    assert m["prefill_desired"] == d.desired_prefill and m["decode_desired"] == d.desired_decode
    assert m["plan_rate_rps"] >= m["rate_rps"] > 0
    assert d.load.num_samples > 0 and d.load.predictor.startswith("holt")
    assert d.decode.limit in ("itl", "kv", "max_num_seqs")


def test_no_data_keeps_what_there_is():
    d = Planner(config(), PROFILE).decide(Observation(30.0, INTERVAL, 0, PoolState(3), PoolState(2)))
    assert (d.desired_prefill, d.desired_decode) == (3, 2) and d.prefill.bound is Bound.NO_DATA


def test_the_core_imports_no_io_or_torch():
    code = ("import sys, planner, planner.core; "
            "bad = [m for m in ('grpc', 'redis', 'ray', 'torch', 'router', 'engine') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_deadline_queues_need_fewer_prefill_workers_than_fifo_ones():
    """The same observations, prefill workers in deadline order or FIFO: the deadline order's
    queue-with-patience model holds the pool at a higher utilization (a prompt that waits too long
    is set aside instead of delaying all behind it)."""
    sizes = {}
    for deadline in (False, True):
        p = Planner(config(prefill_deadline=deadline), PROFILE)
        for i in range(1, 8):
            # 600 arrivals of 2,000-token prompts per interval, in clumps of 20
            times = tuple(i * INTERVAL - INTERVAL + (k // 20) * 1.0 + (k % 20) * 0.01 for k in range(600))
            reqs = tuple(RequestSample(t, 2000, 100) for t in times)
            d = p.decide(Observation(i * INTERVAL, INTERVAL, 600, PoolState(4), PoolState(2), reqs,
                                     arrival_times=times))
        sizes[deadline] = d.prefill.required
    assert (sizes[True], sizes[False]) == (2, 3)


def observed_misses(pool: str, intervals: int, missed_of) -> tuple[Planner, list[int], list[float]]:
    """The closed loop at a steady 30 req/s with `missed_of(k, n)` of the n requests of interval k
    observed missing `pool`'s target; the planner, and that pool's desired sizes and lifts."""
    from planner import Outcomes

    planner = Planner(config(), PROFILE)
    rng = np.random.default_rng(7)
    p, d, sizes, lifts = 0, 0, [], []
    for k in range(intervals):
        now = (k + 1) * INTERVAL
        reqs = arrivals(rng, now, 30.0)
        n = len(reqs)
        missed = missed_of(k, n)
        outcomes = (Outcomes(ttft_count=n, ttft_missed=missed) if pool == "prefill" else
                    Outcomes(ttft_count=n, itl_count=n, itl_missed=missed))
        dec = planner.decide(observe(now, reqs, PoolState(p), PoolState(d), outcomes=outcomes))
        p, d = dec.desired_prefill, dec.desired_decode
        chosen = dec.prefill if pool == "prefill" else dec.decode
        sizes.append(chosen.desired)
        lifts.append(chosen.lift)
    return planner, sizes, lifts


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_observed_misses_lift_a_pool_whatever_the_model_says(pool):
    """A steady load the model sizes comfortably, but the pool is observed missing its target (a
    wait the model does not know, which more workers shorten): each interval of misses grows the
    pool and moves its correction (the lift), though the model's own requirement stays put; once
    the misses stop and the model agrees, the lift is undone and the pool returns to the model's
    size."""
    _, sizes, lifts = observed_misses(                                      # each lift helps
        pool, 40, lambda k, n: int(n * 0.15 * 0.7 ** (k - 10)) if 10 <= k < 16 else 0)
    before = sizes[9]
    assert lifts[9] == 1.0 and all(x > 1.0 for x in lifts[10:16])           # the correction moves
    assert lifts[15] > lifts[10] > 1.0                                       # and keeps moving while misses last
    assert all(b > a for a, b in zip(sizes[9:16], sizes[10:16]))             # the pool grows every interval
    assert sizes[15] >= before + 6
    assert lifts[-1] < 1.02 and sizes[-1] <= before  # undone once the model agrees


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_a_prefill_lift_that_does_not_cut_the_misses_stops_rising(pool):
    """Misses that more workers do not remove (their share the same however large the pool):
    the prefill pool is lifted, and once a lift has served without cutting them it rises no
    further, rather than by a quarter every interval up to four times its load. The decode
    pool's lift keeps rising (its new workers take new arrivals only, so one interval after a
    lift is too early to judge it)."""
    planner, sizes, lifts = observed_misses(pool, 30, lambda k, n: n // 20 if k >= 10 else 0)
    before = sizes[9]
    assert lifts[10] > 1.0 and sizes[10] > before          # the misses lift the pool once ...
    if pool == "decode":
        assert lifts[-1] == 4.0                             # (the decode lift rises to its limit)
        return
    assert max(lifts) <= lifts[10] * 1.25 + 1e-9           # ... and at most once more
    assert lifts[-1] == lifts[12] and sizes[-1] <= sizes[12] + 1
    assert planner.ttft_lift.futile >= 15


def test_while_the_prefill_pool_misses_the_decode_pool_plans_for_requests_held_to_their_ttft():
    """A decode worker admits a request before its prefill and holds its slot and KV until the
    prompt is computed. While the prefill pool's lift is up (it was seen missing the TTFT
    target), prompts may wait up to their TTFT slack, not the model's short wait: the decode pool
    is sized for that hold (short outputs at a high rate, where the slots bind), and comes back
    once the lift is undone."""
    from planner import Outcomes

    def requests(rng, now: float) -> tuple[RequestSample, ...]:
        n = rng.poisson(120.0 * INTERVAL)
        times = np.sort(rng.uniform(now - INTERVAL, now, n))
        prompt = np.clip(rng.lognormal(np.log(1500), 0.7, n), 16, 16000).astype(int)
        output = np.clip(rng.lognormal(np.log(20), 0.7, n), 2, 2000).astype(int)
        return tuple(RequestSample(float(t), int(p), int(o)) for t, p, o in zip(times, prompt, output))

    def run(prefill_misses: bool) -> tuple[list[int], list[float]]:
        planner = Planner(config(), PROFILE)
        rng = np.random.default_rng(3)
        p, d, sizes, lifts = 0, 0, [], []
        for k in range(60):
            now = (k + 1) * INTERVAL
            reqs = requests(rng, now)
            n = len(reqs)
            missed = n // 10 if prefill_misses and 10 <= k < 14 else 0
            dec = planner.decide(observe(now, reqs, PoolState(p), PoolState(d),
                                         outcomes=Outcomes(ttft_count=n, ttft_missed=missed)))
            p, d = dec.desired_prefill, dec.desired_decode
            sizes.append(dec.decode.required)
            lifts.append(dec.prefill.lift)
        return sizes, lifts

    (calm, _), (missing, lifts) = run(False), run(True)
    assert missing[:10] == calm[:10]
    assert all(m > c for m, c in zip(missing[10:14], calm[10:14]))
    assert lifts[-1] == 1.0 and missing[-1] == calm[-1]

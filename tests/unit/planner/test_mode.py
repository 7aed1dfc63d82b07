"""The planner's choice between aggregated and disaggregated serving (planner/mode.py), in closed
loop with pools that become what it asks: which mode each workload gets, the hysteresis, the
switch through the ordinary resizing, aggregated serving's closed loop, and that the default mode
plans exactly as the planner without the choice."""

from __future__ import annotations

import numpy as np
import pytest

from planner import Observation, Outcomes, Planner, PlannerConfig, PoolLimits, PoolState, RequestSample
from planner.decision import FIXED_DISAGGREGATED, Bound, ModeReason
from planner.mode import ModeChooser, ModeCosts
from perf.profile import CURVE_PROFILE_PATH, load_profile
from runtime.config_fields import ConfigError
from runtime.config_file import config_from_dict
from runtime.config_planner import ServingMode, SlaConfig

INTERVAL = 30.0
PROFILE = load_profile(CURVE_PROFILE_PATH)    # as test_core: loads chosen on the curve, not the measured profile
DECODE_HEAVY = (150, 1000, 20.0)              # prompt and output medians (tokens), rate (req/s)
PREFILL_HEAVY = (6000, 10, 30.0)


def config(mode: ServingMode = ServingMode.AUTO, **kw) -> PlannerConfig:
    base = dict(ttft_target_s=2.0, itl_target_s=0.05, interval_s=INTERVAL, mode=mode,
                prefill=PoolLimits(0, 64), decode=PoolLimits(1, 64))
    return PlannerConfig(**(base | kw))


def arrivals(rng, now: float, shape: tuple[int, int, float]) -> tuple[RequestSample, ...]:
    prompt_median, output_median, rate = shape
    n = rng.poisson(rate * INTERVAL)
    times = np.sort(rng.uniform(now - INTERVAL, now, n))
    prompt = np.clip(rng.lognormal(np.log(prompt_median), 0.5, n), 16, 16000).astype(int)
    output = np.clip(rng.lognormal(np.log(output_median), 0.5, n), 2, 4000).astype(int)
    return tuple(RequestSample(float(t), int(p), int(o)) for t, p, o in zip(times, prompt, output))


def closed_loop(planner: Planner, shapes, seed: int = 0, outcomes=None):
    """Pools that become what the planner asks at once (ready at the next decision)."""
    rng = np.random.default_rng(seed)
    p = d = 0
    out = []
    for k, shape in enumerate(shapes):
        now = (k + 1) * INTERVAL
        reqs = arrivals(rng, now, shape)
        dec = planner.decide(Observation(now, INTERVAL, len(reqs), PoolState(p), PoolState(d), reqs,
                                         outcomes=outcomes(len(reqs)) if outcomes else Outcomes()))
        p, d = dec.desired_prefill, dec.desired_decode
        out.append(dec)
    return out


def test_a_decode_heavy_load_is_served_aggregated():
    """Short prompts, long outputs: one pool of decode workers computing their own prompts needs
    fewer GPUs than a prefill pool beside a decode pool, so auto serves it aggregated: no prefill
    worker, and fewer GPUs than the disaggregated mode at the same load."""
    decisions = closed_loop(Planner(config(), PROFILE), [DECODE_HEAVY] * 8)
    last = decisions[-1]
    assert all(d.mode.mode is ServingMode.AGGREGATED for d in decisions[4:]), [d.mode for d in decisions]
    assert last.mode.aggregated_gpus < last.mode.disaggregated_gpus
    assert last.desired_prefill == 0 and last.prefill.bound is Bound.MODE
    assert last.decode.required == last.mode.aggregated_gpus         # the decode pool sized as the one pool


def test_a_prefill_heavy_load_is_served_disaggregated():
    """Long prompts, short outputs: their chunks would stretch every decode step past the ITL target
    of the short outputs beside them, so a prefill pool of its own is cheaper and auto keeps it."""
    decisions = closed_loop(Planner(config(), PROFILE), [PREFILL_HEAVY] * 8)
    last = decisions[-1]
    assert all(d.mode.mode is ServingMode.DISAGGREGATED for d in decisions), [d.mode for d in decisions]
    assert last.mode.disaggregated_gpus < last.mode.aggregated_gpus
    assert last.desired_prefill > 0


def test_one_interval_of_the_other_mode_winning_does_not_switch():
    costs = {ServingMode.AGGREGATED: ModeCosts(6, 4, 7, 5), ServingMode.DISAGGREGATED: ModeCosts(4, 6, 5, 7)}
    chooser = ModeChooser(ServingMode.AUTO, switch_intervals=3)
    assert chooser.choose(costs[ServingMode.AGGREGATED]).reason is ModeReason.FIRST
    assert chooser.current is ServingMode.AGGREGATED
    swings = [ServingMode.DISAGGREGATED, ServingMode.AGGREGATED] * 3 + [ServingMode.DISAGGREGATED] * 2
    for cheaper in swings:                        # the other mode wins one or two decisions at a time
        assert chooser.choose(costs[cheaper]).mode is ServingMode.AGGREGATED
    decision = chooser.choose(costs[ServingMode.DISAGGREGATED])    # ... and a third in a row
    assert decision.mode is ServingMode.DISAGGREGATED and decision.reason is ModeReason.SWITCH


def test_the_other_mode_must_win_by_the_hysteresis_margin():
    """Cheaper at the load but not at the load times (1 + hysteresis): the mode in force stays."""
    chooser = ModeChooser(ServingMode.AUTO, switch_intervals=1)
    chooser.choose(ModeCosts(disaggregated=5, aggregated=6, disaggregated_margin=6, aggregated_margin=7))
    assert chooser.current is ServingMode.DISAGGREGATED
    for _ in range(5):
        chooser.choose(ModeCosts(disaggregated=5, aggregated=4, disaggregated_margin=6, aggregated_margin=5))
    assert chooser.current is ServingMode.DISAGGREGATED
    chooser.choose(ModeCosts(disaggregated=5, aggregated=3, disaggregated_margin=6, aggregated_margin=4))
    assert chooser.current is ServingMode.AGGREGATED


def test_a_lasting_change_of_workload_switches_through_the_pools():
    """Decode-heavy, then prefill-heavy for good: the planner switches to disaggregated only after
    the other mode has won mode_switch_intervals decisions, the prefill pool grows at that decision,
    and the decode pool gives back the aggregated workers only after its down delay. The other way
    round, the prefill pool drains only once the decode pool's workers are ready."""
    planner = Planner(config(mode_switch_intervals=3), PROFILE)
    decisions = closed_loop(planner, [DECODE_HEAVY] * 6 + [PREFILL_HEAVY] * 14)
    modes = [d.mode.mode for d in decisions]
    assert modes[5] is ServingMode.AGGREGATED and modes[-1] is ServingMode.DISAGGREGATED
    switch = modes.index(ServingMode.DISAGGREGATED)
    assert decisions[switch].mode.reason is ModeReason.SWITCH
    assert [d.mode.streak for d in decisions[switch - 2:switch]] == [1, 2]
    assert decisions[switch].desired_prefill > 0 == decisions[switch - 1].desired_prefill
    assert decisions[switch].desired_decode >= decisions[switch - 1].desired_decode      # held: down delay
    assert sum(a is not b for a, b in zip(modes, modes[1:])) == 1

    # to aggregated while the decode pool's new workers start: the prefill pool waits for them
    planner = Planner(config(mode=ServingMode.AGGREGATED), PROFILE)
    reqs = arrivals(np.random.default_rng(1), INTERVAL, DECODE_HEAVY)
    starting = planner.decide(Observation(INTERVAL, INTERVAL, len(reqs), PoolState(2), PoolState(1), reqs))
    assert starting.desired_decode > 1 and starting.desired_prefill == 2
    ready = planner.decide(Observation(2 * INTERVAL, INTERVAL, len(reqs), PoolState(2),
                                       PoolState(starting.desired_decode), reqs))
    assert ready.desired_prefill == 0


def test_in_aggregated_serving_ttft_misses_lift_the_one_pool():
    """With no prefill worker the decode workers computed every prompt: TTFT misses are theirs, so
    the decode pool grows whatever the model says, and the prefill lift is left alone."""
    def missing(n: int) -> Outcomes:
        return Outcomes(ttft_count=n, ttft_missed=n // 5, itl_count=n)

    calm = closed_loop(Planner(config(mode=ServingMode.AGGREGATED), PROFILE), [DECODE_HEAVY] * 6)
    planner = Planner(config(mode=ServingMode.AGGREGATED), PROFILE)
    missed = closed_loop(planner, [DECODE_HEAVY] * 6, outcomes=missing)
    assert missed[-1].desired_decode > calm[-1].desired_decode
    assert planner.itl_lift.value > 1 and planner.ttft_lift.value == 1
    assert all(d.desired_prefill == 0 for d in missed[1:])


def test_the_default_mode_plans_as_the_planner_without_the_choice():
    """Default settings are disaggregated: on the load auto serves aggregated, the default keeps a
    prefill pool, sizes nothing aggregated, and every decision equals the fixed disaggregated one."""
    assert SlaConfig().mode is ServingMode.DISAGGREGATED
    assert PlannerConfig(2.0, 0.05).mode is ServingMode.DISAGGREGATED
    default = closed_loop(Planner(config(mode=PlannerConfig(2.0, 0.05).mode), PROFILE), [DECODE_HEAVY] * 8)
    auto = closed_loop(Planner(config(), PROFILE), [DECODE_HEAVY] * 8)
    assert all(d.mode == FIXED_DISAGGREGATED and d.desired_prefill >= 1 for d in default)
    assert any(d.mode.mode is ServingMode.AGGREGATED for d in auto)
    assert "; mode" not in default[-1].summary() and default[-1].metrics()["mode_aggregated"] == 0.0
    assert "aggregated_gpus" not in default[-1].metrics()


def test_bad_mode_settings_are_refused_with_a_reason():
    with pytest.raises(ConfigError, match="mode: 'hybrid' is not one of disaggregated, aggregated, auto"):
        config_from_dict(SlaConfig, {"mode": "hybrid"})
    with pytest.raises(ConfigError, match="mode_switch_intervals"):
        SlaConfig(mode_switch_intervals=0)
    with pytest.raises(ValueError, match="prefill pool's minimum at 0"):
        config(prefill=PoolLimits(1, 64))


def test_a_tie_at_the_first_decision_goes_to_the_mode_with_room_at_the_margin():
    """Both modes need 3 GPUs at the load; at the load times (1 + hysteresis) the split needs a
    fourth (a second decode worker's worth at the boundary) and one aggregated pool does not: the
    same GPUs serve more of a rise aggregated, so the first decision takes it."""
    chooser = ModeChooser(ServingMode.AUTO, switch_intervals=3)
    chooser.choose(ModeCosts(disaggregated=3, aggregated=3, disaggregated_margin=4, aggregated_margin=3))
    assert chooser.current is ServingMode.AGGREGATED
    chooser = ModeChooser(ServingMode.AUTO, switch_intervals=3)
    chooser.choose(ModeCosts(disaggregated=3, aggregated=3, disaggregated_margin=3, aggregated_margin=4))
    assert chooser.current is ServingMode.DISAGGREGATED
    chooser = ModeChooser(ServingMode.AUTO, switch_intervals=3)       # a tie at both: disaggregated
    chooser.choose(ModeCosts(disaggregated=3, aggregated=3, disaggregated_margin=4, aggregated_margin=4))
    assert chooser.current is ServingMode.DISAGGREGATED


def test_in_aggregated_serving_the_prefill_lift_is_undone():
    """A prefill lift left from a burst served disaggregated would price the disaggregated mode (the
    mode choice's challenger) at that burst for as long as the planner serves aggregated: with no
    prefill pool to judge, each interval with outcomes undoes it as one its model agreed with."""
    def served(n: int) -> Outcomes:
        return Outcomes(ttft_count=n, itl_count=n)

    planner = Planner(config(mode=ServingMode.AGGREGATED), PROFILE)
    planner.ttft_lift.value, planner.ttft_lift.floor = 2.0, 6
    closed_loop(planner, [DECODE_HEAVY] * 2, outcomes=served)
    after_two = planner.ttft_lift.value
    assert 1.0 < after_two < 2.0 and planner.ttft_lift.floor == 0
    closed_loop(planner, [DECODE_HEAVY] * 30, outcomes=served)
    assert planner.ttft_lift.value == 1.0
    quiet = Planner(config(mode=ServingMode.AGGREGATED), PROFILE)      # no outcomes: no evidence, no change
    quiet.ttft_lift.value = 2.0
    closed_loop(quiet, [DECODE_HEAVY] * 3)
    assert quiet.ttft_lift.value == 2.0

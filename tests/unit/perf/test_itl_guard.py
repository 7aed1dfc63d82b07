"""The ITL guard of conditional disaggregation (perf/itl_guard.py): when computing a long
prompt on its decode worker would slow that worker's steps past the ITL target. Priced with real
profiles: an analytic one whose arithmetic the test redoes, and the shipped H100 one."""

import json

import pytest

from perf.itl_guard import ItlGuard, ItlGuardMode, LocalPrefillBudget, make_itl_guard, must_wait, note_decode_s, prefill_late
from perf.profile import CurveTiming, load_profile

CURVE = {"base_s": 0.005, "per_token_s": 2e-5, "per_attn_pair_s": 1e-9, "per_kv_token_s": 1e-8}


@pytest.fixture
def curve_profile(tmp_path):
    path = tmp_path / "curve.json"
    path.write_text(json.dumps({"curve": CURVE, "max_num_batched_tokens": 512}))
    return load_profile(path)


def step_s(chunk_start: int, chunk_tokens: int, decodes: int, context: int) -> float:
    """One step of the curve with a prefill chunk and `decodes` decodes, by hand."""
    c = CurveTiming(**CURVE)
    return (c.base_s + c.per_token_s * (chunk_tokens + decodes)
            + c.per_attn_pair_s * chunk_tokens * (chunk_start + chunk_tokens / 2)
            + c.per_kv_token_s * decodes * context)


def test_the_slowest_step_is_the_last_full_chunk_beside_the_decodes(curve_profile):
    guard = ItlGuard(curve_profile, itl_target_s=0.05)
    # 4 decodes leave 508 tokens of the 512 budget: 2000 tokens are chunks at 0, 508, 1016, 1524 (476)
    assert guard.local_step_s(2000, 0, 4, 1000) == pytest.approx(step_s(1016, 508, 4, 1000))
    # a tail after the last full chunk can be the slowest (a long context, few tokens left)
    many = guard.local_step_s(100_000, 0, 0, 1)
    assert many == pytest.approx(max(step_s(99_840 - 512, 512, 0, 1), step_s(99_840, 160, 0, 1)))
    # a cached prefix moves the chunks but not what they attend to: the prompt's end is the same
    assert guard.local_step_s(2000, 1000, 4, 1000) == pytest.approx(
        max(step_s(1000, 508, 4, 1000), step_s(1508, 492, 4, 1000)))
    # one chunk: one step
    assert guard.local_step_s(300, 0, 0, 1) == pytest.approx(step_s(0, 300, 0, 1))


def test_a_local_prefill_breaks_the_target_when_that_step_is_longer(curve_profile):
    at = step_s(1016, 508, 4, 1000)
    assert ItlGuard(curve_profile, at * 0.99).breaks_target(2000, 0, 4, 1000)
    assert not ItlGuard(curve_profile, at * 1.01).breaks_target(2000, 0, 4, 1000)
    guard = ItlGuard(curve_profile, at * 1.01)
    assert guard.breaks_target(2000, 0, 64, 1000)          # more decodes in D's step: slower
    assert guard.breaks_target(4000, 0, 4, 1000)           # a longer prompt: its last chunk attends more
    assert not guard.breaks_target(1500, 0, 4, 1000)


def test_on_the_shipped_h100_profile_long_prompts_break_tight_targets():
    profile = load_profile(None)
    tight, loose = ItlGuard(profile, 0.015), ItlGuard(profile, 0.050)
    long_step, short_step = tight.local_step_s(8192, 0, 32, 8192), tight.local_step_s(1024, 0, 1, 1024)
    assert short_step < long_step
    assert tight.breaks_target(8192, 0, 32, 8192) and tight.breaks_target(1024, 0, 1, 1024)
    assert loose.breaks_target(8192, 0, 32, 8192) == (long_step > 0.050)
    assert loose.breaks_target(1024, 0, 1, 1024) == (short_step > 0.050)
    # the guard prices a step with the decodes in it: never below the decode step alone
    assert tight.local_step_s(1024, 0, 64, 8192) > profile.decode_step_s(64, 8192)


def test_settings_build_the_guard_or_refuse(tmp_path):
    assert make_itl_guard(None, None) is None
    guard = make_itl_guard(15.0, None)
    assert guard.itl_target_s == pytest.approx(0.015) and guard.profile.name == load_profile(None).name
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="ITL target"):
            make_itl_guard(bad, None)
    with pytest.raises(ValueError, match="cannot read profile"):
        make_itl_guard(15.0, str(tmp_path / "missing.json"))


def test_without_a_guard_nothing_waits_and_with_one_long_prompts_do(curve_profile):
    assert not must_wait(None, 100_000, 100_000, 64)
    guard = ItlGuard(curve_profile, step_s(1016, 508, 4, 2000) * 1.01)
    assert not must_wait(guard, 2000, 2000, 4)            # its slowest step just fits the target
    assert must_wait(guard, 4000, 4000, 4)
    assert must_wait(guard, 4000, 900, 4)                 # a cached prefix: its later chunks still attend to it
    assert not must_wait(guard, 4000, 400, 4)             # one short chunk left


def test_the_budget_prices_a_local_prefill_as_what_its_chunks_add_to_the_steps(curve_profile):
    budget = LocalPrefillBudget(ItlGuard(curve_profile, itl_target_s=0.05))
    alone = step_s(0, 0, 4, 1000)                     # the 4 decodes' own step
    want = sum(step_s(s, min(508, 2000 - s), 4, 1000) - alone for s in (0, 508, 1016, 1524))
    assert budget.cost_s(2000, 0, 4, 1000) == pytest.approx(want)
    assert budget.cost_s(2000, 1000, 4, 1000) < budget.cost_s(2000, 0, 4, 1000)     # a cached prefix is free
    # the spare share keeps the decodes' mean ITL at 0.8 of the target: b / (1 - f) = 0.8 x 50 ms
    b = step_s(0, 0, 4, 1000)
    assert budget.spare_share(4, 1000) == pytest.approx(1 - b / 0.04)
    assert LocalPrefillBudget(budget.guard, share=0.25).spare_share(4, 1000) == pytest.approx((1 - b / 0.04) / 4)
    assert LocalPrefillBudget(ItlGuard(curve_profile, b / 0.8)).spare_share(4, 1000) == pytest.approx(0, abs=1e-12)


def test_the_budget_meters_each_decode_workers_local_prefills_to_its_spare_share(curve_profile):
    budget = LocalPrefillBudget(ItlGuard(curve_profile, itl_target_s=0.05))
    cost, f = budget.cost_s(2000, 0, 4, 2000), budget.spare_share(4, 2000)
    assert must_wait(budget, 2000, 2000, 9, 4, "d0", now_s=100.0)          # first seen: no credit yet
    assert must_wait(budget, 2000, 2000, 9, 4, "d0", now_s=100.0 + 0.9 * cost / f)
    assert not must_wait(budget, 2000, 2000, 9, 4, "d0", now_s=100.0 + 1.01 * cost / f)   # earned: it runs locally
    t = 100.0 + 1.01 * cost / f
    assert must_wait(budget, 2000, 2000, 9, 4, "d0", now_s=t + 0.5 * cost / f)    # paid: it earns again from ~0
    assert not must_wait(budget, 2000, 2000, 9, 4, "d0", now_s=t + 1.1 * cost / f)
    # credit is capped at the prompt's cost: an idle hour buys one prompt, not a burst of them
    t += 3600.0
    assert not must_wait(budget, 2000, 2000, 9, 4, "d0", now_s=t)
    assert must_wait(budget, 2000, 2000, 9, 4, "d0", now_s=t + 0.01 * cost / f)
    # each decode worker has its own credit
    assert must_wait(budget, 2000, 2000, 9, 4, "d1", now_s=t)
    assert not must_wait(budget, 2000, 2000, 9, 4, "d1", now_s=t + 1.01 * cost / f)


def test_a_decode_worker_without_slack_computes_no_prompt_of_a_saturated_prefill_worker(curve_profile):
    b = step_s(0, 0, 64, 2000)
    budget = LocalPrefillBudget(ItlGuard(curve_profile, itl_target_s=b / 0.8 * 0.99))
    assert budget.spare_share(64, 2000) == 0
    assert all(must_wait(budget, 2000, 2000, 64, 64, "d0", now_s=t) for t in (0.0, 10.0, 3600.0))


def test_settings_build_the_rule_asked_for(curve_profile, tmp_path):
    path = tmp_path / "curve.json"
    path.write_text(json.dumps({"curve": CURVE, "max_num_batched_tokens": 512}))
    assert isinstance(make_itl_guard(15.0, str(path)), ItlGuard)
    budget = make_itl_guard(15.0, str(path), ItlGuardMode.BUDGET, 0.5)
    assert isinstance(budget, LocalPrefillBudget) and budget.share == 0.5
    assert budget.guard.itl_target_s == pytest.approx(0.015)
    for bad in (0.0, 1.5, -1.0):
        with pytest.raises(ValueError, match="share"):
            make_itl_guard(15.0, str(path), "budget", bad)
    with pytest.raises(ValueError):
        make_itl_guard(15.0, str(path), "sometimes")


def test_with_a_ttft_target_a_queue_that_would_make_the_prompt_late_opens_the_gate(curve_profile):
    """The budget rule's TTFT gate: the prefill worker's queue, each token priced like the prompt's
    own, against 0.8 of the target. Without a TTFT target, or under the step rule, only the token
    threshold opens it."""
    budget = LocalPrefillBudget(ItlGuard(curve_profile, 0.05), ttft_target_s=1.0)
    per_token = curve_profile.prefill_s(2000, 0) / 2000
    edge = 0.8 / per_token                          # queued tokens worth 0.8 s of prefill
    assert not prefill_late(budget, edge * 0.99, 2000, 2000)
    assert prefill_late(budget, edge * 1.01, 2000, 2000)
    # a cached prefix makes each of the prompt's remaining tokens dearer (they attend to it)
    cached_per_token = curve_profile.prefill_s(2000, 1000) / 1000
    assert prefill_late(budget, 0.81 / cached_per_token, 2000, 1000)
    assert not prefill_late(budget, 0.79 / cached_per_token, 2000, 1000)
    assert not prefill_late(LocalPrefillBudget(budget.guard), 1e12, 2000, 2000)      # no TTFT target
    assert not prefill_late(budget.guard, 1e12, 2000, 2000)                          # the step rule
    assert not prefill_late(None, 1e12, 2000, 2000)
    with pytest.raises(ValueError, match="TTFT target"):
        LocalPrefillBudget(budget.guard, ttft_target_s=0.0)
    made = make_itl_guard(50.0, None, "budget", 1.0, ttft_target_ms=800.0)
    assert made.ttft_target_s == pytest.approx(0.8)
    assert isinstance(make_itl_guard(50.0, None, "step", 1.0, ttft_target_ms=800.0), ItlGuard)


def test_a_decode_worker_banks_at_most_one_requests_decode_time_of_credit(curve_profile):
    """The credit's cap: what the worker earns over one request's decode time (first token to last,
    a moving average of finished ones), so that a burst of prompts can use that much slack at once;
    before any request has finished, one prompt's cost."""
    budget = LocalPrefillBudget(ItlGuard(curve_profile, itl_target_s=0.05))
    cost, f = budget.cost_s(2000, 0, 4, 2000), budget.spare_share(4, 2000)
    lifetime = 5 * cost / f                           # a request decodes while the worker earns 5 prompts
    note_decode_s(budget, lifetime)
    note_decode_s(budget.guard, lifetime)             # the step rule ignores it
    must_wait(budget, 2000, 2000, 4, 4, "d0", now_s=0.0)
    t = 3600.0                                        # an idle hour banks one lifetime's credit, 5 prompts
    taken = [not must_wait(budget, 2000, 2000, 4, 4, "d0", now_s=t) for _ in range(8)]
    assert taken == [True] * 5 + [False] * 3
    # the moving average follows the requests: shorter ones lower the cap
    for _ in range(200):
        budget.note_decode_s(cost / f)
    must_wait(budget, 2000, 2000, 4, 4, "d1", now_s=0.0)
    assert [not must_wait(budget, 2000, 2000, 4, 4, "d1", now_s=3600.0) for _ in range(3)] == [True, False, False]
    budget.note_decode_s(0.0)                         # a request with no decode time changes nothing
    assert budget._window_s == pytest.approx(cost / f, rel=0.01)

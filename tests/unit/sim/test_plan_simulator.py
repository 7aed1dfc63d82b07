"""The planner simulator: a trace worked out by hand, the pools' lifecycle, workloads, the static
search, and the planner driving the pools (start-up delay, draining, nothing lost)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from planner import Planner, PlannerConfig
from perf.profile import load_profile
from sim.plan.decode import DecodeWorker, Kind
from sim.plan.workers import PrefillWorker, State
from sim.plan.simulator import SimConfig, Simulation
from sim.plan.static import StaticSearch
from sim.workload import (Workload, ideal_cached_tokens, load_workload, scale_load,
                                               split_history, synthetic_workload)


@pytest.fixture(scope="module")
def ms_profile(tmp_path_factory):
    """1 ms per token, nothing else: a prefill of n tokens takes n ms, a decode step of B sequences B ms."""
    path = tmp_path_factory.mktemp("p") / "ms.json"
    path.write_text(json.dumps({"curve": {"base_s": 0.0, "per_token_s": 0.001, "per_attn_pair_s": 0.0,
                                          "per_kv_token_s": 0.0}, "startup_s": 10.0}))
    return load_profile(path)


ALL_REMOTE = SimConfig(2.0, 0.005, handoff_s=0.0, remote_prefill_min_tokens=1)   # every prompt to the prefill pool


def hand_workload() -> Workload:
    return Workload("hand", np.array([0.0, 0.05, 1.0, 10.0, 10.0]), np.array([100, 100, 3000, 100, 100]),
                    np.array([11, 1, 2, 201, 51]), None)


def test_a_trace_worked_out_by_hand(ms_profile):
    """r0 prefills in [0, 0.1] and decodes 10 steps alone (1 ms each); r1 queues behind it (TTFT
    0.15) and has no decode; r2 prefills 3000 tokens in two chunks, 3 s (a TTFT miss); r3 and r4
    arrive together, prefill one after the other (done 10.1 and 10.2); r3 decodes alone for 100
    steps, then both run at 2 ms a step until r4's 50 are done (10.3), then r3's last 50 alone
    (10.35). ITL: r3 0.25 s / 200, r4 0.1 s / 50."""
    r = Simulation(hand_workload(), ms_profile, ALL_REMOTE, prefill_workers=1, decode_workers=1).run()
    assert r.ttft_s == pytest.approx([0.1, 0.15, 3.0, 0.1, 0.2])
    assert r.itl_s[[0, 2, 3, 4]] == pytest.approx([0.001, 0.001, 0.00125, 0.002])
    assert np.isnan(r.itl_s[1])
    ok = r.ttft_ok(2.0) & r.itl_ok(0.005)
    assert ok.mean() == pytest.approx(0.8)
    assert r.end_s == pytest.approx(10.35)
    assert r.gpu_s == pytest.approx(2 * 10.35)                  # two workers from 0 to the end
    assert (r.ttft_ok(2.0) & r.itl_ok(0.0015)).mean() == pytest.approx(0.6)   # r4's 2 ms fails


def test_the_stages_apart_agree_with_the_stages_together(ms_profile):
    w = hand_workload()
    both = Simulation(w, ms_profile, ALL_REMOTE, prefill_workers=1, decode_workers=1).run()
    pre = Simulation(w, ms_profile, ALL_REMOTE, prefill_workers=1, stages=("prefill",)).run()
    dec = Simulation(w, ms_profile, ALL_REMOTE, decode_workers=1, stages=("decode",),
                     decode_entry_s=pre.first_token_s).run()
    assert pre.ttft_s == pytest.approx(both.ttft_s)
    np.testing.assert_allclose(dec.itl_s, both.itl_s)
    gave_up = Simulation(w, ms_profile, SimConfig(2.0, 0.005), prefill_workers=1, stages=("prefill",),
                         max_misses=0).run()
    assert gave_up.gave_up


def test_decode_worker_admission_and_draining(ms_profile):
    w = DecodeWorker("d", 0.0, 0.0, ms_profile.decode_step_fn(8), max_seqs=2, kv_tokens=10_000)
    for rid in range(3):
        w.offer(rid, 100, 11, Kind.READY)                                      # 10 steps each
    assert w.batch == 2 and len(w.waiting) == 1                    # max_seqs
    assert w.next_event_s() == pytest.approx(0.020)               # 10 steps of 2 ms
    w.advance(0.020)
    assert sorted(w.due()[0]) == [0, 1] and w.batch == 1
    assert w.next_event_s() == pytest.approx(0.030)               # then alone, 1 ms a step
    small = DecodeWorker("k", 0.0, 0.0, ms_profile.decode_step_fn(8), max_seqs=8, kv_tokens=200)
    small.offer(0, 100, 20, Kind.READY)
    small.offer(1, 100, 20, Kind.READY)                                        # 120 + 120 > 200: waits for KV
    assert small.batch == 1 and len(small.waiting) == 1
    small.advance(small.next_event_s())
    assert small.due()[0] == [0] and small.batch == 1 and not small.waiting   # then joins
    small.state = State.DRAINING
    small.advance(small.next_event_s())
    assert small.due()[0] == [1] and small.idle                # a drained worker may stop


def test_decode_worker_seats_held_by_kv_in_flight(ms_profile):
    # as the engine: a remote prefill's reservation holds one of max_seqs' seats until its KV lands
    w = DecodeWorker("d", 0.0, 0.0, ms_profile.decode_step_fn(8), max_seqs=2, kv_tokens=10_000)
    for rid in range(3):
        w.offer(rid, 100, 11, Kind.REMOTE)
    assert w.take_reserved() == [0, 1] and len(w.waiting) == 1
    w.kv_landed(0)
    assert w.batch == 1 and len(w.waiting) == 1                    # 1 running + 1 awaiting
    w.advance(w.next_event_s())
    assert w.due()[0] == [0] and w.take_reserved() == [2]          # a seat freed: the next is sent


def test_prefill_worker_queue_and_lru_cache():
    w = PrefillWorker("p", 0.0, 0.0, cache_blocks=3)
    assert w.submit(1.0, 7, 1.0, 0.5) == (7, 1.0, 1.5)             # idle: starts at once
    assert w.submit(1.2, 8, 1.2, 0.5) is None                      # busy: queued
    assert w.in_flight == 2 and w.state is State.READY
    assert w.next(1.5) == (8, 1.5, 2.0) and w.next(2.0) is None
    w.store((1, 2))
    events = w.store((1, 3, 4))                                    # 2 is least recently used
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved"]
    assert events[0].block_hashes == (3, 4) and events[1].block_hashes == (2,)


def test_prefill_worker_deadline_order_serves_the_savable_first():
    # a 3 s prompt holds the worker; behind it: a prompt that can no longer make its 2 s deadline
    # when the worker frees up, then two that still can
    def order(deadline):
        w = PrefillWorker("p", 0.0, 0.0, cache_blocks=1, deadline_s=deadline)
        assert w.submit(0.0, 0, 0.0, 3.0) == (0, 0.0, 3.0)
        for rid, arrival, service in ((1, 0.1, 0.5), (2, 1.5, 0.4), (3, 1.9, 0.4)):
            assert w.submit(arrival, rid, arrival, service) is None
        served, t = [], 3.0
        while (nxt := w.next(t)) is not None:
            served.append(nxt[0])
            t = nxt[2]
        return served, w.backlog_s

    assert order(None) == ([1, 2, 3], 4.3)   # FIFO: TTFT 3.4, 2.4, 2.4 s: all three miss
    assert order(2.0) == ([2, 3, 1], 4.3)    # 1 is late either way; 2 and 3 make it (1.9, 1.9 s), 1 after


def test_workloads_load_scale_and_history(tmp_path):
    csv = tmp_path / "a.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                   "2023-11-16 18:15:50.9951690,396,109\n2023-11-16 18:15:51.2224670,879,55\n")
    a = load_workload(str(csv))
    assert a.arrival_s == pytest.approx([0.0, 4.314579, 4.541876]) and a.hashes is None
    jl = tmp_path / "m.jsonl"
    jl.write_text("\n".join(json.dumps({"timestamp": t, "input_length": 1000, "output_length": 5,
                                        "hash_ids": h}) for t, h in ((0, [0, 1]), (500, [0, 2]))))
    m = load_workload(str(jl))
    assert m.arrival_s == pytest.approx([0.0, 0.5]) and m.hashes == [(0, 1), (0, 2)]
    assert ideal_cached_tokens(m).tolist() == [0, 512]
    s = scale_load(m, 3, seed=1)
    assert len(s) == 6 and sorted(set(s.hashes)) == sorted({(0, 1), (0, 2), (3, 4), (3, 5), (6, 7), (6, 8)})
    assert np.all(np.diff(s.arrival_s) >= 0) and s.arrival_s.max() < 1.5
    assert len(scale_load(m, 1.5, seed=1)) in (2, 3, 4)
    hist, rest = split_history(a, 4.4)
    assert len(hist) == 2 and len(rest) == 1 and hist.arrival_s.max() < 0 <= rest.arrival_s[0]
    syn = synthetic_workload("bursty", seed=0, duration_s=1440)
    rate = np.bincount((syn.arrival_s // 60).astype(int))
    assert rate[10] > 2 * rate[5]                                  # a burst in minutes 9-12


def test_the_static_search_finds_the_cheapest_split(ms_profile):
    rng = np.random.default_rng(0)
    n = 600
    w = Workload("s", np.sort(rng.uniform(0, 300, n)), rng.integers(50, 300, n), rng.integers(2, 300, n), None)
    cfg = SimConfig(0.3, 0.0025)
    found = StaticSearch(w, ms_profile, cfg, 0.95).run()

    def joint(p, d):
        r = Simulation(w, ms_profile, cfg, prefill_workers=p, decode_workers=d).run()
        return (r.ttft_ok(0.3) & r.itl_ok(0.0025)).mean()

    assert found is not None and found.workers <= 6
    assert joint(found.prefill, found.decode) >= 0.95
    cheaper = [(p, d) for p in range(1, 5) for d in range(1, 5) if p + d < found.workers]
    assert all(joint(p, d) < 0.95 for p, d in cheaper)


def test_the_planner_drives_the_pools_with_startup_and_draining(ms_profile):
    """Quiet, then four times the load, then quiet: the planner adds workers that serve only
    `startup_s` later, costs them from their start, drains them afterwards, and loses nothing."""
    rng = np.random.default_rng(1)
    rates = [5.0] * 6 + [20.0] * 8 + [5.0] * 10                   # per 30 s interval
    t = np.concatenate([np.sort(rng.uniform(30 * k, 30 * (k + 1), rng.poisson(r * 30))) for k, r in enumerate(rates)])
    n = len(t)
    w = Workload("step", t, rng.integers(100, 400, n), rng.integers(2, 100, n), None)
    hist, rest = split_history(w, 60.0)
    cfg = PlannerConfig(0.5, 0.004, startup_s=ms_profile.startup_s)
    sim = Simulation(rest, ms_profile, SimConfig(0.5, 0.004, startup_s=ms_profile.startup_s),
                     planner=Planner(cfg, ms_profile), history=hist)
    r = sim.run()
    assert not np.isnan(r.ttft_s).any()                            # every request was served
    assert np.all(np.isnan(r.itl_s) == (rest.output == 1))
    added = [x for x in sim.all_workers if x.start_s > 0]
    assert added and all(x.ready_s == pytest.approx(x.start_s + 10.0) for x in added)
    assert r.scaling_actions >= 2 and any(x.stop_s is not None for x in sim.all_workers)   # drained
    assert r.gpu_s == pytest.approx(sum(min(x.stop_s or r.end_s, r.end_s) - x.start_s for x in sim.all_workers))
    peak = max(p.prefill_active + p.decode_active for p in r.timeline)
    assert peak > r.timeline[0].prefill_active + r.timeline[0].decode_active
    assert r.timeline[-1].prefill_active + r.timeline[-1].decode_active < peak


def test_conditional_disaggregation_worked_out_by_hand(ms_profile):
    """As the frontend does: a prompt goes to the prefill worker while its queue (the router's
    count, in 512-token blocks here) is at most max_prefill_queue_tokens, else its decode worker
    computes it, slowing the sequences decoding there. r0 (500 tokens, 1 block) goes remote:
    computed in [0, 0.5], its first token out 10 ms later (handoff), 300 decode steps from 0.51.
    r1 (200 tokens) arrives while r0 is queued: 2 blocks > 600 tokens, so D prefills it alone in
    one 200 ms step (TTFT 0.2) and decodes its 10 steps (done 0.22). r2 (700 tokens, 2 blocks)
    arrives at 0.52 while r0 decodes: local again; one step carries its 700-token chunk and r0's
    token (0.701 s: TTFT 0.701), then both decode at 2 ms a step for r2's 10 steps (done 1.241),
    then r0 its last 279 steps alone (done 1.520): r0's mean ITL 1.01 s / 300, over 3x the 1 ms
    of its steps alone."""
    w = Workload("local", np.array([0.0, 0.01, 0.52]), np.array([500, 200, 700]), np.array([301, 11, 11]), None)
    cfg = SimConfig(2.0, 0.005, remote_prefill_min_tokens=1, max_prefill_queue_tokens=600, handoff_s=0.01,
                    itl_guard=False)
    r = Simulation(w, ms_profile, cfg, prefill_workers=1, decode_workers=1).run()
    assert r.local_prefill.tolist() == [False, True, True]
    assert r.ttft_s == pytest.approx([0.51, 0.2, 0.701])
    assert r.itl_s == pytest.approx([(1.520 - 0.51) / 300, 0.001, 0.002])
    assert r.end_s == pytest.approx(1.520)


def test_the_itl_guard_keeps_a_long_prompt_at_the_prefill_worker(ms_profile):
    """The same three requests with the frontend's ITL guard (on by default, as `serve --planner`
    runs it): a step of D carrying a chunk of r1 or r2 would take 200 or 700 ms, over the 5 ms
    target, so both wait at P past the gate. P computes r0 in [0, 0.5], r1 in [0.5, 0.7] (first
    token 0.71: TTFT 0.70), r2 in [0.7, 1.4] (first token 1.41: TTFT 0.89); r0 decodes beside
    them at 1 ms a step (2 and 3 ms while they join), its mean ITL a few ms instead of 3.4."""
    w = Workload("local", np.array([0.0, 0.01, 0.52]), np.array([500, 200, 700]), np.array([301, 11, 11]), None)
    cfg = SimConfig(2.0, 0.005, remote_prefill_min_tokens=1, max_prefill_queue_tokens=600, handoff_s=0.01)
    r = Simulation(w, ms_profile, cfg, prefill_workers=1, decode_workers=1).run()
    assert r.local_prefill.tolist() == [False, False, False]
    assert r.ttft_s == pytest.approx([0.51, 0.70, 0.89])
    assert r.itl_s[0] < 0.002
    off = Simulation(w, ms_profile, SimConfig(2.0, 0.005, remote_prefill_min_tokens=1, max_prefill_queue_tokens=600,
                                              handoff_s=0.01, itl_guard=False),
                     prefill_workers=1, decode_workers=1).run()
    assert off.itl_s[0] > 3 * r.itl_s[0]


def test_the_aggregated_search_finds_the_fewest_workers(ms_profile):
    """No prefill pool: each worker computes its prompts in its own steps. On the three requests
    above one worker computes the later prompts in steps beside the earlier ones' decodes, and a
    request misses the 5 ms ITL target; two workers meet every target, so the fewest is 2."""
    w = Workload("local", np.array([0.0, 0.01, 0.52]), np.array([500, 200, 700]), np.array([301, 11, 11]), None)
    cfg = SimConfig(2.0, 0.005, remote_prefill_min_tokens=1)
    one = Simulation(w, ms_profile, cfg, prefill_workers=0, decode_workers=1).run()
    assert one.local_prefill.all() and not (one.itl_ok(0.005)).all()
    r = StaticSearch(w, ms_profile, cfg, 1.0).aggregated()
    assert (r.prefill, r.decode, r.attainment) == (0, 2, 1.0)


def test_decode_kv_and_the_prefill_lease(tmp_path):
    """A decode worker reserves a sequence's KV before it asks for the prefill, so a full decode
    worker delays the prefill itself (TTFT), and a prefill worker that expects to finish later
    than the lease refuses: the decode worker computes the prompt."""
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"curve": {"base_s": 0.0, "per_token_s": 0.001, "per_attn_pair_s": 0.0,
                                          "per_kv_token_s": 0.0}, "kv_capacity_tokens": 1000}))
    small = load_profile(path)
    w = Workload("kv", np.array([0.0, 0.01]), np.array([500, 500]), np.array([101, 11]), None)
    r = Simulation(w, small, SimConfig(2.0, 0.005, handoff_s=0.0, remote_prefill_min_tokens=1), prefill_workers=1,
                   decode_workers=1).run()
    # r0: [0, 0.5] on P, 100 steps to 0.6; r1 (601 + 511 > 1000 tokens) waits for them, then P
    assert r.ttft_s == pytest.approx([0.5, 1.09]) and r.decode_wait_s == pytest.approx([0.0, 0.59])
    assert not r.local_prefill.any()
    leased = Simulation(w, small, SimConfig(2.0, 0.005, handoff_s=0.0, remote_prefill_min_tokens=1, prefill_lease_s=0.3),
                        prefill_workers=1, decode_workers=1).run()
    assert leased.local_prefill.all()                   # 0.5 s of prefill > the 0.3 s lease
    assert leased.ttft_s[0] == pytest.approx(0.5)


def test_generated_workload_shapes_and_rate_scale():
    ph = synthetic_workload("prefill_heavy", seed=0, duration_s=1800)
    assert 1300 < np.median(ph.prompt) < 1700 and 3000 < np.percentile(ph.prompt, 90) < 4500
    assert 10 <= np.median(ph.output) <= 40                     # tens of tokens
    per_20s = np.bincount((ph.arrival_s // 20).astype(int))
    assert per_20s.max() > 3 * np.median(per_20s)              # its bursts
    dh = synthetic_workload("decode_heavy", seed=0, duration_s=1800)
    assert np.median(dh.output) > 2 * np.median(dh.prompt)
    double = synthetic_workload("prefill_heavy", seed=0, duration_s=1800, rate_scale=2.0)
    assert 1.8 < len(double) / len(ph) < 2.2 and np.diff(double.arrival_s).min() >= 0
    with pytest.raises(ValueError):
        synthetic_workload("prefill_heavy", rate_scale=0)


def test_copies_keep_plain_int_block_hashes():
    """The router's index tells one child from several by `type(...) is int`: a copy's block ids
    must be Python ints, not numpy's."""
    w = Workload("m", np.array([0.0, 1.0]), np.array([1024, 1024]), np.array([2, 2]), [(1, 2), (1, 3)])
    s = scale_load(w, 3, seed=0)
    assert all(type(h) is int for hs in s.hashes for h in hs)

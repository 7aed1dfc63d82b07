"""bench/plan_clairvoyant.py: the per-interval choice that spends misses where they save the most,
its dual bound, and the whole script on a small trace (the simulator's real runs)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.unit.splitserve.test_bench_plan import small_trace

REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("plan_clairvoyant", REPO / "bench" / "plan_clairvoyant.py")
pc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pc)


def ok(n: int, misses: int) -> np.ndarray:
    a = np.ones(n, dtype=bool)
    a[:misses] = False
    return a


def test_misses_go_where_they_save_a_worker_for_the_fewest_requests():
    # two 10 s intervals of 100 requests: one prefill worker misses 30 in the first, 5 in the
    # second; two miss nothing; one decode worker always suffices
    runs = [(np.arange(100), {1: ok(100, 30), 2: ok(100, 0)}, {1: ok(100, 0)}),
            (np.arange(100, 200), {1: ok(100, 5), 2: ok(100, 0)}, {1: ok(100, 0)})]
    gpu_s, bound_s, attainment, mean_p, mean_d, picks = pc.clairvoyant(runs, 200, 20.0, 10.0, 0.97)
    # 6 misses allowed: the second interval runs one prefill worker, the first two
    assert gpu_s == (2 + 1) * 10 + (1 + 1) * 10
    assert attainment == 1 - 5 / 200 and mean_p == 1.5 and mean_d == 1.0
    assert bound_s <= gpu_s and picks == [(2, 1), (1, 1)]
    # applied one interval late, the first interval gets its own choice and the second the first's
    assert pc.lagged(runs, picks, 200, 20.0, 10.0) == ((30 + 30) / 3600, 1.0)
    # no misses allowed: both intervals need two
    gpu_s, bound_s, attainment, mean_p, _, _ = pc.clairvoyant(runs, 200, 20.0, 10.0, 0.999)
    assert gpu_s == 60 and attainment == 1.0 and mean_p == 2.0 and bound_s <= gpu_s


def test_a_request_must_meet_both_targets():
    # one prefill worker misses request 0's TTFT, one decode worker request 9's ITL
    ttft = {1: ok(10, 1), 2: ok(10, 0)}
    itl = {1: np.array([True] * 9 + [False]), 2: ok(10, 0)}
    assert pc.cheapest_static(ttft, itl, 0.8) == (1, 1, 0.8)
    assert pc.cheapest_static(ttft, itl, 0.85) == (1, 2, 0.9)      # ties on P + D: fewer prefill
    assert pc.cheapest_static(ttft, itl, 0.95) == (2, 2, 1.0)
    runs = [(np.arange(10), {1: ok(10, 0)}, itl)]
    assert pc.clairvoyant(runs, 10, 10.0, 10.0, 0.95)[0] == (1 + 2) * 10


def test_pool_sizes_grow_until_nothing_more_can_be_met():
    calls = []

    def run(met_by_size):
        def f(n):
            calls.append(n)
            return ok(10, 10 - met_by_size[min(n, len(met_by_size)) - 1])
        return f

    every = lambda got, n: bool(got[n].all())  # noqa: E731
    # an overloaded pool meets more with each worker: no early stop on the way to all met
    assert sorted(pc.sizes_up(run([1, 3, 3, 6, 10]), every)) == [1, 2, 3, 4, 5]
    # two requests no size meets: it stops after two sizes in a row gain nothing
    calls.clear()
    assert sorted(pc.sizes_up(run([2, 5, 8, 8, 8, 8]), every)) == [1, 2, 3, 4, 5] and calls == [1, 2, 3, 4, 5]


def test_the_script_on_a_small_trace(tmp_path):
    trace = tmp_path / "azure.csv"
    small_trace(trace)
    done = subprocess.run([sys.executable, str(REPO / "bench" / "plan_clairvoyant.py"), "--trace", str(trace),
                           "--load-scale", "2", "--ttft-ms", "2000", "--itl-ms", "50", "--interval-s", "30", "60",
                           "--warm-start-s", "60", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(x) for x in done.stdout.strip().splitlines()]
    assert [r["interval_s"] for r in rows] == [30.0, 60.0]
    for r in rows:
        assert r["clairvoyant_attainment"] >= 0.99 and r["carried_attainment"] >= 0.99
        # free resizing with foresight never costs more than the cheapest fixed split
        assert r["lower_bound_gpu_hours"] <= r["clairvoyant_gpu_hours"] <= r["static_gpu_hours"]
        assert r["carried_gpu_hours"] <= r["static_gpu_hours"]
        assert r["clairvoyant_mean_prefill"] >= 1 and r["clairvoyant_mean_decode"] >= 1
        assert 0 < r["one_late_gpu_hours"] and 0 < r["one_late_attainment"] <= 1
        assert r["lower_bound_holds"] is True          # an Azure-format trace: no prefix ids


def test_bad_input_is_refused():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "plan_clairvoyant.py"), "--trace", "x",
                           "--ttft-ms", "0", "--itl-ms", "50"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "must be > 0" in done.stderr
    done = subprocess.run([sys.executable, str(REPO / "bench" / "plan_clairvoyant.py"), "--trace", "/nonexistent.csv",
                           "--ttft-ms", "2000", "--itl-ms", "50"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("plan_clairvoyant: ") and "Traceback" not in done.stderr

"""The GPU budget counts GPUs: a worker holds its pool's tensor-parallel size (from the profile the
planner sizes with), so a budget of 8 GPUs fits four TP=2 decode workers, not eight."""

from __future__ import annotations

import json

import numpy as np
import pytest

from perf.profile import CURVE_PROFILE_PATH, load_profile
from planner import Observation, Planner, PlannerConfig, PoolLimits, PoolState, RequestSample
from planner.core import split_gpu_budget

INTERVAL = 30.0


def test_the_split_counts_gpus_and_reduces_to_workers_at_tp_1():
    assert split_gpu_budget(7, 6, 4, (1, 1), (1, 2)) == (4, 3)       # the TP=1 split, as before
    # decode wants 8 of the 12 GPUs wanted: 5 of 8, so 2 workers; prefill gets the rest: 4 x 1 + 2 x 2 = 8
    assert split_gpu_budget(8, 4, 4, (1, 2), (0, 1)) == (4, 2)
    p, d = split_gpu_budget(8, 6, 6, (2, 2), (1, 1))
    assert 2 * p + 2 * d <= 8 and p >= 1 and d >= 1


def test_a_planner_with_tp2_decode_workers_keeps_their_gpus_within_the_budget():
    rng = np.random.default_rng(0)
    cfg = PlannerConfig(ttft_target_s=2.0, itl_target_s=0.05, interval_s=INTERVAL, prefill=PoolLimits(0, 8),
                        decode=PoolLimits(1, 16), gpu_budget=8, decode_gpus=2)
    planner = Planner(cfg, load_profile(CURVE_PROFILE_PATH))
    for k in range(4):
        now = (k + 1) * INTERVAL
        n = rng.poisson(200 * INTERVAL)
        reqs = tuple(RequestSample(float(t), 1000, 200) for t in np.sort(rng.uniform(now - INTERVAL, now, n)))
        d = planner.decide(Observation(now, INTERVAL, len(reqs), PoolState(2), PoolState(3), reqs))
        assert d.desired_prefill + 2 * d.desired_decode <= 8


def test_a_budget_below_the_minimums_gpus_is_refused():
    with pytest.raises(ValueError, match=r"the GPU budget \(3\) is below the GPUs of the pools' minimums \(4\)"):
        PlannerConfig(ttft_target_s=1.0, itl_target_s=0.05, prefill=PoolLimits(0, 4), decode=PoolLimits(2, 4),
                      gpu_budget=3, decode_gpus=2)


def test_a_profile_records_its_tp_sizes_and_one_measured_at_others_is_refused(tmp_path):
    spec = json.loads(CURVE_PROFILE_PATH.read_text())
    path = tmp_path / "tp2.json"
    path.write_text(json.dumps({**spec, "tensor_parallel_size": 2}))
    p = load_profile(path, tp=(2, 2))
    assert (p.prefill_tp, p.decode_tp) == (2, 2)
    with pytest.raises(ValueError, match="measured with prefill TP 2 and decode TP 2; the workers run prefill TP 1"):
        load_profile(path, tp=(1, 2))
    with pytest.raises(ValueError, match="no performance profile is shipped for tensor-parallel workers"):
        load_profile(None, tp=(1, 2))
    assert load_profile(None, tp=(1, 1)).decode_tp == 1

"""bench/device/goodput_study.py's plan: which configurations a host of N GPUs has, where each
worker runs, what each run asks `bench goodput` for, how the call's time is shared, and bad
choices refused before anything starts. (The script itself runs on the CPU in
tests/integration/test_goodput.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "device"))
import goodput_study as gs  # noqa: E402


def test_every_split_of_the_gpus_beside_aggregated_one_worker_per_gpu():
    assert [c.name for c in gs.all_configs(2)] == ["agg2", "1p1d"]
    assert [c.name for c in gs.all_configs(4)] == ["agg4", "1p3d", "2p2d", "3p1d"]
    assert gs.all_configs(4)[2].roles() == ["prefill", "prefill", "decode", "decode"]     # GPU 0..3
    assert gs.all_configs(2)[0].roles() == ["aggregated", "aggregated"]


def test_runs_cover_the_chosen_configs_workloads_and_targets(tmp_path):
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n")
    args, runs = gs.parse_args(["--gpus", "4", "--configs", "agg4,3p1d", "--workloads", "8k256,azure,300/20",
                                "--targets", "tight", "--azure-trace", str(trace)])
    assert [(r.config.name, r.workload, r.target) for r in runs] == [
        ("agg4", "8k256", "tight"), ("agg4", "azure", "tight"), ("agg4", "300/20", "tight"),
        ("3p1d", "8k256", "tight"), ("3p1d", "azure", "tight"), ("3p1d", "300/20", "tight")]
    argv = gs.goodput_argv(runs[3], args, "http://h:1", tmp_path, 200.0)
    flag = dict(zip(argv[2::2], argv[3::2]))
    assert (flag["--ttft-ms"], flag["--itl-ms"], flag["--isl"], flag["--osl"], flag["--gpus"]) == \
        ("1000", "15", "8192", "256", "4")
    assert flag["--time-budget-s"] == "200" and "3p1d" in flag["--label"]
    assert "--trace" in gs.goodput_argv(runs[1], args, "http://h:1", tmp_path, 200.0)


@pytest.mark.parametrize("argv, message", [
    (["--configs", "5p5d"], "unknown '5p5d'"),
    (["--workloads", "9k9k"], "nor ISL/OSL"),
    (["--workloads", "azure"], "needs --azure-trace"),
    (["--targets", "medium"], "unknown 'medium'"),
    (["--gpus", "0"], "--gpus"),
])
def test_bad_choices_are_refused_before_anything_starts(argv, message):
    with pytest.raises(SystemExit, match=message):
        gs.parse_args(argv)


def test_the_call_budget_is_shared_by_the_runs_left_after_the_clusters_to_come():
    _, runs = gs.parse_args(["--gpus", "2", "--workloads", "1k1k,8k256", "--targets", "tight"])
    schedule = gs.Schedule(600.0, runs)            # 2 configs x 2 runs
    left = 600.0 - gs.STOP_MARGIN_S
    schedule.started(30.0)                         # the first cluster took 30 s; one more to start
    assert schedule.share_s() == pytest.approx((left - 60.0) / 4, abs=0.5)
    schedule.share_s()
    schedule.started(90.0)                         # the last cluster: nothing more to start
    assert schedule.share_s() == pytest.approx((left - 0.0) / 2, abs=0.5)

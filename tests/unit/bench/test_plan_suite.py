"""The planner's generalization suite (bench/plan_suite.py): one small cell end to end, with the
pools `bench plan` simulates (no deployment cap on either pool)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import plan_suite  # noqa: E402

from splitserve.bench.plan import SIMULATED_POOLS  # noqa: E402


def test_a_small_cell_reports_the_planner_against_the_cheaper_static_mode():
    rec = plan_suite.run_cell(plan_suite.Cell("decode_heavy", 2, 0, 300.0, 300.0))
    assert rec["workload"] == "decode_heavy" and rec["gpus_target"] == 2
    assert 0 < rec["sla_attainment"] <= 1 and rec["gpu_hours"] > 0
    split, aggregated = rec["static_disaggregated"], rec["static_aggregated"]
    assert split["prefill"] >= 1 and split["decode"] >= 1 and aggregated["prefill"] == 0
    cheaper = "aggregated" if aggregated["decode"] < split["prefill"] + split["decode"] else "disaggregated"
    assert rec["static_mode"] == cheaper
    chosen = aggregated if cheaper == "aggregated" else split
    assert rec["static_config"] == {"prefill": chosen["prefill"], "decode": chosen["decode"]}
    assert rec["planner_mode"] == "disaggregated" and rec["mode_share_aggregated"] == 0.0
    assert abs(rec["gpu_hours_ratio"] - rec["gpu_hours"] / rec["static_gpu_hours"]) < 1e-3   # rounded apart
    assert SIMULATED_POOLS.prefill.max_workers > 8 and SIMULATED_POOLS.decode.max_workers > 8


def test_a_cell_with_the_mode_choice_reports_the_planners_modes():
    rec = plan_suite.run_cell(plan_suite.Cell("decode_heavy", 2, 0, 300.0, 300.0, plan_suite.ServingMode.AUTO))
    assert rec["planner_mode"] == "auto"
    assert 0 < rec["mode_share_aggregated"] <= 1 and rec["mean_prefill_workers"] < 1    # it served aggregated

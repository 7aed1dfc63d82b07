"""The planner's generalization suite (bench/plan_suite.py): one small cell end to end, with the
pools `bench plan` simulates (no deployment cap on either pool)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import plan_suite  # noqa: E402

from splitserve.bench.plan import SIMULATED_POOLS  # noqa: E402


def test_a_small_cell_reports_the_planner_against_its_static_split():
    rec = plan_suite.run_cell(plan_suite.Cell("decode_heavy", 2, 0, 300.0, 300.0))
    assert rec["workload"] == "decode_heavy" and rec["gpus_target"] == 2
    assert 0 < rec["sla_attainment"] <= 1 and rec["gpu_hours"] > 0
    assert rec["static_config"]["prefill"] >= 1 and rec["static_config"]["decode"] >= 1
    assert abs(rec["gpu_hours_ratio"] - rec["gpu_hours"] / rec["static_gpu_hours"]) < 1e-3   # rounded apart
    assert SIMULATED_POOLS.prefill.max_workers > 8 and SIMULATED_POOLS.decode.max_workers > 8

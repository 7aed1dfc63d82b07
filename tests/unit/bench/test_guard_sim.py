"""bench/guard_sim.py: the guard's rules compared in the plan simulator, goodput found by the same
doubling-then-bisection as `bench goodput`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import guard_sim  # noqa: E402

H200_FP8 = str(Path(__file__).resolve().parents[3] / "perf/profiles/h200-llama-3.1-8b-fp8kv.json")


def test_each_configuration_gets_a_goodput_that_its_probes_bracket(tmp_path, capsys):
    out = tmp_path / "g.jsonl"
    assert guard_sim.main(["--profile", H200_FP8, "--workloads", "8192/256", "--seconds", "60",
                           "--tolerance", "0.1", "--out", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    probes = [x for x in lines if x["bench"] == "guard_sim_probe"]
    results = {x["config"]: x for x in lines if x["bench"] == "guard_sim"}
    assert list(results) == ["agg2", "1P1D step", "1P1D budget"]
    for name, r in results.items():
        mine = [p for p in probes if p["config"] == name]
        passed = [p["rate_req_s"] for p in mine if p["passed"]]
        failed = [p["rate_req_s"] for p in mine if not p["passed"]]
        assert r["goodput_req_s"] == max(passed) and r["bracket_req_s"][1] == min(failed)
        assert r["goodput_req_s"] < min(failed)
        assert all(p["passed"] == (p["attainment"] >= 0.9) for p in mine)
    summary = lines[-1]
    assert summary["bench"] == "guard_sim_summary" and summary["vs_aggregated"]["agg2"] == 1.0
    assert summary["profile"] == "h200-llama-3.1-8b-fp8kv"
    # the same rate gives every configuration the same arrivals
    w1, w2 = guard_sim.poisson(8192, 256, 3.0, 60, 0), guard_sim.poisson(8192, 256, 3.0, 60, 0)
    assert np.array_equal(w1.arrival_s, w2.arrival_s) and len(w1) > 100
    assert capsys.readouterr().out.count("\n") == len(lines)


def test_bad_input_is_a_message_and_exit_code_2(capsys):
    for argv in (["--workloads", "8k/256"], ["--gpus", "1"], ["--splits", "2P1D"], ["--itl-ms", "0"],
                 ["--profile", "/nonexistent.json"]):
        assert guard_sim.main(argv) == 2, argv
        assert capsys.readouterr().err.startswith("guard_sim: ")


@pytest.mark.parametrize("text,want", [("3P1D", [(3, 1)]), ("3p1d,2P2D", [(3, 1), (2, 2)])])
def test_splits_parse(text, want):
    assert guard_sim.parse_splits(text, 4) == want


def test_a_start_above_the_goodput_halves_as_bench_goodput_does(tmp_path):
    out = tmp_path / "g.jsonl"
    assert guard_sim.main(["--profile", H200_FP8, "--workloads", "8192/256", "--seconds", "60", "--start-rate", "40",
                           "--tolerance", "0.2", "--out", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    agg = [p["rate_req_s"] for p in lines if p["bench"] == "guard_sim_probe" and p["config"] == "agg2"]
    assert agg[:3] == [40.0, 20.0, 10.0]          # halved while it fails, then bisected
    result = next(x for x in lines if x["bench"] == "guard_sim" and x["config"] == "agg2")
    assert 0 < result["goodput_req_s"] < result["bracket_req_s"][1] <= 1.2 * result["goodput_req_s"] + 1e-9

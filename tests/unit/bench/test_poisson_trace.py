"""bench/poisson_trace.py: a fixed-length Poisson trace that the planner's simulator reads."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import poisson_trace  # noqa: E402

from sim.workload import load_workload  # noqa: E402


def test_the_trace_reads_back_with_its_lengths_and_rate(tmp_path):
    path = str(tmp_path / "t.csv")
    n = poisson_trace.write_trace(path, 3072, 150, rate=20.0, seconds=300.0, seed=1)
    w = load_workload(path)
    assert len(w) == n and abs(n / 300.0 - 20.0) < 1.5
    assert set(w.prompt.tolist()) == {3072} and set(w.output.tolist()) == {150}
    gaps = np.diff(w.arrival_s)
    assert np.all(gaps >= 0) and abs(gaps.mean() - 1 / 20.0) < 0.01

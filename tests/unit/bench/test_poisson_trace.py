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


def test_arrival_times_are_the_same_however_many_gaps_are_drawn_at_once():
    """One gap at a time, summed in order, is the reference; drawing them in batches (several
    batches when the first falls short) gives the same floats."""
    rng = np.random.default_rng(3)
    want, t = [], rng.exponential(1 / 2.0)
    while t < 50.0:
        want.append(t)
        t += rng.exponential(1 / 2.0)
    for batch in (None, 7, 1):
        assert np.array_equal(poisson_trace.arrival_times(2.0, 50.0, seed=3, batch=batch), np.array(want))

"""Placement does not move when the router gets faster: a deterministic workload (router_replay.py)
replayed through today's Router must make exactly the recorded decisions, for every policy variant.

The recording was made with the router before its per-worker state moved into arrays (the scan
over candidates as Python dicts); any difference in a worker, an overlap, a cost's float or the
blocks to prefill fails here.
"""

from __future__ import annotations

import json

import pytest

from tests.unit.bench.router_replay import CONFIGS, RECORDED, replay


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_replayed_decisions_match_the_recording(name):
    recorded = json.loads(RECORDED.read_text())[name]
    got = replay(CONFIGS[name])
    assert len(got) == len(recorded)
    for g, want in zip(got, recorded):
        assert g == want, f"step {want[0]}: got {g}, recorded {want}"

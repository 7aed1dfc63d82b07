"""bench/device/frontend_host.sh's smallest configuration runs here: serve --mock with one and two
frontends, the load from `bench serve --processes 2`, one JSON record per frontend count."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.integration.cluster import ROOT

pytestmark = pytest.mark.slow


def test_the_host_script_runs_its_smallest_configuration(tmp_path):
    """With the cluster and the load generator pinned apart (SERVER_CPUS, CLIENT_CPUS): on a
    2-core machine one core each; the frontends report the one CPU they were allowed."""
    cpus = sorted(os.sched_getaffinity(0))
    server, client = str(cpus[0]), str(cpus[-1])
    env = dict(os.environ, OUT=str(tmp_path), SCALE="small", TOTAL_S="280", PYTHON=os.sys.executable,
               SERVER_CPUS=server, CLIENT_CPUS=client)
    proc = subprocess.run(["bash", "bench/device/frontend_host.sh", "mock"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "frontend_host.jsonl").read_text().splitlines()]
    rows = {r["frontends"]: r for r in lines if r["bench"] == "frontend"}
    assert set(rows) == {1, 2}, (tmp_path / "frontend_host.log").read_text()[-3000:]
    for r in rows.values():
        assert r["errors"] == 0 and r["output_tokens"] == 16 * 16 and r["processes"] == 2
        assert r["frontend_cpu_s_per_1k_tokens"] > 0 and r["output_tok_s"] > 0
        assert r["frontend_cpus_allowed"] == [1] and r["server_cpus"] == 1 and r["client_cpus"] == 1
    assert {r["frontends"] for r in lines if r["bench"] == "frontend_summary"} == {1, 2}

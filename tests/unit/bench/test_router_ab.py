"""bench/router_ab.py: two trees' routers in one process, the same decisions, paired speeds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
TINY = ["--workers", "4", "--docs", "32", "--docs-per-worker", "4", "--decisions", "300",
        "--in-flight", "40", "--churn-blocks", "500", "--chunk", "50", "--rounds", "1"]


def run_ab(a: Path, b: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / "router_ab.py"), str(a), str(b), *TINY],
                          capture_output=True, text=True, timeout=120)


def test_a_tree_against_itself_routes_alike_in_both_runs():
    done = run_ab(REPO, REPO)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout.splitlines()[-1])
    assert record["same_choices"] is True and record["same_index"] is True
    for run in ("ingest", "churn"):
        assert record[run]["chunks"] >= 1
        assert record[run]["a_blocks_per_s"] > 0 and record[run]["b_blocks_per_s"] > 0
    for run in ("idle", "decoding"):
        assert record[run]["chunks"] == 6
        assert record[run]["a_decisions_per_s"] > 0 and record[run]["b_decisions_per_s"] > 0


def test_a_tree_without_a_router_package_is_refused(tmp_path):
    done = run_ab(REPO, tmp_path)
    assert done.returncode != 0
    assert "no router package there" in done.stderr

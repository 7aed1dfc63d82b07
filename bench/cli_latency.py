"""Wall time of `splitserve pools status --json` against a running `serve`, this tree against another.

    python bench/cli_latency.py --admin-url 127.0.0.1:50052 --baseline /path/to/older/checkout [--runs 15]

Runs the command as an operator does (a new interpreter each time, the admin token from the file
`serve` wrote), alternating this tree and the baseline tree (the same Python), and prints one JSON
line: the median, min and max seconds of each, their ratio, the git sha of each and the host's load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sha(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def once(tree: Path, admin_url: str) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "splitserve", "pools", "status", "--json", "--admin-url", admin_url],
                       cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if r.returncode != 0 or not json.loads(r.stdout).get("pools"):
        raise SystemExit(f"{tree}: {r.stderr.strip()}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--admin-url", required=True)
    ap.add_argument("--baseline", required=True, type=Path, help="another checkout to compare with")
    ap.add_argument("--runs", type=int, default=15)
    a = ap.parse_args()
    trees = {"this": ROOT, "baseline": a.baseline.resolve()}
    times: dict[str, list[float]] = {k: [] for k in trees}
    for _ in range(a.runs):
        for name, tree in trees.items():
            times[name].append(once(tree, a.admin_url))
    out = {"bench": "cli_latency", "command": "splitserve pools status --json", "device": f"cpu-{platform.machine()}",
           "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2), "runs": a.runs}
    for name, tree in trees.items():
        v = times[name]
        out[name] = {"git_sha": sha(tree), "median_s": round(statistics.median(v), 3), "min_s": round(min(v), 3),
                     "max_s": round(max(v), 3)}
    out["baseline_over_this"] = round(out["baseline"]["median_s"] / out["this"]["median_s"], 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

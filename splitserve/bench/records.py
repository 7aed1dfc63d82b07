"""What every benchmark record names: the commit measured.

`git_sha()`: SPLITSERVE_GIT_SHA if set (bench/device/run.sh exports it), else a GIT_SHA file at
the repository root (carried beside a copy of the tree, which has no usable .git: outside run.sh a
GPU machine's copy once answered `git rev-parse` with a stale commit), else `git rev-parse`.
Standard library only, so torch-free benches on any machine can import it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cpu_model() -> str | None:
    """The host CPU's model name (Linux), for records whose figures depend on it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def git_sha() -> str:
    """The commit a record was made at: $SPLITSERVE_GIT_SHA, else the GIT_SHA file written beside a
    tree copied to the GPU machine (whose own .git, if any, is not this tree's), else the
    checkout's HEAD. Delete GIT_SHA after a GPU run: a stale one mislabels local records."""
    if os.environ.get("SPLITSERVE_GIT_SHA"):
        return os.environ["SPLITSERVE_GIT_SHA"]
    f = ROOT / "GIT_SHA"
    if f.is_file() and f.read_text().strip():
        return f.read_text().strip()
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=ROOT)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"

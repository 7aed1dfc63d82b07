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
    """The commit a record was made at: $SPLITSERVE_GIT_SHA, else the checkout's HEAD, else the
    GIT_SHA file written beside a tree copied without its .git (the GPU machine's)."""
    if os.environ.get("SPLITSERVE_GIT_SHA"):
        return os.environ["SPLITSERVE_GIT_SHA"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=ROOT)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    f = ROOT / "GIT_SHA"
    if f.is_file() and f.read_text().strip():
        return f.read_text().strip()
    return "unknown"

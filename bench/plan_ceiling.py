"""The TTFT ceiling of a trace: the share of its prompts whose prefill alone, on an idle worker,
exceeds the TTFT target, uncached and with every shareable prefix cached. No number of workers
lets those requests meet the target, so a planner's attainment cannot pass 1 minus this share.

    python bench/plan_ceiling.py --ttft-ms 2000 [--profile FILE] [--output FILE] TRACE [TRACE ...]

One JSON line per trace. The profile defaults to the planner's (perf.profile.load_profile).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from perf.profile import load_profile  # noqa: E402
from sim.workload import ideal_cached_tokens, load_workload  # noqa: E402
from splitserve.bench.serve import emit, git_sha  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", help="Azure CSV, Mooncake JSONL or synthetic:NAME")
    p.add_argument("--ttft-ms", type=float, required=True)
    p.add_argument("--profile", default=None)
    p.add_argument("--output", default=None, help="append the JSON lines to this file")
    args = p.parse_args()
    if args.ttft_ms <= 0:
        p.error("--ttft-ms must be > 0")
    profile, ttft_s = load_profile(args.profile), args.ttft_ms / 1e3
    for trace in args.traces:
        w = load_workload(trace)
        cached = ideal_cached_tokens(w)
        over = sum(profile.prefill_s(int(n), 0) > ttft_s for n in w.prompt)
        over_cached = sum(profile.prefill_s(int(n), int(c)) > ttft_s for n, c in zip(w.prompt, cached))
        emit({"bench": "plan_ceiling", "git_sha": git_sha(), "trace": os.path.basename(trace),
              "profile": profile.name, "ttft_s": ttft_s, "requests": len(w),
              "share_prefill_over_ttft_uncached": round(over / len(w), 4),
              "share_prefill_over_ttft_ideal_cache": round(over_cached / len(w), 4)}, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

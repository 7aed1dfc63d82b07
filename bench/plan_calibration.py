"""How right is the planner's prefill model? Static prefill pools in the simulator against the model.

For each pool size P: the simulator runs the trace's prefills alone on P deadline-ordered workers
(as `bench plan`'s static search does). Per decision interval, the model (planner/sizing.py,
`prefill_attainment` in deadline order, no corrections) is given what a perfect observer of that
interval would give it: its arrival rate, its requests' prefill times, and the burstiness the
planner measures (planner/core.py `dispersion_index`: counts in TTFT-long windows, pooled over the
last 10 intervals). Intervals are grouped by how busy the pool was (rate x mean
prefill time / P), and each group's simulated share of missed TTFTs is printed beside the model's,
among the requests that can meet the target at all.

    python bench/plan_calibration.py --trace azure_llm_2023_conv.csv --load-scale 14 \\
        --prefill-workers 3 4 5 [--ttft-ms 2000] [--interval-s 30] [--output FILE]

One JSON line per (pool size, busy band) on stdout (and appended to --output).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planner.core import BURST_INTERVALS, MIN_BURST_ARRIVALS, dispersion_index  # noqa: E402
from planner.sizing import prefill_attainment  # noqa: E402
from perf.profile import load_profile  # noqa: E402
from splitserve.bench.plan import DEFAULT_WARM_START_S  # noqa: E402
from sim.plan.simulator import SimConfig, Simulation  # noqa: E402
from sim.workload import load_workload, scale_load, split_history  # noqa: E402

BANDS = [(0.0, 0.6), (0.6, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 1.0), (1.0, 1.2), (1.2, math.inf)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--load-scale", type=float, default=1.0)
    ap.add_argument("--prefill-workers", type=int, nargs="+", required=True)
    ap.add_argument("--ttft-ms", type=float, default=2000.0)
    ap.add_argument("--interval-s", type=float, default=30.0)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if args.interval_s <= 0 or args.ttft_ms <= 0 or min(args.prefill_workers) < 1:
        ap.error("--interval-s, --ttft-ms and --prefill-workers must be positive")
    target, interval = args.ttft_ms / 1e3, args.interval_s
    profile = load_profile(args.profile)
    workload = scale_load(load_workload(args.trace, args.seed), args.load_scale, args.seed)
    _, replay = split_history(workload, DEFAULT_WARM_START_S)      # as `bench plan` replays it
    cfg = SimConfig(target, 0.05, interval, profile.startup_s, args.seed, prefill_deadline_s=target)
    window = min(target, interval / 2)
    for p in args.prefill_workers:
        sim = Simulation(replay, profile, cfg, prefill_workers=p, stages=("prefill",)).run()
        service = np.array([profile.prefill_s(int(n), int(c)) for n, c in zip(replay.prompt, sim.cached_tokens)])
        ok = sim.ttft_ok(target)
        k = (replay.arrival_s // interval).astype(int)
        recent: list[tuple[float, float, np.ndarray, float]] = []
        rows = []
        for j in range(int(k.max()) + 1):
            idx = np.nonzero(k == j)[0]
            if len(idx) >= MIN_BURST_ARRIVALS:
                whole = (j * interval, (j + 1) * interval, replay.arrival_s[idx], 1.0)   # every arrival
                recent = (recent + [whole])[-BURST_INTERVALS:]
            if len(idx) < 5:
                continue
            s = service[idx]
            feasible = s < target
            rate = len(idx) / interval
            model = prefill_attainment(p, rate, s, target, dispersion_index(recent, window), 1.0, True)
            rows.append((rate * float(s.mean()) / p, int((~ok[idx] & feasible).sum()),
                         len(idx) * (float(feasible.mean()) - model.attainment), int(feasible.sum())))
        r = np.array(rows)
        for lo, hi in BANDS + [(0.0, math.inf)]:
            m = (r[:, 0] >= lo) & (r[:, 0] < hi)
            if not m.any():
                continue
            line = {"bench": "plan_calibration", "trace": os.path.basename(args.trace), "load_scale": args.load_scale,
                    "prefill_workers": p, "busy_from": lo, "busy_to": None if math.isinf(hi) else hi,
                    "intervals": int(m.sum()), "feasible_requests": int(r[m, 3].sum()),
                    "simulated_miss": round(float(r[m, 1].sum() / r[m, 3].sum()), 6),
                    "model_miss": round(float(r[m, 2].sum() / r[m, 3].sum()), 6)}
            print(json.dumps(line), flush=True)
            if args.output:
                with open(args.output, "a") as f:
                    f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

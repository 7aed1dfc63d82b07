"""Why a planner run misses: a planner replay's misses taken apart, from the simulator's own records.

For one workload (the arrays of a saved workload, `--workload-npz`, so that two versions of the
simulator replay exactly the same requests) it runs the planner on the simulator found on the
Python path and reports:

- attainment (TTFT / ITL), GPU-hours, the pools' mean and largest sizes;
- the decode correction's range over the run, and the decode pool's sizes with what bound them;
- the ITL misses: their median output length, and how long they waited for a decode worker
  after their first token (the simulator before the live request path admitted a sequence to a
  decode worker only once its first token was out; with that path the wait comes before the
  first token and is reported for the TTFT misses instead);
- the planned rate against the forecast's mean after each burst (the prefill pool's swings).

    python bench/plan_failure_modes.py --save-npz FILE --kind prefill_heavy --copies 40   # make one
    python bench/plan_failure_modes.py --workload-npz FILE [--label L] [--output FILE]

One JSON line on stdout. Run it with `PYTHONPATH=<a checkout>` to measure that version.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

import numpy as np


def save(args) -> int:
    from sim.workload import scale_load, synthetic_workload

    w = scale_load(synthetic_workload(args.kind, args.seed, args.seconds + 120.0, args.rate_scale), args.copies,
                   args.seed)
    np.savez(args.save_npz, t=w.arrival_s, p=w.prompt, o=w.output)
    print(json.dumps({"saved": args.save_npz, "requests": len(w)}))
    return 0


def joins() -> dict[int, float]:
    """Decode admission times, on a simulator whose decode worker admits after the first token."""
    seen: dict[int, float] = {}
    try:
        from sim.plan.workers import DecodeWorker       # the simulator before the live request path
    except ImportError:
        return seen
    admit = DecodeWorker._admit

    def recording(self):
        before = set(self.joined)
        admit(self)
        for rid in set(self.joined) - before:
            seen[rid] = self.t0
    DecodeWorker._admit = recording
    return seen


def analyse(args) -> int:
    from perf.profile import load_profile
    from planner import Planner, PlannerConfig
    from sim.plan.simulator import SimConfig, Simulation
    from sim.workload import Workload, split_history

    z = np.load(args.workload_npz)
    hist, rep = split_history(Workload("npz", z["t"], z["p"], z["o"], None), 120.0)
    profile = load_profile(None)
    from splitserve.bench.plan import SIMULATED_POOLS
    cfg = PlannerConfig(2.0, 0.05, startup_s=profile.startup_s,        # the pools `bench plan` simulates
                        prefill=SIMULATED_POOLS.prefill, decode=SIMULATED_POOLS.decode)
    joined = joins()
    r = Simulation(rep, profile, SimConfig(2.0, 0.05, cfg.interval_s, profile.startup_s, 0, 2.0),
                   planner=Planner(cfg, profile), history=hist).run()
    ok_t, ok_i = r.ttft_ok(2.0), r.itl_ok(0.05)
    itl_miss = np.flatnonzero(~ok_i & ok_t)
    rec = {"bench": "plan_failure_modes", "label": args.label, "requests": len(rep),
           "sla_attainment": round(float((ok_t & ok_i).mean()), 5), "ttft_attainment": round(float(ok_t.mean()), 5),
           "itl_attainment": round(float(ok_i.mean()), 5), "gpu_hours": round(r.gpu_s / 3600, 3),
           "ttft_p99_s": round(float(np.percentile(r.ttft_s, 99)), 2),
           "mean_prefill_workers": round(float(np.mean([p.prefill_active for p in r.timeline])), 2),
           "max_prefill_workers": max(p.prefill_active for p in r.timeline),
           "mean_decode_workers": round(float(np.mean([p.decode_active for p in r.timeline])), 2),
           "decode_correction_range": [round(min(d.decode.correction for d in r.decisions), 4),
                                       round(max(d.decode.correction for d in r.decisions), 4)],
           "decode_sizes": [[f"{d}/{lim}", n] for (d, lim), n in
                            Counter((d.decode.desired, d.decode.limit) for d in r.decisions).most_common(6)],
           "itl_misses": len(itl_miss),
           "itl_miss_median_output": float(np.median(rep.output[itl_miss])) if len(itl_miss) else None}
    if joined and len(itl_miss):
        wait = np.array([joined.get(int(i), np.nan) - r.first_token_s[i] for i in itl_miss])
        rec["itl_miss_median_decode_wait_s"] = round(float(np.nanmedian(wait)), 3)
        rec["itl_miss_share_waiting_over_0_5_s"] = round(float(np.mean(wait > 0.5)), 3)
    if hasattr(r, "decode_wait_s"):
        ttft_miss = ~ok_t
        rec["ttft_misses"] = int(ttft_miss.sum())
        rec["ttft_miss_share_waiting_for_decode_over_0_5_s"] = round(
            float(np.mean(r.decode_wait_s[ttft_miss] > 0.5)), 3) if ttft_miss.any() else None
        rec["local_prefill_share"] = round(float(r.local_prefill.mean()), 4)
    ratio = np.array([d.load.plan_rate_rps / max(d.load.rate_rps, 1e-9) for d in r.decisions[1:]])
    rec["plan_over_rate_p50_p90_max"] = [round(float(x), 2) for x in np.percentile(ratio, [50, 90, 100])]
    rec["lift_max"] = [round(max(getattr(d.prefill, "lift", 1.0) for d in r.decisions), 2),
                       round(max(getattr(d.decode, "lift", 1.0) for d in r.decisions), 2)]
    line = json.dumps(rec)
    print(line)
    if args.output:
        with open(args.output, "a") as f:
            f.write(line + "\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload-npz")
    p.add_argument("--save-npz")
    p.add_argument("--kind", default="prefill_heavy")
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--copies", type=float, default=40.0)
    p.add_argument("--seconds", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    if bool(args.workload_npz) == bool(args.save_npz):
        print("plan_failure_modes: give one of --workload-npz and --save-npz", file=sys.stderr)
        return 2
    return save(args) if args.save_npz else analyse(args)


if __name__ == "__main__":
    sys.exit(main())

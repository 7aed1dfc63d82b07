"""How few GPU-hours any interval planner could spend on a trace: a clairvoyant lower bound.

The clairvoyant knows every request of every planner interval in advance, resizes both pools at
each interval's start at no cost (no start-up, no draining, no queue or running batch carried in
from the interval before) and picks, per interval, the prefill and decode pool sizes that minimise
GPU time over the whole run subject to the run's attainment goal (misses may be spent where they
save the most). What a pool of a given size does to an interval's requests is read from runs of
the same simulator `bench plan` uses, on that interval's requests alone, from empty pools:

- prefill only, with P workers, P = 1, 2, ... until none of the interval's requests misses its
  TTFT target;
- decode only, with D workers, fed the first-token times of the largest P's run, D = 1, 2, ...
  until none misses its ITL target.

A request meets the SLA under (P, D) if it meets both (the union of the two runs' misses; a run of
both pools together misses a few more). Every simplification errs on the clairvoyant's side (empty
pools at each interval's start, free resizing, the union) except one: each interval also starts
with empty prefix caches, which on a trace with shared prefixes (Mooncake's hash ids) costs it
hits. There the bound is not one (`lower_bound_holds` is false); on traces without prefix ids
(Azure, the synthetic ones) nothing is cached anyway. The interval choices are found by
Lagrangian relaxation: for a price per miss, each interval takes its cheapest (P, D); the price is
bisected to the least GPU time whose misses fit the goal. That choice is feasible
(`clairvoyant_gpu_hours`); the relaxation's dual value at the same price (`lower_bound_gpu_hours`)
is a bound no choice of sizes can go under (the two are usually a fraction of a percent apart).

A second estimate (`carried_*`) reads each interval's outcomes from whole-run static runs of
each size instead, so queues and batches come in from the interval before as that size left
them: closer to what a resized pool sees after a quiet spell, harsher than the truth after a
peak (a small pool's backlog from the peak is charged to it). It is an estimate, not a bound.

`one_late_*`: the carried estimate's per-interval choices applied one interval late (a perfect
report of the last interval instead of foresight): what following the optimum costs.

The static comparator is the cheapest fixed split whose union attainment over those whole-run
static runs reaches the goal (as `bench plan`'s static search, without its final joint run).

No planner that decides once per interval, sees only the past and pays the start-up spends less
than the bound at the same attainment (up to the simulator's routing noise), so where the bound is above 0.75 x the static GPU-hours, no planner can reach that
bar in this simulator; where it is below, the gap is the price of not knowing the next minute.

    python bench/plan_clairvoyant.py --trace FILE --load-scale K --ttft-ms 2000 --itl-ms 50 \
        [--interval-s 30 ...] [--target 0.99 ...] [--output FILE]

One JSON line per (interval, target) on stdout. The profile defaults to the planner's.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from perf.profile import load_profile  # noqa: E402
from sim.plan.simulator import SimConfig, Simulation  # noqa: E402
from sim.workload import load_workload, scale_load, split_history  # noqa: E402
from splitserve.bench.records import cpu_model  # noqa: E402
from splitserve.bench.serve import emit, git_sha  # noqa: E402

MAX_WORKERS = 1024      # a pool size past which no trace here goes


def shifted(w, index: np.ndarray, start_s: float):
    """The requests at ``index``, their arrivals moved so that ``start_s`` is 0."""
    sub = w.take(index)
    return replace(sub, arrival_s=sub.arrival_s - start_s)


def sizes_up(run, done) -> dict[int, np.ndarray]:
    """run(n) for n = 1, 2, ... (the requests' met-or-not array) until done(results, n), or until
    two sizes in a row meet no more requests than the one before them: what is left then no size
    meets (a prompt whose prefill alone takes longer than the target), and bigger pools change
    nothing. (An overloaded pool meets more with each worker added, so it does not stop there.)"""
    out: dict[int, np.ndarray] = {}
    n = 0
    while True:
        n += 1
        out[n] = run(n)
        flat = n > 2 and out[n].sum() <= out[n - 1].sum() <= out[n - 2].sum()
        if done(out, n) or flat or n >= MAX_WORKERS:
            return out


def interval_runs(replay, profile, cfg: SimConfig, interval_s: float, progress: bool):
    """Per interval: TTFT met per request for P = 1, 2, ... and ITL met for D = 1, 2, ..., each
    up to the first size that misses nothing it could meet (a bigger pool is taken to do no
    better)."""
    k = np.floor(replay.arrival_s / interval_s).astype(int)
    out = []
    bar = tqdm(total=len(replay), desc=f"intervals of {interval_s:g} s", unit="req", file=sys.stderr,
               disable=not progress)
    for j in range(int(k.max()) + 1):
        index = np.flatnonzero(k == j)
        if not len(index):
            out.append((index, {}, {}))
            continue
        sub = shifted(replay, index, j * interval_s)
        first: dict[int, np.ndarray] = {}

        def prefill(p: int) -> np.ndarray:
            r = Simulation(sub, profile, cfg, prefill_workers=p, stages=("prefill",)).run()
            first[p] = r.first_token_s
            return r.ttft_ok(cfg.ttft_target_s)

        ttft = sizes_up(prefill, lambda got, n: bool(got[n].all()))
        entries = first[max(ttft)]
        itl = sizes_up(lambda d: Simulation(sub, profile, cfg, decode_workers=d, stages=("decode",),
                                            decode_entry_s=entries).run().itl_ok(cfg.itl_target_s),
                       lambda got, n: bool(got[n].all()))
        out.append((index, ttft, itl))
        bar.update(len(index))
    bar.close()
    return out


def whole_runs(replay, profile, cfg: SimConfig, goal: float, progress: bool):
    """Static runs of the whole replay: TTFT met per request for P = 1, 2, ... up to one past the
    least P that meets the goal alone, then ITL for D likewise (fed the first tokens of that least
    P's run, as the static search does; of the largest P's if none meets it)."""
    first: dict[int, np.ndarray] = {}
    end_s = [0.0]

    def prefill(p: int) -> np.ndarray:
        r = Simulation(replay, profile, cfg, prefill_workers=p, stages=("prefill",), progress=progress,
                       desc=f"static P={p}").run()
        first[p] = r.first_token_s
        return r.ttft_ok(cfg.ttft_target_s)

    def decode(d: int) -> np.ndarray:
        r = Simulation(replay, profile, cfg, decode_workers=d, stages=("decode",), decode_entry_s=entries,
                       progress=progress, desc=f"static D={d}")
        result = r.run()
        end_s[0] = result.end_s
        return result.itl_ok(cfg.itl_target_s)

    def one_past_goal(got: dict[int, np.ndarray], n: int) -> bool:
        met = [q for q in got if got[q].mean() >= goal]
        return bool(met) and n > min(met)

    ttft = sizes_up(prefill, one_past_goal)
    met = [q for q in ttft if ttft[q].mean() >= goal]
    entries = first[min(met) if met else max(ttft)]
    itl = sizes_up(decode, one_past_goal)
    return ttft, itl, end_s[0]


def carried_runs(arrival_s: np.ndarray, ttft, itl, interval_s: float):
    """The per-interval outcomes read from the whole-run static runs instead: each size's queues
    and batches carried in from the interval before as that size left them."""
    k = np.floor(arrival_s / interval_s).astype(int)
    out = []
    for j in range(int(k.max()) + 1):
        index = np.flatnonzero(k == j)
        out.append((index, {p: v[index] for p, v in ttft.items()}, {d: v[index] for d, v in itl.items()}))
    return out


def cheapest_static(ttft, itl, target: float) -> tuple[int, int, float] | None:
    """The fixed (P, D) of least P + D whose union attainment reaches `target` (then least P)."""
    best = None
    for p, t in ttft.items():
        for d, i in itl.items():
            a = float((t & i).mean())
            if a >= target and (best is None or (p + d, p) < (best[0] + best[1], best[0])):
                best = (p, d, a)
    return best


def clairvoyant(runs, n: int, end_s: float, interval_s: float, target: float):
    """Least GPU-seconds over per-interval (P, D) choices with total misses <= the allowance.
    Returns (GPU-seconds, the dual lower bound in GPU-seconds, attainment, time-weighted mean P,
    mean D, the (P, D) picked per interval), or None if no choice fits."""
    n_int = max(len(runs), int(math.ceil(end_s / interval_s)))
    length = np.full(n_int, interval_s)
    length[-1] = end_s - interval_s * (n_int - 1)
    # per interval: candidate (P, D) pairs, their misses and their cost
    options = []
    for j in range(n_int):
        index, ttft, itl = runs[j] if j < len(runs) else (np.zeros(0, int), {}, {})
        if not len(index):
            options.append(([(0, 0)], np.zeros(1), np.zeros(1)))
            continue
        pairs = [(p, d) for p in ttft for d in itl]
        miss = np.array([float((~(ttft[p] & itl[d])).sum()) for p, d in pairs])
        cost = np.array([(p + d) * length[j] for p, d in pairs])
        options.append((pairs, miss, cost))
    allowed = math.floor((1 - target) * n + 1e-9)

    def solve(price: float):
        gpu = missed = 0.0
        picks = []
        for pairs, miss, cost in options:
            c = int(np.argmin(cost + price * miss))
            gpu += cost[c]
            missed += miss[c]
            picks.append(pairs[c])
        return picks, gpu, missed

    lo, hi = 0.0, 1.0
    while solve(hi)[2] > allowed:        # a price at which the misses fit
        hi *= 2
        if hi > 1e15:
            return None
    for _ in range(50):
        mid = (lo + hi) / 2
        if solve(mid)[2] > allowed:
            lo = mid
        else:
            hi = mid
    picks, gpu_s, missed = solve(hi)
    dual = max(g + price * (m - allowed) for price in (lo, hi) for _, g, m in [solve(price)])
    busy = [(p, d, w) for (p, d), w in zip(picks, length)]
    total = float(length.sum())
    return (gpu_s, min(dual, gpu_s), 1 - missed / n, sum(p * w for p, _, w in busy) / total,
            sum(d * w for _, d, w in busy) / total, picks)


def lagged(runs, picks, n: int, end_s: float, interval_s: float) -> tuple[float, float]:
    """GPU-hours and attainment of sizing each interval with the choice made for the interval
    before it (a perfect report of the last interval, one interval late; the first keeps its own).
    A size outside what was measured for an interval is read as the nearest measured one."""
    shifted_picks = picks[:1] + picks[:-1]
    gpu_s = missed = 0.0
    for j, ((index, ttft, itl), (p, d)) in enumerate(zip(runs, shifted_picks)):
        length = min(interval_s, end_s - j * interval_s)
        gpu_s += (p + d) * length
        if len(index):
            p = min(max(p, min(ttft)), max(ttft))
            d = min(max(d, min(itl)), max(itl))
            missed += float((~(ttft[p] & itl[d])).sum())
    return gpu_s / 3600, 1 - missed / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="Azure CSV, Mooncake JSONL or synthetic:NAME")
    ap.add_argument("--load-scale", type=float, default=1.0)
    ap.add_argument("--ttft-ms", type=float, required=True)
    ap.add_argument("--itl-ms", type=float, required=True)
    ap.add_argument("--interval-s", type=float, nargs="+", default=[30.0])
    ap.add_argument("--target", type=float, nargs="+", default=[0.99],
                    help="attainment goals (the static comparator is the cheapest split reaching each)")
    ap.add_argument("--warm-start-s", type=float, default=120.0, help="as bench plan: not replayed")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=None, help="append the JSON lines to this file")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    if args.ttft_ms <= 0 or args.itl_ms <= 0 or min(args.interval_s) <= 0 or args.load_scale <= 0:
        ap.error("--ttft-ms, --itl-ms, --interval-s and --load-scale must be > 0")
    if not all(0 < t < 1 for t in args.target):
        ap.error("--target must be in (0, 1)")
    try:
        profile = load_profile(args.profile)
        workload = scale_load(load_workload(args.trace, args.seed), args.load_scale, args.seed)
    except (OSError, ValueError) as e:          # WorkloadError is a ValueError
        print(f"plan_clairvoyant: {e}", file=sys.stderr)
        return 2
    _, replay = split_history(workload, args.warm_start_s)
    if not len(replay):
        print(f"plan_clairvoyant: nothing to replay after --warm-start-s {args.warm_start_s}", file=sys.stderr)
        return 2
    cfg = SimConfig(args.ttft_ms / 1e3, args.itl_ms / 1e3, 30.0, profile.startup_s, args.seed)
    progress = not args.no_progress
    ttft, itl, end_s = whole_runs(replay, profile, cfg, min(args.target), progress)
    per_interval = {i: interval_runs(replay, profile, cfg, i, progress) for i in args.interval_s}
    carried = {i: carried_runs(replay.arrival_s, ttft, itl, i) for i in args.interval_s}
    for target in args.target:
        static = cheapest_static(ttft, itl, target)
        for interval, runs in per_interval.items():
            rec = {"bench": "plan_clairvoyant", "git_sha": git_sha(), "cpu_model": cpu_model(),
                   "trace": Path(args.trace).name, "load_scale": args.load_scale, "seed": args.seed,
                   "requests": len(replay), "profile": profile.name, "ttft_ms": args.ttft_ms,
                   "itl_ms": args.itl_ms, "interval_s": interval, "target": target, "end_s": round(end_s, 1),
                   "lower_bound_holds": not any(replay.hashes or ()),
                   "static_ttft_attainment": {p: round(float(v.mean()), 5) for p, v in sorted(ttft.items())},
                   "static_itl_attainment": {d: round(float(v.mean()), 5) for d, v in sorted(itl.items())}}
            if static:
                rec["static_config"] = {"prefill": static[0], "decode": static[1]}
                rec["static_union_attainment"] = round(static[2], 5)
                rec["static_gpu_hours"] = round((static[0] + static[1]) * end_s / 3600, 4)
            c = clairvoyant(runs, len(replay), end_s, interval, target)
            if c:
                gpu_s, bound_s, att, mp, md, _ = c
                rec.update({"clairvoyant_gpu_hours": round(gpu_s / 3600, 4),
                            "lower_bound_gpu_hours": round(bound_s / 3600, 4),
                            "clairvoyant_attainment": round(att, 5),
                            "clairvoyant_mean_prefill": round(mp, 3), "clairvoyant_mean_decode": round(md, 3)})
                if static:
                    rec["clairvoyant_ratio"] = round(gpu_s / 3600 / rec["static_gpu_hours"], 4)
                    rec["lower_bound_ratio"] = round(bound_s / 3600 / rec["static_gpu_hours"], 4)
            c = clairvoyant(carried[interval], len(replay), end_s, interval, target)
            if c:
                gpu_s, _, att, mp, md, picks = c
                rec.update({"carried_gpu_hours": round(gpu_s / 3600, 4), "carried_attainment": round(att, 5),
                            "carried_mean_prefill": round(mp, 3), "carried_mean_decode": round(md, 3)})
                late_h, late_att = lagged(carried[interval], picks, len(replay), end_s, interval)
                rec.update({"one_late_gpu_hours": round(late_h, 4), "one_late_attainment": round(late_att, 5)})
                if static:
                    rec["carried_ratio"] = round(gpu_s / 3600 / rec["static_gpu_hours"], 4)
            emit(rec, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

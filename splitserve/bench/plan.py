"""`splitserve bench plan`: replay an arrival trace through the planner core on a virtual clock,
and compare its GPU-hours with the cheapest static split that reaches the same attainment.

The trace (an Azure CSV, a Mooncake JSONL, or `synthetic:<kind>`, sim/workload.py) is scaled by
--load-scale (sim/workload.py), its first --warm-start-s seconds become the history the
planner is warm-started with, and the rest is replayed through simulated pools that run the
profile's timing and the real router along the live request path (sim/plan/simulator.py says what
is modelled and what not). Then sim/plan/static.py searches the cheapest static prefill/decode
split with the same simulator.

Definitions (docs/planner.md):

- sla_attainment: the share of replayed requests with TTFT <= --ttft-ms and mean ITL (from the
  first token to the last, over output - 1 gaps) <= --itl-ms; one-token outputs meet any ITL.
- gpu_hours: worker-seconds from each worker's start (starting included) to its stop (draining
  included) or the end of the run (the last request done), / 3600. static_gpu_hours: the static
  split's workers times the same span.
- scaling_actions: planner decisions that changed a pool's size (one per pool and decision).

Prints one JSON line (the last line of stdout); --backtest prints the predictor backtest instead.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

import numpy as np

from runtime.config import PLANNER_INTERVAL_S, PREFILL_ORDERS
from splitserve.bench.serve import emit, git_sha

DEFAULT_WARM_START_S = 120.0
BACKTEST_PREDICTORS = ("constant", "ewma(0.2)", "ewma(0.5)", "ewma(0.8)", "holt(0.2,0.1,0.9)",
                       "holt(0.3,0.1,0.9)", "holt(0.5,0.2,0.9)", "holt(0.5,0.1,1)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from planner.predictors import DEFAULT_PREDICTOR

    p.add_argument("--trace", required=True,
                   help="Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens), Mooncake JSONL, or "
                        "synthetic:diurnal / bursty / flash / prefill_heavy / decode_heavy")
    p.add_argument("--ttft-ms", type=float, required=True, help="TTFT target")
    p.add_argument("--itl-ms", type=float, required=True, help="target for each request's mean ITL")
    p.add_argument("--load-scale", type=float, default=1.0,
                   help="K copies of each request, arrivals jittered (seeded) by up to 1 s")
    p.add_argument("--profile", default=None, help="JSON performance profile (default: the shipped H100 8B one)")
    p.add_argument("--startup-s", type=float, default=None,
                   help="worker start-to-ready (default: the profile's, else perf.profile.DEFAULT_STARTUP_S)")
    p.add_argument("--interval-s", type=float, default=PLANNER_INTERVAL_S, help="planner decision interval")
    p.add_argument("--warm-start-s", type=float, default=DEFAULT_WARM_START_S,
                   help="the trace's first seconds: history for the planner, not replayed")
    p.add_argument("--predictor", default=DEFAULT_PREDICTOR, help="constant, ewma[(a)], holt[(a,b,phi)]")
    p.add_argument("--attainment-goal", type=float, default=0.99)
    p.add_argument("--arrival-quantile", type=float, default=0.9)
    p.add_argument("--hysteresis", type=float, default=0.1)
    p.add_argument("--prefill-down-delay-s", type=float, default=0.0,
                   help="the prefill pool shrinks only after this long unneeded (default 0: the hysteresis alone)")
    p.add_argument("--decode-down-delay-s", type=float, default=None,
                   help="the decode pool shrinks only after this long unneeded (default: the start-up time)")
    p.add_argument("--min-prefill", type=int, default=1)
    p.add_argument("--max-prefill", type=int, default=256)
    p.add_argument("--min-decode", type=int, default=1)
    p.add_argument("--max-decode", type=int, default=256)
    p.add_argument("--gpu-budget", type=int, default=None, help="workers of both pools at most")
    p.add_argument("--prefill-order", choices=PREFILL_ORDERS, default=PREFILL_ORDERS[0],
                   help="prefill workers' queue: deadline (the oldest prompt that can still meet the TTFT "
                        "target first, as `serve --ttft-ms` runs them) or fifo (arrival order)")
    p.add_argument("--remote-prefill-min-tokens", type=int, default=None,
                   help="a prompt goes to a prefill worker only with this many tokens to compute "
                        "(default: the frontend's)")
    p.add_argument("--max-prefill-queue-tokens", type=int, default=None,
                   help="a prefill worker with more queued prompt tokens counts as saturated: the prompt is "
                        "computed on its decode worker (default: the frontend's)")
    p.add_argument("--handoff-ms", type=float, default=None,
                   help="a remote first token reaches the client this long after its prefill (KV push and the "
                        "decode worker's first step; default: the H100 measurement)")
    p.add_argument("--no-static", action="store_true", help="skip the static baseline search")
    p.add_argument("--backtest", action="store_true",
                   help="print the predictors' backtest on the trace's per-interval arrivals and exit")
    p.add_argument("--plot", default=None, help="write load, replicas and latency over time to this PNG")
    p.add_argument("--decisions", default=None, help="write every planner decision to this JSONL file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="append the JSON line(s) to this file")
    p.add_argument("--label", default="", help="a note stored in the JSON")
    p.add_argument("--no-progress", action="store_true")


class PlanInputError(ValueError):
    """Bad flags; reported to the user, exit status 2."""


def _configs(args: argparse.Namespace, startup_s: float):
    from planner import PlannerConfig, PoolLimits
    from sim.plan.simulator import SimConfig

    if args.ttft_ms <= 0 or args.itl_ms <= 0 or args.interval_s <= 0 or args.warm_start_s < 0:
        raise PlanInputError("--ttft-ms, --itl-ms and --interval-s must be > 0, --warm-start-s >= 0")
    if startup_s < 0:
        raise PlanInputError("--startup-s must be >= 0")
    try:
        planner = PlannerConfig(
            ttft_target_s=args.ttft_ms / 1e3, itl_target_s=args.itl_ms / 1e3,
            attainment_goal=args.attainment_goal, interval_s=args.interval_s, startup_s=startup_s,
            prefill=PoolLimits(args.min_prefill, args.max_prefill), decode=PoolLimits(args.min_decode, args.max_decode),
            gpu_budget=args.gpu_budget, predictor=args.predictor, arrival_quantile=args.arrival_quantile,
            hysteresis=args.hysteresis, prefill_down_delay_s=args.prefill_down_delay_s,
            decode_down_delay_s=args.decode_down_delay_s,
            prefill_deadline=args.prefill_order == "deadline")
    except ValueError as e:
        raise PlanInputError(str(e)) from None
    deadline = planner.ttft_target_s if planner.prefill_deadline else None
    live = {k: v for k, v in (("remote_prefill_min_tokens", args.remote_prefill_min_tokens),
                              ("max_prefill_queue_tokens", args.max_prefill_queue_tokens),
                              ("handoff_s", None if args.handoff_ms is None else args.handoff_ms / 1e3))
            if v is not None}
    try:
        sim = SimConfig(planner.ttft_target_s, planner.itl_target_s, args.interval_s, startup_s, args.seed,
                        deadline, **live)
    except ValueError as e:
        raise PlanInputError(str(e)) from None
    return planner, sim


def _summary(r, ttft_s: float, itl_s: float, prompt: np.ndarray) -> dict:
    ttft_ok, itl_ok = r.ttft_ok(ttft_s), r.itl_ok(itl_s)
    itl = r.itl_s[~np.isnan(r.itl_s)]

    def q(x: np.ndarray, p: float) -> float | None:
        return round(float(np.percentile(x, p)), 4) if len(x) else None

    return {"sla_attainment": round(float((ttft_ok & itl_ok).mean()), 5),
            "ttft_attainment": round(float(ttft_ok.mean()), 5), "itl_attainment": round(float(itl_ok.mean()), 5),
            "ttft_p50_s": q(r.ttft_s, 50), "ttft_p90_s": q(r.ttft_s, 90), "ttft_p99_s": q(r.ttft_s, 99),
            "itl_mean_s": round(float(itl.mean()), 5) if len(itl) else None, "itl_p90_s": q(itl, 90),
            "prefix_hit_rate": round(float(r.cached_tokens.sum() / prompt.sum()), 4)}


def run_backtest(args: argparse.Namespace, workload, startup_s: float) -> int:
    from planner.predictors import backtest, make_predictor

    counts = np.bincount((workload.arrival_s // args.interval_s).astype(int)).astype(float)
    series = counts[:-1].tolist() if len(counts) > 2 else counts.tolist()   # the last interval is partial
    horizon = max(1, math.ceil((startup_s + args.interval_s) / args.interval_s))
    for name in BACKTEST_PREDICTORS:
        r = backtest(series, lambda: make_predictor(name), horizon)
        emit({"bench": "plan_backtest", "trace": workload.name, "interval_s": args.interval_s,
              "horizon": horizon, "predictor": r.predictor, "points": r.points, "mae_1": round(r.mae_1, 4),
              "mae_h": round(r.mae_h, 4), "peak_coverage": round(r.peak_coverage, 4),
              "overprovision": round(r.overprovision, 4), "pinball": round(r.pinball, 4)}, args.output)
    return 0


def main(args: argparse.Namespace) -> int:
    from planner import Planner
    from perf.profile import load_profile
    from sim.plan.simulator import Simulation
    from sim.plan.static import StaticSearch
    from sim.workload import WorkloadError, load_workload, scale_load, split_history

    try:
        profile = load_profile(args.profile)
        startup_s = profile.startup_s if args.startup_s is None else args.startup_s
        planner_cfg, sim_cfg = _configs(args, startup_s)
        workload = scale_load(load_workload(args.trace, args.seed), args.load_scale, args.seed)
        if args.backtest:
            return run_backtest(args, workload, startup_s)
        history, replay = split_history(workload, args.warm_start_s)
        if not len(replay):
            raise PlanInputError(f"nothing to replay after --warm-start-s {args.warm_start_s}")
        planner = Planner(planner_cfg, profile)
    except (PlanInputError, WorkloadError, ValueError) as e:
        print(f"bench plan: {e}", file=sys.stderr)
        return 2
    progress = not args.no_progress
    t0 = time.perf_counter()
    result = Simulation(replay, profile, sim_cfg, planner=planner, history=history, progress=progress,
                        desc="planner").run()
    planner_wall_s = time.perf_counter() - t0
    ttft_s, itl_s = planner_cfg.ttft_target_s, planner_cfg.itl_target_s
    summary = _summary(result, ttft_s, itl_s, replay.prompt)
    gpu_hours = result.gpu_s / 3600
    static = None
    t1 = time.perf_counter()
    if not args.no_static:
        hint = (max(d.prefill.desired for d in result.decisions), max(d.decode.desired for d in result.decisions))
        # the exact share, not the summary's rounded one: rounded up, it would ask the static
        # split for one miss fewer than the planner had
        met = float((result.ttft_ok(ttft_s) & result.itl_ok(itl_s)).mean())
        static = StaticSearch(replay, profile, sim_cfg, met, progress).run(hint)
    static_wall_s = time.perf_counter() - t1
    static_gpu_hours = static.workers * result.end_s / 3600 if static else None
    timeline = result.timeline
    record = {
        "bench": "plan", "git_sha": git_sha(),
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})", "label": args.label,
        "trace": os.path.basename(args.trace), "load_scale": args.load_scale, "seed": args.seed,
        "requests": len(replay), "history_requests": len(history), "warm_start_s": args.warm_start_s,
        "ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms, "startup_s": startup_s,
        "profile": profile.name, "interval_s": args.interval_s, "predictor": planner.predictor.name,
        "attainment_goal": args.attainment_goal, "arrival_quantile": args.arrival_quantile,
        "hysteresis": args.hysteresis, "prefill_down_delay_s": planner_cfg.down_delay(decode=False),
        "decode_down_delay_s": planner_cfg.down_delay(decode=True), "gpu_budget": args.gpu_budget,
        "prefill_order": args.prefill_order, "handoff_s": sim_cfg.handoff_s,
        "max_prefill_queue_tokens": sim_cfg.max_prefill_queue_tokens,
        "local_prefill_share": round(float(result.local_prefill.mean()), 4),
        **summary,
        "gpu_hours": round(gpu_hours, 4),
        "static_gpu_hours": round(static_gpu_hours, 4) if static_gpu_hours else None,
        "static_config": {"prefill": static.prefill, "decode": static.decode} if static else None,
        "static_sla_attainment": round(static.attainment, 5) if static else None,
        "gpu_hours_ratio": round(gpu_hours / static_gpu_hours, 4) if static_gpu_hours else None,
        "scaling_actions": result.scaling_actions, "workers_started": result.workers_started,
        "max_workers": result.max_workers,
        "mean_prefill_workers": round(float(np.mean([p.prefill_active for p in timeline])), 3) if timeline else None,
        "mean_decode_workers": round(float(np.mean([p.decode_active for p in timeline])), 3) if timeline else None,
        "duration_s": round(result.end_s, 1), "planner_wall_s": round(planner_wall_s, 1),
        "static_wall_s": round(static_wall_s, 1), "static_runs": static.runs if static else None,
        "last_decision": result.decisions[-1].summary() if result.decisions else None,
    }
    if args.decisions:
        write_decisions(result.decisions, args.decisions)
    if args.plot:
        from splitserve.bench.plan_plot import plot_plan
        plot_plan(result, static, planner_cfg, args.plot,
                  f"{record['trace']} x{args.load_scale:g}, TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms, "
                  f"start-up {startup_s:g} s ({record['git_sha']})")
    emit(record, args.output)
    return 0


def write_decisions(decisions, path: str) -> None:
    import dataclasses
    import json
    from enum import Enum

    def plain(x):
        if isinstance(x, Enum):
            return x.value
        if isinstance(x, float):
            return round(x, 6) if math.isfinite(x) else None
        return x

    with open(path, "w") as f:
        for d in decisions:
            row = dataclasses.asdict(d, dict_factory=lambda kv: {k: plain(v) for k, v in kv})
            f.write(json.dumps(row) + "\n")

"""`splitserve bench plan`: replay an arrival trace through the planner core on a virtual clock,
and compare its GPU-hours with the cheapest static split that reaches the same attainment.

The trace (an Azure CSV, a Mooncake JSONL, or `synthetic:<kind>`, sim/workload.py) is scaled by
--load-scale (sim/workload.py), its first --warm-start-s seconds become the history the
planner is warm-started with, and the rest is replayed through simulated pools that run the
profile's timing and the real router along the live request path (sim/plan/simulator.py says what
is modelled and what not). Then sim/plan/static.py searches the cheapest static prefill/decode
split with the same simulator.

The planner's flags are generated from its declared settings (runtime/config_planner.py), the
same as `serve --planner` and `splitserve planner` take, with the same defaults but for the pools'
limits (SIMULATED_POOLS); the flags this command spelled otherwise before keep working
(OLD_SPELLINGS). The frontend's conditional-disaggregation settings the simulator follows
(SIMULATED_FRONTEND) are generated from their declarations in runtime/config.py, with the
frontend's defaults. The trace, the load scale, the KV handoff's time, the seed and the outputs
are this command's own.

Definitions (docs/planner.md):

- sla_attainment: the share of replayed requests with TTFT <= --ttft-ms and mean ITL (from the
  first token to the last, over output - 1 gaps) <= --itl-ms; one-token outputs meet any ITL.
- gpu_hours: worker-seconds from each worker's start (starting included) to its stop (draining
  included) or the end of the run (the last request done), / 3600. static_aggregated and
  static_disaggregated: the best static configuration of each mode at the planner's attainment
  (config, GPU-hours, attainment). static_gpu_hours: the static
  split's workers times the same span.
- planner_mode: --planner-mode; mode_share: the share of the planner's decisions in each serving
  mode; mode_switches: how often it changed mode.
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
from dataclasses import dataclass, field, replace

import numpy as np

from runtime.cli_args import add_config_args, config_from_args, flag_values
from runtime.config import FrontendConfig
from runtime.config_fields import ConfigError
from runtime.config_planner import HARD_MAX_WORKERS, PoolLimitsConfig, ServingMode, SlaConfig
from splitserve.bench.serve import emit, git_sha

DEFAULT_WARM_START_S = 120.0
BACKTEST_PREDICTORS = ("constant", "ewma(0.2)", "ewma(0.5)", "ewma(0.8)", "holt(0.2,0.1,0.9)",
                       "holt(0.3,0.1,0.9)", "holt(0.5,0.2,0.9)", "holt(0.5,0.1,1)")
# The simulated pools: both at least one worker and no cap below the hard one, so that a run shows what
# the planner wants rather than where a deployment's limits stop it. Pass the pool flags to simulate those.
# With the mode choice on (--planner-mode aggregated or auto) the prefill pool's minimum is 0 unless
# given: aggregated serving is a prefill pool of 0 (the simulator then computes every prompt on its
# decode worker, as the frontend does).
SIMULATED_POOLS = PoolLimitsConfig(min_prefill_workers=1, max_prefill_workers=HARD_MAX_WORKERS,
                                   min_decode_workers=1, max_decode_workers=HARD_MAX_WORKERS)
MIN_PREFILL_FLAG = "pools.min_prefill_workers"
# The flags `bench plan` spelled its own way before its planner flags were generated; they still work.
OLD_SPELLINGS = {"sla.interval_s": ("--interval-s",), "sla.profile": ("--profile",), "sla.startup_s": ("--startup-s",),
                 "pools.min_prefill_workers": ("--min-prefill",), "pools.max_prefill_workers": ("--max-prefill",),
                 "pools.min_decode_workers": ("--min-decode",), "pools.max_decode_workers": ("--max-decode",)}
# The frontend's settings that decide where a prompt is computed (frontend/generate.py), which the
# simulator follows; their flags are the frontend's own, under this prefix in the namespace.
SIMULATED_FRONTEND = ("remote_prefill_min_tokens", "max_prefill_queue_tokens", "itl_guard_mode")
FRONTEND_PREFIX = "frontend."


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """The planner's settings a `bench plan` run simulates: the declared ones (runtime/config_planner.py),
    with the simulated pools' limits as their defaults."""
    sla: SlaConfig = field(default_factory=SlaConfig)
    pools: PoolLimitsConfig = field(default_factory=lambda: SIMULATED_POOLS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True,
                   help="Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens), Mooncake JSONL, or "
                        "synthetic:diurnal / bursty / flash / prefill_heavy / decode_heavy")
    p.add_argument("--load-scale", type=float, default=1.0,
                   help="K copies of each request, arrivals jittered (seeded) by up to 1 s (default: 1.0)")
    p.add_argument("--warm-start-s", type=float, default=DEFAULT_WARM_START_S,
                   help=f"the trace's first seconds: history for the planner, not replayed "
                        f"(default: {DEFAULT_WARM_START_S})")
    add_config_args(p, PlanSettings, config_file=False, aliases=OLD_SPELLINGS, required=("sla.ttft_ms", "sla.itl_ms"))
    add_config_args(p, FrontendConfig, only=SIMULATED_FRONTEND, config_file=False, prefix=FRONTEND_PREFIX)
    p.add_argument("--handoff-ms", type=float, default=None,
                   help="a remote first token reaches the client this long after its prefill (KV push and the "
                        "decode worker's first step; default: the H100 measurement, sim/plan/config.py)")
    p.add_argument("--no-static", action="store_true", help="skip the static baseline search")
    p.add_argument("--backtest", action="store_true",
                   help="print the predictors' backtest on the trace's per-interval arrivals and exit")
    p.add_argument("--plot", default=None, help="write load, replicas and latency over time to this PNG")
    p.add_argument("--decisions", default=None, help="write every planner decision to this JSONL file")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the load scaling's jitter and the simulation (default: 0)")
    p.add_argument("--output", default=None, help="append the JSON line(s) to this file")
    p.add_argument("--label", default="", help="a note stored in the JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


class PlanInputError(ValueError):
    """Bad flags; reported to the user, exit status 2."""


def plan_settings(args: argparse.Namespace) -> PlanSettings:
    """The planner settings the flags describe (ConfigError for a bad one); with the mode choice on,
    the simulated prefill pool may go to 0 unless its minimum is given."""
    settings = config_from_args(PlanSettings, args)
    if settings.sla.mode is ServingMode.DISAGGREGATED or MIN_PREFILL_FLAG in flag_values(PlanSettings, args):
        return settings
    return replace(settings, pools=replace(settings.pools, min_prefill_workers=0))


def _configs(args: argparse.Namespace, settings: PlanSettings, profile_startup_s: float):
    from planner import PlannerConfig
    from sim.plan.simulator import SimConfig

    sla = settings.sla
    if sla.ttft_ms <= 0 or sla.itl_ms <= 0 or sla.interval_s <= 0 or args.warm_start_s < 0:
        raise PlanInputError("--ttft-ms, --itl-ms and --planner-interval-s must be > 0, --warm-start-s >= 0")
    if sla.startup_s is not None and sla.startup_s < 0:
        raise PlanInputError("--planner-startup-s must be >= 0")
    try:
        planner = PlannerConfig.from_settings(sla, profile_startup_s, settings.pools)
    except ValueError as e:
        raise PlanInputError(str(e)) from None
    deadline = planner.ttft_target_s if planner.prefill_deadline else None
    live = {k.rpartition(".")[2]: v for k, v in flag_values(FrontendConfig, args, FRONTEND_PREFIX).items()}
    if args.handoff_ms is not None:
        live["handoff_s"] = args.handoff_ms / 1e3
    try:
        sim = SimConfig(planner.ttft_target_s, planner.itl_target_s, planner.interval_s, planner.startup_s,
                        args.seed, deadline, **live)
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


def run_backtest(args: argparse.Namespace, workload, planner_cfg) -> int:
    from planner.predictors import backtest, make_predictor

    interval_s = planner_cfg.interval_s
    counts = np.bincount((workload.arrival_s // interval_s).astype(int)).astype(float)
    series = counts[:-1].tolist() if len(counts) > 2 else counts.tolist()   # the last interval is partial
    horizon = max(1, math.ceil((planner_cfg.startup_s + interval_s) / interval_s))
    for name in BACKTEST_PREDICTORS:
        r = backtest(series, lambda: make_predictor(name), horizon)
        emit({"bench": "plan_backtest", "trace": workload.name, "interval_s": interval_s,
              "horizon": horizon, "predictor": r.predictor, "points": r.points, "mae_1": round(r.mae_1, 4),
              "mae_h": round(r.mae_h, 4), "peak_coverage": round(r.peak_coverage, 4),
              "overprovision": round(r.overprovision, 4), "pinball": round(r.pinball, 4)}, args.output)
    return 0


def main(args: argparse.Namespace) -> int:
    from planner import Planner
    from perf.profile import load_profile
    from sim.plan.simulator import Simulation
    from sim.workload import WorkloadError, load_workload, scale_load, split_history

    try:
        settings = plan_settings(args)
        profile = load_profile(settings.sla.profile)
        planner_cfg, sim_cfg = _configs(args, settings, profile.startup_s)
        workload = scale_load(load_workload(args.trace, args.seed), args.load_scale, args.seed)
        if args.backtest:
            return run_backtest(args, workload, planner_cfg)
        history, replay = split_history(workload, args.warm_start_s)
        if not len(replay):
            raise PlanInputError(f"nothing to replay after --warm-start-s {args.warm_start_s}")
        planner = Planner(planner_cfg, profile)
    except (PlanInputError, WorkloadError, ConfigError, ValueError) as e:
        print(f"bench plan: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = Simulation(replay, profile, sim_cfg, planner=planner, history=history, progress=not args.no_progress,
                        desc="planner").run()
    planner_wall_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    static, aggregated = (None, None) if args.no_static else _static(args, result, replay, profile,
                                                                      planner_cfg, sim_cfg)
    record = _record(args, settings.sla, planner_cfg, sim_cfg, planner, profile, result, static, history, replay)
    record.update(_modes(static, aggregated, result.end_s))
    record.update(planner_wall_s=round(planner_wall_s, 1), static_wall_s=round(time.perf_counter() - t1, 1),
                  static_runs=max(r.runs for r in (static, aggregated) if r) if static or aggregated else None,
                  last_decision=result.decisions[-1].summary() if result.decisions else None)
    if args.decisions:
        write_decisions(result.decisions, args.decisions)
    if args.plot:
        from splitserve.bench.plan_plot import plot_plan
        plot_plan(result, static, planner_cfg, args.plot,
                  f"{record['trace']} x{args.load_scale:g}, TTFT {settings.sla.ttft_ms:g} ms, ITL "
                  f"{settings.sla.itl_ms:g} ms, start-up {planner_cfg.startup_s:g} s ({record['git_sha']})")
    emit(record, args.output)
    return 0


def _static(args: argparse.Namespace, result, replay, profile, planner_cfg, sim_cfg):
    """The cheapest static split that reaches the planner's attainment, and the fewest aggregated
    workers that do (sim/plan/static.py)."""
    from sim.plan.static import StaticSearch

    ttft_s, itl_s = planner_cfg.ttft_target_s, planner_cfg.itl_target_s
    hint = (max(d.prefill.desired for d in result.decisions), max(d.decode.desired for d in result.decisions))
    # the exact share, not the summary's rounded one: rounded up, it would ask the static
    # split for one miss fewer than the planner had
    met = float((result.ttft_ok(ttft_s) & result.itl_ok(itl_s)).mean())
    return StaticSearch(replay, profile, sim_cfg, met, not args.no_progress).both_modes(hint)


def _modes(split, aggregated, end_s: float) -> dict:
    """The best static configuration of each serving mode at the planner's attainment:
    `static_disaggregated` (the split `static_*` reports) and `static_aggregated` (workers that
    each compute their own prompts), each with its GPU-hours and attainment (None: none reaches it)."""
    def mode(r, config: dict) -> dict | None:
        return None if r is None else {"config": config, "gpu_hours": round(r.workers * end_s / 3600, 4),
                                       "sla_attainment": round(r.attainment, 5)}
    return {"static_disaggregated": mode(split, {"prefill": split.prefill, "decode": split.decode} if split else {}),
            "static_aggregated": mode(aggregated, {"workers": aggregated.decode} if aggregated else {})}


def _record(args: argparse.Namespace, sla: SlaConfig, planner_cfg, sim_cfg, planner, profile, result, static,
            history, replay) -> dict:
    """The run's JSON line, but for its wall times and last decision."""
    summary = _summary(result, planner_cfg.ttft_target_s, planner_cfg.itl_target_s, replay.prompt)
    gpu_hours = result.gpu_s / 3600
    static_gpu_hours = static.workers * result.end_s / 3600 if static else None
    timeline = result.timeline
    return {
        "bench": "plan", "git_sha": git_sha(),
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})", "label": args.label,
        "trace": os.path.basename(args.trace), "load_scale": args.load_scale, "seed": args.seed,
        "requests": len(replay), "history_requests": len(history), "warm_start_s": args.warm_start_s,
        "ttft_ms": sla.ttft_ms, "itl_ms": sla.itl_ms, "startup_s": planner_cfg.startup_s,
        "profile": profile.name, "interval_s": sla.interval_s, "predictor": planner.predictor.name,
        "attainment_goal": sla.attainment_goal, "arrival_quantile": sla.arrival_quantile,
        "hysteresis": sla.hysteresis, "prefill_down_delay_s": planner_cfg.down_delay(decode=False),
        "decode_down_delay_s": planner_cfg.down_delay(decode=True), "gpu_budget": sla.gpu_budget,
        "prefill_order": sla.prefill_order.value, "handoff_s": sim_cfg.handoff_s,
        "remote_prefill_min_tokens": sim_cfg.remote_prefill_min_tokens,
        "max_prefill_queue_tokens": sim_cfg.max_prefill_queue_tokens,
        "itl_guard_mode": str(sim_cfg.itl_guard_mode),
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
        "duration_s": round(result.end_s, 1),
        "planner_mode": sla.mode.value, **planner_modes(result.decisions),
    }


def planner_modes(decisions) -> dict:
    """The serving modes the planner chose over the run: the share of decisions in each and the
    number of switches between them."""
    modes = [d.mode.mode for d in decisions]
    share = {m.value: round(modes.count(m) / len(modes), 4) if modes else None
             for m in (ServingMode.AGGREGATED, ServingMode.DISAGGREGATED)}
    return {"mode_share": share, "mode_switches": sum(a is not b for a, b in zip(modes, modes[1:]))}


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

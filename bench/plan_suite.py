"""The planner's generalization suite: every workload shape at several loads and seeds, every cell
reported.

The planner is judged on the suite as a whole, never on one trace. Workloads (sim/workload.py):

- prefill_heavy: long prompts, outputs of tens of tokens, random bursts (a code-completion shape);
- decode_heavy: short prompts, long outputs, a slowly drifting rate;
- conversation: the Azure LLM conversation trace (its first `--trace-s` seconds), scaled by copies;
- bursty, diurnal, flash: the synthetic step bursts, compressed day and flash crowd;
- mooncake: the Mooncake trace (prefix reuse), scaled by copies.

Generated workloads scale by arrival rate (a Poisson process stays one); the two public traces by
K copies of each request within a second (sim/workload.py `scale_load`), as `bench plan
--load-scale` does. Each workload is run at the loads whose static split needs about `--gpus`
GPUs (2 to 40): the largest load scale at which the sizing model, at the workload's p90 rate over
20 s intervals, asks for no more than that many workers (the cell's own static split, found by
search, is what the cell reports).

Per cell: the planner replays the workload (its first 120 s are the warm-start history), then the
static search finds the cheapest fixed split reaching attainment 0.99 (`static_*`; where none
does, e.g. prompts whose prefill alone exceeds the TTFT target, the cheapest reaching the planner's
own attainment, `static_target` saying which). The static configurations of both serving modes
are searched, the cheapest split and the fewest aggregated workers (no prefill pool, each worker
computing its own prompts); the cell is judged against the cheaper (`static_mode`; a tie: the
split). The cell passes if the planner's attainment is at least 0.99 where a static configuration
reaches it, and its GPU-hours are at most 0.85 x that configuration's.

`--planner-mode` is the planner's (docs/planner.md "Aggregated or disaggregated"): disaggregated
(the default) or auto, which may serve aggregated (its prefill pool may then go to 0).

    python bench/plan_suite.py [--workloads ...] [--gpus 2 5 10 20 40] [--seeds 0 1] \\
        [--planner-mode disaggregated|auto] [--processes 2] [--output FILE] [--table FILE]

One JSON line per cell on stdout (and --output) as cells finish; with --table a Markdown table of
every cell. Run it niced: each cell is one process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, replace
from multiprocessing import Pool
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from perf.profile import Profile, load_profile  # noqa: E402
from planner import Planner, PlannerConfig  # noqa: E402
from planner.sizing import DecodeWorkload, size_decode, size_prefill  # noqa: E402
from sim.plan.simulator import SimConfig, Simulation  # noqa: E402
from sim.plan.static import StaticSearch  # noqa: E402
from runtime.config_planner import ServingMode  # noqa: E402
from sim.workload import Workload, load_workload, scale_load, split_history, synthetic_workload  # noqa: E402
from splitserve.bench.plan import SIMULATED_POOLS, planner_modes  # noqa: E402
from splitserve.bench.serve import git_sha  # noqa: E402

TRACES = Path(os.environ.get("SPLITSERVE_TRACES", "/work/shared/data/traces"))
WORKLOADS = ("prefill_heavy", "decode_heavy", "conversation", "bursty", "diurnal", "flash", "mooncake")
GOAL = 0.99
RATIO_BAR = 0.85
WARM_START_S = 120.0
TTFT_S, ITL_S = 2.0, 0.05
MIN_SCALE = 0.01


@dataclass(frozen=True, slots=True)
class Cell:
    workload: str
    gpus: int
    seed: int
    trace_s: float
    synthetic_s: float
    mode: ServingMode = ServingMode.DISAGGREGATED


_TRACE_CACHE: dict[str, Workload] = {}


def build(workload: str, seed: int, scale: float, trace_s: float, synthetic_s: float) -> Workload:
    """The workload at `scale` (rate for the generated ones, copies for the traces), history included."""
    if workload in ("conversation", "mooncake"):
        name = "azure_llm_2023_conv.csv" if workload == "conversation" else "mooncake_synthetic_trace.jsonl"
        if name not in _TRACE_CACHE:
            _TRACE_CACHE[name] = load_workload(str(TRACES / name))
        w = _TRACE_CACHE[name]
        w = w.take(np.flatnonzero(w.arrival_s < trace_s + WARM_START_S))
        return scale_load(w, scale, seed)
    duration = max(synthetic_s, 3000.0) if workload == "flash" else synthetic_s
    return synthetic_workload(workload, seed, duration + WARM_START_S, scale)


def estimate_gpus(rate: float, prompt: np.ndarray, output: np.ndarray, profile: Profile) -> float:
    """The sizing model's workers at a mean rate for these lengths (both pools): where a cell lies."""
    service = np.array([profile.prefill_s(int(p)) for p in prompt])
    pre = size_prefill(rate, service, TTFT_S, 0.995, deadline=True).workers
    wl = DecodeWorkload.from_lengths(prompt, output, service, TTFT_S - service)
    dec = size_decode(rate, wl, profile.decode_step_s, ITL_S, 0.995, 1.0, profile.max_num_seqs,
                      profile.kv_capacity_tokens).workers
    return pre + dec


def scale_for(cell: Cell, profile: Profile) -> float:
    """The load scale whose estimate is `cell.gpus` workers (bisection in log scale on the unscaled
    workload's mean rate times the scale: both ways of scaling multiply the rate)."""
    w = build(cell.workload, 0, 1.0, cell.trace_s, cell.synthetic_s)
    counts = np.bincount((w.arrival_s // 20.0).astype(int))[:-1]
    rate = float(np.percentile(counts, 90)) / 20.0 if len(counts) else len(w) / 20.0
    sample = np.random.default_rng(0).choice(len(w), min(len(w), 2048), replace=False)
    prompt, output = w.prompt[sample].astype(float), w.output[sample].astype(float)
    lo, hi = MIN_SCALE, 1000.0
    while hi / lo > 1.02:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if estimate_gpus(rate * mid, prompt, output, profile) <= cell.gpus else (lo, mid)
    return round(lo, 3)


def run_cell(cell: Cell) -> dict:
    profile = load_profile(None)
    t0 = time.perf_counter()
    scale = scale_for(cell, profile)
    if scale <= MIN_SCALE:
        return {"bench": "plan_suite", "git_sha": git_sha(), "workload": cell.workload, "gpus_target": cell.gpus,
                "seed": cell.seed, "skipped": "the smallest pools cannot serve any load of this workload"}
    history, replay = split_history(build(cell.workload, cell.seed, scale, cell.trace_s, cell.synthetic_s),
                                    WARM_START_S)
    # the pools `bench plan` simulates: at least one worker each and no deployment's cap (the
    # default cap of 8 a pool would stop the 10-40 GPU cells short of what their static split runs)
    prefill = SIMULATED_POOLS.prefill
    if cell.mode is not ServingMode.DISAGGREGATED:      # aggregated serving is a prefill pool of 0
        prefill = replace(prefill, min_workers=0)
    planner_cfg = PlannerConfig(TTFT_S, ITL_S, startup_s=profile.startup_s, prefill=prefill,
                                decode=SIMULATED_POOLS.decode, mode=cell.mode)
    sim_cfg = SimConfig(TTFT_S, ITL_S, planner_cfg.interval_s, profile.startup_s, cell.seed, TTFT_S)
    r = Simulation(replay, profile, sim_cfg, planner=Planner(planner_cfg, profile), history=history).run()
    planner_s = time.perf_counter() - t0
    attainment = r.attainment(TTFT_S, ITL_S)
    hint = (max(d.prefill.desired for d in r.decisions), max(d.decode.desired for d in r.decisions))
    static_at = GOAL
    split, aggregated = StaticSearch(replay, profile, sim_cfg, GOAL).both_modes(hint)
    if split is None and aggregated is None:    # none reaches the goal: compare at the planner's attainment
        split, aggregated = StaticSearch(replay, profile, sim_cfg, attainment).both_modes(hint)
        static_at = attainment
    static = min((c for c in (split, aggregated) if c), key=lambda c: c.workers, default=None)
    static_h = static.workers * r.end_s / 3600 if static else None
    modes = planner_modes(r.decisions)
    gpu_h = r.gpu_s / 3600
    ratio = gpu_h / static_h if static_h else None
    timeline = r.timeline
    return {
        "bench": "plan_suite", "git_sha": git_sha(), "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "workload": cell.workload, "gpus_target": cell.gpus, "seed": cell.seed, "load_scale": scale,
        "scale_by": "copies" if cell.workload in ("conversation", "mooncake") else "rate",
        "requests": len(replay), "duration_s": round(r.end_s, 1),
        "sla_attainment": round(attainment, 5),
        "ttft_attainment": round(float(r.ttft_ok(TTFT_S).mean()), 5),
        "itl_attainment": round(float(r.itl_ok(ITL_S).mean()), 5),
        "gpu_hours": round(gpu_h, 4),
        "mean_prefill_workers": round(float(np.mean([p.prefill_active for p in timeline])), 3) if timeline else None,
        "mean_decode_workers": round(float(np.mean([p.decode_active for p in timeline])), 3) if timeline else None,
        "local_prefill_share": round(float(r.local_prefill.mean()), 4),
        "scaling_actions": r.scaling_actions,
        "planner_mode": cell.mode.value,
        "mode_share_aggregated": modes["mode_share"][ServingMode.AGGREGATED.value],
        "mode_switches": modes["mode_switches"],
        "static_target": round(static_at, 5),
        "static_mode": None if static is None else "aggregated" if static is aggregated else "disaggregated",
        "static_config": {"prefill": static.prefill, "decode": static.decode} if static else None,
        "static_disaggregated": _static_record(split), "static_aggregated": _static_record(aggregated),
        "static_sla_attainment": round(static.attainment, 5) if static else None,
        "static_gpu_hours": round(static_h, 4) if static_h else None,
        "gpu_hours_ratio": round(ratio, 4) if ratio else None,
        "attainment_ok": bool(static_at < GOAL or attainment >= GOAL),
        "ratio_ok": bool(ratio is not None and ratio <= RATIO_BAR),
        "planner_wall_s": round(planner_s, 1), "wall_s": round(time.perf_counter() - t0, 1),
    }


def _static_record(c) -> dict | None:
    return None if c is None else {"prefill": c.prefill, "decode": c.decode, "attainment": round(c.attainment, 5)}


def table(records: list[dict]) -> str:
    head = ("| workload | GPUs (target) | seed | requests | attainment (TTFT / ITL) | GPU-hours | mean P + D | "
            "static configuration at 0.99 (attainment) | static GPU-hours | ratio | meets |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    rows = []
    order = {w: i for i, w in enumerate(WORKLOADS)}
    for r in sorted(records, key=lambda r: (order.get(r["workload"], 99), r["gpus_target"], r["seed"])):
        if "skipped" in r:
            rows.append(f"| {r['workload']} | {r['gpus_target']} | {r['seed']} | | {r['skipped']} | | | | | | n/a |")
            continue
        st = r["static_config"]
        split = ("none found" if not st else
                 f"{st['decode']} aggregated ({r['static_sla_attainment']})" if r.get("static_mode") == "aggregated"
                 else f"{st['prefill']} + {st['decode']} ({r['static_sla_attainment']})")
        if r["static_target"] < GOAL:
            split = "none reaches 0.99; at the planner's: " + split
        meets = ("yes" if r["attainment_ok"] and r["ratio_ok"] else
                 "attainment" if not r["attainment_ok"] else "cost")
        rows.append(f"| {r['workload']} | {r['gpus_target']} | {r['seed']} | {r['requests']:,} | "
                    f"{r['sla_attainment']} ({r['ttft_attainment']} / {r['itl_attainment']}) | {r['gpu_hours']} | "
                    f"{r['mean_prefill_workers']} + {r['mean_decode_workers']} | {split} | "
                    f"{r['static_gpu_hours']} | {r['gpu_hours_ratio']} | {meets} |")
    return head + "\n".join(rows) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--gpus", nargs="+", type=int, default=[2, 5, 10, 20, 40])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--trace-s", type=float, default=1200.0, help="seconds of each public trace replayed")
    p.add_argument("--synthetic-s", type=float, default=1200.0,
                   help="seconds of each generated workload (the flash crowd: at least 3,000, its whole shape)")
    p.add_argument("--planner-mode", default=ServingMode.DISAGGREGATED.value,
                   choices=[ServingMode.DISAGGREGATED.value, ServingMode.AUTO.value])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--output", default=None)
    p.add_argument("--table", default=None)
    args = p.parse_args()
    if min(args.gpus) < 1 or args.processes < 1 or args.trace_s <= 0 or args.synthetic_s <= 0:
        print("plan_suite: --gpus, --processes, --trace-s and --synthetic-s must be positive", file=sys.stderr)
        return 2
    cells = [Cell(w, g, s, args.trace_s, args.synthetic_s, ServingMode(args.planner_mode)) for g in sorted(args.gpus)
             for w in args.workloads for s in args.seeds]
    records = []
    with Pool(args.processes) as pool:
        for rec in pool.imap_unordered(run_cell, cells):
            records.append(rec)
            line = json.dumps(rec)
            print(line, flush=True)
            if args.output:
                with open(args.output, "a") as f:
                    f.write(line + "\n")
    text = table(records)
    if args.table:
        Path(args.table).write_text(text)
    print(text, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

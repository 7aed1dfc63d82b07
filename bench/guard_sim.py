"""The ITL guard's rules in the planner's simulator: goodput of aggregated workers against a
prefill/decode split under the step rule and under the budget rule, on fixed-length Poisson
workloads (the goodput study's, docs/benchmarking.md), priced with a measured profile.

    python bench/guard_sim.py --profile perf/profiles/h200-llama-3.1-8b-fp8kv.json \\
        --gpus 2 --workloads 8192/256,3072/150 --out guard_sim.jsonl

For each workload and configuration (`aggN`: N aggregated workers; `xPyD step` and `xPyD budget`:
the split with the frontend's ITL guard under each rule, the budget rule with the TTFT gate), the
script finds the goodput the way `bench goodput` does on a cluster: the highest Poisson rate at
which --attainment-goal of the requests meet both targets (TTFT, and each request's mean ITL), by
its search (splitserve/bench/rate_search.py): doubling from --start-rate while probes pass, halving
while they fail, then bisecting until the bracket is within --tolerance of its lower end. Each probe is one simulator run of
--seconds of arrivals (seeded, the same trace for every configuration at a rate). A JSON line per
probe and per result. What it measures is the simulator's model of the live request path
(sim/plan/simulator.py), not GPUs: its figures rank rules and say where a GPU run should look.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.poisson_trace import arrival_times  # noqa: E402
from perf.profile import load_profile  # noqa: E402
from sim.plan.simulator import SimConfig, Simulation  # noqa: E402
from sim.workload import Workload  # noqa: E402
from splitserve.bench.rate_search import RateSearch, SearchLimits  # noqa: E402
from splitserve.bench.records import git_sha  # noqa: E402

MIN_RATE = 0.01         # req/s: halving stops here, as bench goodput's --min-rate
MAX_PROBES = 64         # far more than a search from 1 to --max-rate takes; bench goodput's cap is a budget


@dataclass(frozen=True)
class Config:
    name: str
    prefill: int
    decode: int
    rule: str | None        # the guard's rule (None: aggregated, no prefill pool to guard)

    def sim_config(self, ttft_s: float, itl_s: float) -> SimConfig:
        if self.rule is None:
            return SimConfig(ttft_s, itl_s)
        return SimConfig(ttft_s, itl_s, itl_guard=True, itl_guard_mode=self.rule)


def configs(gpus: int, splits: list[tuple[int, int]]) -> list[Config]:
    out = [Config(f"agg{gpus}", 0, gpus, None)]
    for p, d in splits:
        out += [Config(f"{p}P{d}D {rule}", p, d, rule) for rule in ("step", "budget")]
    return out


def poisson(isl: int, osl: int, rate: float, seconds: float, seed: int) -> Workload:
    """The workload `bench/poisson_trace.py` would write for these arguments, in memory."""
    t = arrival_times(rate, seconds, seed)
    n = len(t)
    return Workload(f"{isl}/{osl}@{rate:g}", t, np.full(n, isl, dtype=np.int64), np.full(n, osl, dtype=np.int64), None)


def attainment(cfg: Config, w: Workload, profile, ttft_s: float, itl_s: float) -> dict:
    r = Simulation(w, profile, cfg.sim_config(ttft_s, itl_s), prefill_workers=cfg.prefill,
                   decode_workers=cfg.decode, stages=("prefill", "decode")).run()
    t, i = r.ttft_ok(ttft_s), r.itl_ok(itl_s)
    return {"attainment": round(float((t & i).mean()), 4), "ttft_attainment": round(float(t.mean()), 4),
            "itl_attainment": round(float(i.mean()), 4), "requests": len(w)}


def goodput(cfg: Config, isl: int, osl: int, a, profile, emit) -> dict:
    """Doubling then bisection on the rate: `bench goodput`'s own search (splitserve/bench/rate_search.py),
    each probe a simulation instead of a live cluster."""
    search = RateSearch(SearchLimits(a.start_rate, min(a.start_rate, MIN_RATE), a.max_rate, a.tolerance, MAX_PROBES))
    while (rate := search.next_rate()) is not None:
        res = attainment(cfg, poisson(isl, osl, rate, a.seconds, a.seed), profile, a.ttft_ms / 1e3, a.itl_ms / 1e3)
        passed = res["attainment"] >= a.attainment_goal
        emit({"bench": "guard_sim_probe", "config": cfg.name, "workload": f"{isl}/{osl}", "rate_req_s": round(rate, 4),
              **res, "passed": passed})
        search.record(rate, passed)
    return {"goodput_req_s": round(search.goodput, 4),
            "bracket_req_s": [round(search.goodput, 4), None if search.failed is None else round(search.failed, 4)]}


def parse_workloads(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        isl, _, osl = item.partition("/")
        if not (isl.isdigit() and osl.isdigit() and int(isl) > 0 and int(osl) > 0):
            raise ValueError(f"a workload is ISL/OSL in tokens, got {item!r}")
        out.append((int(isl), int(osl)))
    return out


def parse_splits(text: str, gpus: int) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        p, _, d = item.upper().rstrip("D").partition("P")
        if not (p.isdigit() and d.isdigit() and int(p) > 0 and int(d) > 0 and int(p) + int(d) == gpus):
            raise ValueError(f"a split is xPyD with x + y = --gpus ({gpus}), got {item!r}")
        out.append((int(p), int(d)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="the workers' performance profile (default: the shipped H100 one)")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--splits", default=None, help="xPyD splits of --gpus, comma-separated (default: 1P(N-1)D)")
    ap.add_argument("--workloads", default="8192/256,3072/150,1024/1024", help="ISL/OSL, comma-separated")
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--itl-ms", type=float, default=15.0, help="each request's mean ITL target")
    ap.add_argument("--attainment-goal", type=float, default=0.9)
    ap.add_argument("--seconds", type=float, default=300.0, help="each probe's arrivals")
    ap.add_argument("--start-rate", type=float, default=1.0)
    ap.add_argument("--max-rate", type=float, default=1000.0)
    ap.add_argument("--tolerance", type=float, default=0.05, help="bisect until the bracket is narrower than this share of its lower end")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON lines (default: stdout only)")
    a = ap.parse_args(argv)
    try:
        if a.gpus < 2:
            raise ValueError("--gpus must be at least 2 (a split needs a prefill and a decode worker)")
        workloads = parse_workloads(a.workloads)
        splits = parse_splits(a.splits or f"1P{a.gpus - 1}D", a.gpus)
        if not (a.ttft_ms > 0 and a.itl_ms > 0 and 0 < a.attainment_goal <= 1 and a.seconds > 0
                and 0 < a.start_rate < a.max_rate and 0 < a.tolerance < 1):
            raise ValueError("targets, goal, seconds, rates and tolerance must be positive (goal, tolerance <= 1)")
        profile = load_profile(a.profile)
    except ValueError as e:
        print(f"guard_sim: {e}", file=sys.stderr)
        return 2
    out = open(a.out, "a") if a.out else None

    def emit(rec: dict) -> None:
        line = json.dumps(rec)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    head = {"git_sha": git_sha(), "profile": profile.name, "gpus": a.gpus, "ttft_ms": a.ttft_ms, "itl_ms": a.itl_ms,
            "attainment_goal": a.attainment_goal, "seconds": a.seconds, "seed": a.seed}
    for isl, osl in workloads:
        results = {}
        for cfg in configs(a.gpus, splits):
            t0 = time.monotonic()
            res = goodput(cfg, isl, osl, a, profile, emit)
            results[cfg.name] = res["goodput_req_s"]
            emit({"bench": "guard_sim", **head, "config": cfg.name, "workload": f"{isl}/{osl}", **res,
                  "wall_s": round(time.monotonic() - t0, 1)})
        agg = results[f"agg{a.gpus}"]
        emit({"bench": "guard_sim_summary", **head, "workload": f"{isl}/{osl}", "goodput_req_s": results,
              "vs_aggregated": {k: (round(v / agg, 3) if agg else None) for k, v in results.items()}})
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does the planner's simulator predict the live system? The same trace slice on a live cluster of
mock workers (`serve --mock`: the real frontend, router, engines, prefill -> NIXL -> decode handoff,
on a timing model) and in the simulator `bench plan` runs, with the same profile and pools: their
SLA attainments must agree within `--tolerance`.

Steps, per workload:

1. A profile slow enough that this CPU machine's host work (HTTP, gRPC, Python step loops) is small
   beside the modelled device time, written to a temporary file that both sides read (the mock
   sleeps by it, the simulator computes with it).
2. A live cluster: an embedded Redis and `splitserve serve --mock --mock-profile F
   --prefill-workers P --decode-workers D --num-blocks (the profile's KV)`, prefill queues in
   arrival order (no planner: fixed pools, so that the comparison is of the request path alone).
3. The handoff: a few requests one at a time on the idle cluster; the median of (TTFT - the
   profile's prefill time) is what a remote first token costs beyond its prefill here (KV push over
   NIXL, the Prefill call's answer, the first output). The simulator is given it (`handoff_s`).
4. The slice, replayed open-loop at its arrival times over HTTP with token-id prompts (max_tokens =
   the output length, ignore_eos): each request's TTFT and mean ITL ((last token - first token) /
   (tokens - 1)) against the targets.
5. The simulator on the same requests, pools and profile; both attainments, their difference,
   TTFT / ITL percentiles and the share of prompts computed on a decode worker (live: the
   frontend's and the decode workers' counters).

    python bench/plan_live_check.py [--workloads prefill_heavy conversation] [--seconds 120] \\
        [--tolerance 0.03] [--output FILE]

One JSON line per workload on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from perf.profile import load_profile  # noqa: E402
from sim.plan.simulator import SimConfig, Simulation  # noqa: E402
from sim.workload import Workload, load_workload, synthetic_workload  # noqa: E402
from splitserve.bench.clients import RequestSpec  # noqa: E402
from splitserve.bench.goodput import request_latencies  # noqa: E402
from splitserve.bench.serve import event_loop_factory, git_sha, run_level_in_process  # noqa: E402

TRACES = Path(os.environ.get("SPLITSERVE_TRACES", "/work/shared/data/traces"))
BLOCK = 16
# A device 5x slower per token than the H100 curve, with a 10 ms step floor: a 1,500-token prompt
# takes ~0.3 s, a decode step of 16 sequences at 1,500 tokens ~15 ms.
PROFILE = {"curve": {"base_s": 0.01, "per_token_s": 2e-4, "per_attn_pair_s": 0.0, "per_kv_token_s": 1e-7},
           "kv_capacity_tokens": 200_000, "max_num_seqs": 64, "max_num_batched_tokens": 2048}
# per workload: the slice (a rate scale, or a share of the trace's requests kept), the pools
# (prefill, decode), the targets (TTFT s, ITL s), the longest output replayed
WORKLOADS = {
    "prefill_heavy": dict(rate_scale=0.9, pools=(2, 1), targets=(2.0, 0.05), max_output=64),
    "conversation": dict(share=0.55, start_s=600.0, pools=(1, 1), targets=(2.0, 0.05), max_output=256),
}


def slice_of(name: str, seconds: float, seed: int) -> Workload:
    spec = WORKLOADS[name]
    if name == "conversation":
        w = load_workload(str(TRACES / "azure_llm_2023_conv.csv"))
        inside = (w.arrival_s >= spec["start_s"]) & (w.arrival_s < spec["start_s"] + seconds)
        w = w.take(np.flatnonzero(inside & (np.random.default_rng([seed, 7]).random(len(w)) < spec["share"])))
        w.arrival_s = w.arrival_s - spec["start_s"]
    else:
        w = synthetic_workload(name, seed, seconds, spec["rate_scale"])
    w.prompt = np.clip(w.prompt, 16, 8000)
    w.output = np.clip(w.output, 1, spec["max_output"])
    return w


def specs_of(w: Workload, vocab: int, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng([seed, 38])
    prompts = [rng.integers(1, vocab, int(n)) for n in w.prompt]
    return [RequestSpec(int(n), int(o), (lambda p=p: p), float(t))
            for n, o, t, p in zip(w.prompt, w.output, w.arrival_s, prompts)]


def attainment(ttft: np.ndarray, itl: np.ndarray, targets: tuple[float, float]) -> dict:
    ok_t = ttft <= targets[0]
    ok_i = np.isnan(itl) | (itl <= targets[1])
    fin = itl[np.isfinite(itl)]
    return {"sla_attainment": round(float((ok_t & ok_i).mean()), 4), "ttft_attainment": round(float(ok_t.mean()), 4),
            "itl_attainment": round(float(ok_i.mean()), 4),
            "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3), "ttft_p90_s": round(float(np.percentile(ttft, 90)), 3),
            "itl_p50_s": round(float(np.percentile(fin, 50)), 4) if len(fin) else None,
            "itl_p90_s": round(float(np.percentile(fin, 90)), 4) if len(fin) else None}


def counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def live(name: str, w: Workload, profile_path: str, args) -> tuple[dict, float]:
    """Run the slice on a live mock cluster; (its latencies' summary, the measured handoff)."""
    import httpx

    from runtime.redis_embedded import EmbeddedRedis, free_port
    from splitserve.serve import Cluster, wait_ready

    spec, profile = WORKLOADS[name], load_profile(profile_path)
    p, d = spec["pools"]
    http, grpc_port = free_port(), free_port()
    with EmbeddedRedis() as redis:
        cluster = Cluster()
        argv = ["serve", "--mock", "--mock-profile", profile_path, "--prefill-workers", str(p),
                "--decode-workers", str(d), "--num-blocks", str(profile.kv_capacity_tokens // BLOCK),
                "--block-size", str(BLOCK), "--max-num-seqs", str(profile.max_num_seqs),
                "--max-model-len", "16384", "--model-name", "check", "--redis-url", redis.url, "--namespace", f"check-{name}",
                "--http-port", str(http), "--grpc-port", str(grpc_port), "--admin-port", "0"]
        cluster.spawn("serve", argv, dict(os.environ, PYTHONUNBUFFERED="1"), stdout=sys.stderr)
        url = f"http://127.0.0.1:{http}"
        try:
            if not wait_ready(cluster, f"{url}/health", d, p, 180.0, {"sig": None}):
                raise RuntimeError(f"the {name} cluster did not start")
            client = SimpleNamespace(url=url, timeout_s=600.0, api_key=None, no_progress=True, extra_body=None)
            calib = specs_of(slice_of(name, 60.0, args.seed + 1).take(np.arange(8)), 4096, args.seed + 1)
            with asyncio.Runner(loop_factory=event_loop_factory("http://")) as runner:
                gaps = []
                for s in calib:     # one at a time on the idle cluster
                    r = runner.run(run_level_in_process(client, "check", [s], 1, "handoff")).results[0]
                    if r.error is None and s.prompt_len >= 128:
                        gaps.append(r.ttft_s - profile.prefill_s(s.prompt_len))
                before = httpx.get(f"{url}/metrics", timeout=5.0).text
                t0 = time.perf_counter()
                run = runner.run(run_level_in_process(client, "check", specs_of(w, 4096, args.seed), None, name))
                wall = time.perf_counter() - t0
                after = httpx.get(f"{url}/metrics", timeout=5.0).text
        finally:
            cluster.stop(timeout_s=30.0)
    ttft, itl = request_latencies(run.results)
    errors = int(np.isinf(ttft).sum())
    local = counter(after, "splitserve_prefill_local_total") - counter(before, "splitserve_prefill_local_total")
    fallback = counter(after, "splitserve_prefill_fallback_total") - counter(before, "splitserve_prefill_fallback_total")
    handoff = float(np.median(gaps)) if gaps else 0.0
    return ({**attainment(ttft, itl, spec["targets"]), "errors": errors, "wall_s": round(wall, 1),
             "local_prefill_share": round((local + fallback) / len(w), 4),
             "host_load_avg_1m": round(os.getloadavg()[0], 2)}, handoff)


def simulated(name: str, w: Workload, profile_path: str, handoff_s: float, seed: int, slower: float = 1.0) -> dict:
    """The simulator on the slice; `slower` stretches every step of the profile by that factor
    (what the attainment would be if this host's own work lengthened each step a little)."""
    spec, profile = WORKLOADS[name], load_profile(profile_path)
    if slower != 1.0:
        curve = profile.timing
        profile = dataclasses.replace(profile, timing=dataclasses.replace(
            curve, base_s=curve.base_s * slower, per_token_s=curve.per_token_s * slower,
            per_kv_token_s=curve.per_kv_token_s * slower))
    cfg = SimConfig(*spec["targets"], seed=seed, handoff_s=handoff_s)
    r = Simulation(w, profile, cfg, prefill_workers=spec["pools"][0], decode_workers=spec["pools"][1]).run()
    return {**attainment(r.ttft_s, r.itl_s, spec["targets"]), "local_prefill_share": round(float(r.local_prefill.mean()), 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--seconds", type=float, default=120.0, help="length of each slice")
    p.add_argument("--tolerance", type=float, default=0.03, help="largest |live - simulated| attainment that passes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    if args.seconds <= 0 or args.tolerance <= 0:
        print("plan_live_check: --seconds and --tolerance must be > 0", file=sys.stderr)
        return 2
    failed = False
    with tempfile.TemporaryDirectory(prefix="live-check-") as tmp:
        profile_path = str(Path(tmp) / "profile.json")
        Path(profile_path).write_text(json.dumps(PROFILE))
        for name in args.workloads:
            w = slice_of(name, args.seconds, args.seed)
            measured, handoff = live(name, w, profile_path, args)
            sim = simulated(name, w, profile_path, handoff, args.seed)
            sim["sla_attainment_steps_2pct_longer"] = simulated(name, w, profile_path, handoff, args.seed,
                                                                1.02)["sla_attainment"]
            diff = measured["sla_attainment"] - sim["sla_attainment"]
            ok = abs(diff) <= args.tolerance
            failed |= not ok
            rec = {"bench": "plan_live_check", "git_sha": git_sha(),
                   "machine": f"{platform.node()} ({os.cpu_count()} CPUs)", "workload": name,
                   "requests": len(w), "seconds": args.seconds, "seed": args.seed,
                   "pools": dict(zip(("prefill", "decode"), WORKLOADS[name]["pools"])),
                   "targets_s": WORKLOADS[name]["targets"], "profile": PROFILE,
                   "handoff_s": round(handoff, 4), "live": measured, "simulated": sim,
                   "attainment_diff": round(diff, 4), "tolerance": args.tolerance, "within_tolerance": ok}
            line = json.dumps(rec)
            print(line, flush=True)
            if args.output:
                with open(args.output, "a") as f:
                    f.write(line + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

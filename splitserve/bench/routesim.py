"""`splitserve bench routesim`: the routing simulator (sim/route/simulator.py) on the same workloads and
fleet flags as `bench replay`, one JSON record per routing policy, then a summary across them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import resource
import time
from typing import Sequence

from kvstore.hashing import block_hashes
from perf.profile import DEFAULT_KV_TOKENS, load_timing
from router import RouterConfig, RoutingPolicy
from splitserve.bench.clients import RequestSpec


def requests_from_specs(specs: Sequence[RequestSpec], block_size: int) -> list:
    """The bench's request specs as simulated requests (sim.route.worker.SimRequest): prompts built
    and hashed as the frontend hashes them, so the simulator sees exactly the prefix sharing a replay
    sends. The prompts themselves are built again at arrival (Simulation's prompt_of)."""
    from sim.route.worker import SimRequest

    out = []
    for i, s in enumerate(specs):
        prompt = s.make_prompt()
        out.append(SimRequest(i, s.arrival_s, s.prompt_len, s.max_tokens,
                              block_hashes(prompt, block_size), s.cache_key))
    return out


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> str:
    return f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})"


# ---------------------------------------------------------------------------------------------
# The command

# name -> (router config fields, description); "kv" is the router's default configuration
VARIANTS: dict[str, tuple[dict, str]] = {
    "kv": ({}, "predicted TTFT (queue wait + uncached prefill), busy-period weight, session hints, "
               "the delay a prefill imposes on the worker's running decodes"),
    "kv_no_decode_delay": ({"decode_delay": False}, "kv without the decodes' delay"),
    "kv_no_hints": ({"use_hints": False, "decode_delay": False}, "kv_no_decode_delay without hints"),
    "kv_flat": ({"use_hints": False, "busy_period_weight": False, "decode_delay": False},
                "predicted TTFT alone: prefill seconds weigh as much as waiting seconds"),
    "kv_blocks": ({"policy": RoutingPolicy.KV_BLOCKS},
                  "Dynamo's formula: blocks to prefill + load blocks (the kv policy before issue 20)"),
    "approx": ({"policy": RoutingPolicy.KV_BLOCKS, "approximate": True},
               "SGLang-style approximate tree: no KV events, the router's own decisions, Dynamo's formula"),
    "least_loaded": ({"policy": RoutingPolicy.LEAST_LOADED}, "load only"),
    "round_robin": ({"policy": RoutingPolicy.ROUND_ROBIN}, "round robin"),
    "random": ({"policy": RoutingPolicy.RANDOM}, "uniform random"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from splitserve.bench import replay

    replay.add_arguments(p)      # the same workloads and fleet flags as `bench replay`
    p.set_defaults(policy="kv,kv_blocks,least_loaded,round_robin")
    p.add_argument("--event-delay-s", type=float, default=0.0, help="KV events reach the router this late")
    p.add_argument("--report-interval-s", type=float, default=0.05,
                   help="workers' load reports reach the routers this often (their push while they run: "
                        "0.05; the frontend's poll: 0.5)")
    p.add_argument("--own-load-only", action="store_true",
                   help="reports without the workers' decoding counts (the routers count only their own decodes)")
    p.add_argument("--no-attribute", action="store_true",
                   help="skip the miss attribution (faster; for scale runs)")
    p.add_argument("--list-variants", action="store_true", help="print the policy variants and exit")


def main(args: argparse.Namespace) -> int:
    import sys

    from sim.route.simulator import SimConfig, Simulation, offered_prefill_util
    from splitserve.bench import replay
    from splitserve.bench.serve import emit, git_sha
    from splitserve.bench.workloads import BenchInputError

    if args.list_variants:
        for name, (_, what) in VARIANTS.items():
            print(f"{name:14s} {what}")
        return 0
    try:
        policies = [p.strip() for p in args.policy.split(",") if p.strip()]
        if not policies or any(p not in VARIANTS for p in policies):
            raise BenchInputError(f"--policy wants a comma list of {', '.join(VARIANTS)}")
        if args.event_delay_s < 0 or args.report_interval_s <= 0:
            raise BenchInputError("--event-delay-s must be >= 0 and --report-interval-s > 0")
        frontends = replay.frontend_counts(args.frontends)
        specs, workload = replay.make_specs(args)
    except BenchInputError as e:
        print(f"bench routesim: {e}", file=sys.stderr)
        return 2
    timing = load_timing(args.mock_profile)
    cfg = SimConfig(workers=args.workers, block_size=args.block_size,
                    num_blocks=args.num_blocks or DEFAULT_KV_TOKENS // args.block_size,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                    event_delay_s=args.event_delay_s, attribute=not args.no_attribute,
                    report_interval_s=args.report_interval_s, report_running=not args.own_load_only)
    t0 = time.perf_counter()
    requests = requests_from_specs(specs, cfg.block_size)
    header = {"bench": "routesim", "git_sha": git_sha(), "machine": machine(), "label": args.label,
              "workers": cfg.workers, "block_size": cfg.block_size, "num_blocks": cfg.num_blocks,
              "seed": args.seed, "mock_profile": args.mock_profile or "h100-8b-curve",
              "max_num_batched_tokens": cfg.max_num_batched_tokens, "event_delay_s": cfg.event_delay_s,
              "report_interval_s": cfg.report_interval_s, "report_running": cfg.report_running,
              "lower_tier_weight": args.lower_tier_weight,
              **workload, "offered_prefill_util": round(offered_prefill_util(
                  requests, timing, cfg.max_num_batched_tokens, cfg.workers), 3),
              "workload_build_s": round(time.perf_counter() - t0, 2)}
    records = []
    for name, n in [(p, n) for p in policies for n in frontends]:
        fields, _ = VARIANTS[name]
        router_cfg = RouterConfig(**fields, timing=timing, chunk_tokens=cfg.max_num_batched_tokens,
                                  lower_tier_weight=args.lower_tier_weight)
        sim = Simulation(dataclasses.replace(cfg, frontends=n), router_cfg, requests, timing, seed=args.seed,
                         prompt_of=lambda r: specs[r.index].make_prompt())
        records.append(header | {"policy": name, "frontends": n, **sim.run(), "max_rss_mib": round(max_rss_mib())})
        emit(records[-1], args.output)
    if len(records) > 1:
        rr = next((r for r in records if r["policy"] == "round_robin"), None)
        summary = header | {"bench": "routesim_summary", "policy": policies}
        for k in ("prefix_hit_rate", "oracle_share", "ttft_p50_s", "ttft_p90_s", "max_over_mean_load"):
            summary[k] = {r["policy"]: r[k] for r in records}
        if rr and rr["ttft_p50_s"]:
            summary["ttft_p50_vs_round_robin"] = {r["policy"]: round(r["ttft_p50_s"] / rr["ttft_p50_s"], 3)
                                                  for r in records if r["ttft_p50_s"] is not None}
        emit(summary, args.output)
    return 0

"""`splitserve bench replay`: replay a request trace against a local cluster of mock workers.

For each routing policy it starts a fresh cluster on this machine — an embedded Redis, then
`splitserve serve --mock` (N mock-engine workers and the real frontend, with `--router-policy`)
through serve.py's `Cluster` and readiness wait — replays the workload open-loop over HTTP
`/v1/completions` with token-id prompts (max_tokens = the trace's output length, ignore_eos), reads
every worker's status, stops the cluster, and prints one JSON line. With several policies a
summary line comes last; `--plot` draws the TTFT CDF of each.

Workloads: a Mooncake-format trace (prompts rebuilt from hash_ids by serve.trace_prompt,
arrivals divided by --speedup), `--workload shared-prefix` (every request = one long system
prompt + a unique tail, Poisson arrivals) for the load-balance check, or `--workload sessions`
(multi-turn conversations whose context grows turn by turn, on the Azure conversation trace's
arrivals and lengths given by --azure-trace; sessions.py). `--offered-util U` sets the speedup that
makes the workload's offered prefill utilisation U (below).

Beside each policy's hit rate it prints the pooled-cache oracle (oracle.py: one LRU with the whole
fleet's capacity, fed the same prompts in order) and the policy's share of it.

Definitions (besides serve.py's TTFT / ITL / throughput):

- prefix_hit_rate: Σ cached prompt tokens / Σ prompt tokens over successful requests, the cached
  count being the server's usage.prompt_tokens_details.cached_tokens (prefix-cache hit on the
  worker that ran the request, at its first admission).
- worker load: the prompt tokens a worker admitted (cached or not) over the run, read from its
  GetStatus; max_over_mean_load = the largest over the mean across workers (1.0 = perfectly even).
  `worker_computed_tokens` (admitted minus prefix hits: the prefill work it did) is reported too.
- oracle_hit_rate: the pooled-cache oracle's hit rate for the same prompts, block size and
  capacity (workers x --num-blocks); oracle_share = prefix_hit_rate / oracle_hit_rate.
- offered_prefill_util: the workload's prefill time with no cache hits under the mock's timing
  model (chunked by --max-num-batched-tokens), divided by the replay span and the worker count —
  how loaded the cluster would be if no prefix were reused. It states the regime of a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import os
import platform
import sys
import tempfile
import uuid
from types import SimpleNamespace

import numpy as np

from runtime.config import LOWER_TIER_WEIGHT, RoutingPolicy
from sim.oracle import PooledCacheOracle
from splitserve.bench.sessions import SessionsConfig, load_azure, session_specs
from splitserve.bench.clients import RequestSpec
from splitserve.bench.serve import emit, event_loop_factory, git_sha, run_level_in_process
from splitserve.bench.stats import summarize_level
from splitserve.bench.workloads import BenchInputError, load_trace, random_prompt, trace_specs

MODEL_NAME = "mock"
POLICIES = tuple(p.value for p in RoutingPolicy)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, help="Mooncake JSONL trace (timestamp, lengths, hash_ids)")
    p.add_argument("--workload", default=None, choices=["shared-prefix", "sessions"],
                   help="a synthetic workload instead of --trace")
    p.add_argument("--azure-trace", default=None,
                   help="sessions: the Azure conversation trace CSV (arrivals and lengths)")
    p.add_argument("--new-session-prob", type=float, default=SessionsConfig().new_session_prob,
                   help="sessions: probability that a request starts a new conversation")
    p.add_argument("--offered-util", type=float, default=None,
                   help="set --speedup so that the offered prefill utilisation is this")
    p.add_argument("--workers", type=int, default=8, help="mock workers")
    p.add_argument("--frontends", default="1", help="frontend processes behind the one address (serve "
                   "--frontends), or a comma list to compare (e.g. 1,4): each routes on its own, with the "
                   "fleet's load and the same KV events")
    p.add_argument("--policy", default="kv", help=f"router policy, or a comma list of {', '.join(POLICIES)}")
    p.add_argument("--limit", type=int, default=None, help="replay only the first K requests")
    p.add_argument("--skip", type=int, default=0,
                   help="trace: drop the first N requests (before --limit; arrivals restart at 0)")
    p.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this")
    p.add_argument("--trace-scale", type=float, default=1.0,
                   help="multiply trace lengths and the trace's 512-token block by this")
    p.add_argument("--block-size", type=int, default=16, help="KV block size of workers and router")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write the TTFT CDF per policy to this PNG")
    p.add_argument("--output", default=None, help="append the JSON lines to this file")
    p.add_argument("--label", default="", help="a note stored in the JSON")
    # the mock workers
    p.add_argument("--model", default="tiny", help="model dir for config/tokenizer (default tiny)")
    p.add_argument("--mock-profile", default=None, help="JSON timing profile (default: H100 8B curve)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker (default: H100 8B)")
    p.add_argument("--max-model-len", type=int, default=131072)
    p.add_argument("--kv-host-gib", type=float, default=0.0,
                   help="each mock worker's modelled host KV tier (docs/kv_tiers.md); 0: none")
    p.add_argument("--kv-disk-gib", type=float, default=0.0,
                   help="each mock worker's disk KV tier, modelled blocks in real files (needs --kv-host-gib "
                        "and --kv-disk-dir); 0: none")
    p.add_argument("--kv-disk-dir", default=None,
                   help="an existing directory; each policy's cluster gets a fresh subdirectory of it, "
                        "removed after (its workers one each below that)")
    p.add_argument("--lower-tier-weight", type=float, default=LOWER_TIER_WEIGHT,
                   help="the router's weight of a block held only in a lower tier (0: tier-unaware; the "
                        "frontend's --router-lower-tier-weight, and routesim's router)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=4000, help="prompt ids are drawn below this")
    # shared-prefix workload
    p.add_argument("--num-requests", type=int, default=400, help="shared-prefix: requests (or --limit)")
    p.add_argument("--rate", type=float, default=16.0, help="shared-prefix: Poisson arrivals per second")
    p.add_argument("--prefix-len", type=int, default=4096, help="shared-prefix: system prompt tokens")
    p.add_argument("--tail-len", type=int, default=512, help="shared-prefix: unique tokens per request")
    p.add_argument("--osl", type=int, default=128, help="shared-prefix: output tokens per request")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request limit")
    p.add_argument("--startup-timeout-s", type=float, default=120.0)
    p.add_argument("--no-progress", action="store_true")


# ---------------------------------------------------------------------------------------------
# Workloads


def shared_prefix_specs(args: argparse.Namespace) -> list[RequestSpec]:
    """Every prompt = one system prompt + a unique tail; exponential gaps at --rate per second."""
    rng = np.random.default_rng([args.seed, 7])
    n = args.limit or args.num_requests
    arrivals = np.cumsum(rng.exponential(1.0 / args.rate, n))
    arrivals -= arrivals[0]
    system = random_prompt((args.seed, 1), args.prefix_len, args.vocab_size)

    def prompt(i: int) -> np.ndarray:
        return np.concatenate([system, random_prompt((args.seed, 2, i), args.tail_len, args.vocab_size)])

    length = args.prefix_len + args.tail_len
    return [RequestSpec(length, args.osl, functools.partial(prompt, i), float(t)) for i, t in enumerate(arrivals)]


def make_specs(args: argparse.Namespace) -> tuple[list[RequestSpec], dict]:
    """The workload's requests; with --offered-util, arrivals are compressed to reach it."""
    specs, workload = _make_specs(args)
    if args.offered_util is not None:
        if args.offered_util <= 0:
            raise BenchInputError("--offered-util must be positive")
        util = offered_prefill_util(specs, args, digits=None)
        if not util:
            raise BenchInputError("--offered-util needs requests spread over time")
        factor = util / args.offered_util        # arrival times are multiplied by this
        specs = [dataclasses.replace(s, arrival_s=s.arrival_s * factor) for s in specs]
        workload["speedup"] = round(workload.get("speedup", 1.0) / factor, 4)
    return specs, workload


def _make_specs(args: argparse.Namespace) -> tuple[list[RequestSpec], dict]:
    if (args.trace is None) == (args.workload is None):
        raise BenchInputError("give exactly one of --trace or --workload")
    if args.workers < 1 or args.speedup <= 0 or args.block_size < 1:
        raise BenchInputError("--workers, --speedup and --block-size must be positive")
    if args.workload == "sessions":
        if args.azure_trace is None:
            raise BenchInputError("--workload sessions needs --azure-trace")
        if not 0 < args.new_session_prob <= 1:
            raise BenchInputError("--new-session-prob must be in (0, 1]")
        rows = load_azure(args.azure_trace, args.limit)
        cfg = SessionsConfig(new_session_prob=args.new_session_prob)
        specs, facts = session_specs(rows, args.vocab_size, args.seed, args.speedup, cfg)
        return specs, {"workload": "sessions", "trace": os.path.basename(args.azure_trace),
                       "limit": args.limit, "speedup": args.speedup,
                       "new_session_prob": args.new_session_prob, **facts}
    if args.workload == "shared-prefix":
        if min(args.num_requests, args.prefix_len, args.tail_len, args.osl) < 1 or args.rate <= 0:
            raise BenchInputError("shared-prefix sizes and --rate must be positive")
        specs = shared_prefix_specs(args)
        return specs, {"workload": "shared-prefix", "rate": args.rate, "prefix_len": args.prefix_len,
                       "tail_len": args.tail_len, "osl": args.osl}
    if args.skip < 0:
        raise BenchInputError("--skip must be >= 0")
    rows, block = load_trace(args.trace, args.trace_scale,
                             limit=None if args.limit is None else args.skip + args.limit)
    rows = rows[args.skip:]
    if not rows:
        raise BenchInputError(f"--skip {args.skip} leaves no requests")
    specs = trace_specs(rows, block, args.vocab_size, (args.seed,), args.speedup)
    return specs, {"workload": "trace", "trace": os.path.basename(args.trace), "trace_scale": args.trace_scale,
                   "trace_block_tokens": block, "skip": args.skip, "limit": args.limit,
                   "speedup": args.speedup}


def offered_prefill_util(specs: list[RequestSpec], args: argparse.Namespace,
                         digits: int | None = 3) -> float | None:
    """No-cache prefill seconds under the mock's timing model / (replay span * workers)."""
    from perf.profile import load_timing

    timing = load_timing(args.mock_profile)
    budget = args.max_num_batched_tokens
    busy = 0.0
    for s in specs:
        busy += sum(timing.step_s([(start, min(budget, s.prompt_len - start))])
                    for start in range(0, s.prompt_len, budget))
    span = specs[-1].arrival_s - specs[0].arrival_s
    if span <= 0:
        return None
    util = busy / (span * args.workers)
    return util if digits is None else round(util, digits)


def oracle_fields(specs: list[RequestSpec], args: argparse.Namespace) -> dict:
    """The pooled-cache oracle of this workload on this fleet (every request, in arrival order)."""
    from kvstore.hashing import block_hashes
    from perf.profile import DEFAULT_KV_TOKENS

    per_worker = args.num_blocks or DEFAULT_KV_TOKENS // args.block_size
    oracle = PooledCacheOracle.for_fleet(args.block_size, args.workers, per_worker)
    for s in sorted(specs, key=lambda s: s.arrival_s):
        if s.prompt_len + s.max_tokens <= args.max_model_len:      # the server refuses longer ones
            oracle.observe(block_hashes(s.make_prompt(), args.block_size), s.prompt_len)
    return oracle.summary()


def share_of_oracle(hit_rate: float | None, oracle_hit_rate: float) -> float | None:
    return round(hit_rate / oracle_hit_rate, 3) if hit_rate is not None and oracle_hit_rate else None


# ---------------------------------------------------------------------------------------------
# One policy: a fresh cluster, the replay, the workers' statuses


def check_tier_args(args: argparse.Namespace) -> None:
    if args.kv_host_gib < 0 or args.kv_disk_gib < 0:
        raise BenchInputError("--kv-host-gib and --kv-disk-gib must not be negative")
    if bool(args.kv_disk_gib) != bool(args.kv_disk_dir):
        raise BenchInputError("--kv-disk-gib and --kv-disk-dir need each other")
    if args.kv_disk_gib and not args.kv_host_gib:
        raise BenchInputError("--kv-disk-gib needs --kv-host-gib")
    if args.kv_disk_dir and not os.path.isdir(args.kv_disk_dir):
        raise BenchInputError(f"--kv-disk-dir {args.kv_disk_dir} is not an existing directory")


def disk_dir_for(args: argparse.Namespace, policy: str) -> contextlib.AbstractContextManager[str | None]:
    """A fresh directory under --kv-disk-dir for one policy's cluster, removed after it: every
    policy starts with empty disks, as with empty device and host tiers (a disk kept from an
    earlier run would serve hits the policy did not earn). None without a disk tier."""
    if not args.kv_disk_gib:
        return contextlib.nullcontext(None)
    return tempfile.TemporaryDirectory(prefix=f"replay-{policy}-", dir=args.kv_disk_dir)


def serve_argv(args: argparse.Namespace, policy: str, redis_url: str, namespace: str,
               http_port: int, grpc_port: int, disk_dir: str | None = None, frontends: int = 1) -> list[str]:
    argv = ["serve", "--mock", "--model", args.model, "--model-name", MODEL_NAME, "--decode-workers", str(args.workers),
            "--prefill-workers", "0",
            "--redis-url", redis_url, "--namespace", namespace, "--router-policy", policy,
            "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--admin-port", "0",
            "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--startup-timeout-s", str(args.startup_timeout_s), "--frontends", str(frontends)]
    if args.mock_profile:
        argv += ["--mock-profile", args.mock_profile]
    if args.num_blocks:
        argv += ["--num-blocks", str(args.num_blocks)]
    if args.kv_host_gib:
        argv += ["--kv-host-gib", str(args.kv_host_gib)]
    if disk_dir is not None:       # serve gives each worker its own subdirectory (ROLE-INDEX)
        argv += ["--kv-disk-gib", str(args.kv_disk_gib), "--kv-disk-dir", disk_dir]
    argv += ["--router-lower-tier-weight", str(args.lower_tier_weight)]
    return argv


async def worker_statuses(redis_url: str, namespace: str) -> list:
    import redis.asyncio as aioredis

    from proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
    from runtime.discovery import list_workers
    from runtime.grpc_links import cluster_metadata, worker_channel

    client = aioredis.Redis.from_url(redis_url)
    try:
        infos = await list_workers(client, namespace)
    finally:
        await client.aclose()
    out = []
    for info in infos:
        async with worker_channel(info.address) as channel:
            out.append(await worker_pb2_grpc.WorkerStub(channel).GetStatus(
                worker_pb2.WorkerStatusRequest(), timeout=5.0, metadata=cluster_metadata()))
    return out


def load_fields(statuses: list) -> dict:
    served = {s.worker_id: s.num_prompt_tokens for s in statuses}
    computed = {s.worker_id: s.num_prompt_tokens - s.num_prefix_hit_tokens for s in statuses}
    mean = sum(served.values()) / len(served) if served else 0.0
    return {"worker_prompt_tokens": served, "worker_computed_tokens": computed,
            "max_over_mean_load": round(max(served.values()) / mean, 3) if mean else None,
            "max_over_mean_computed": round(max(computed.values()) / (sum(computed.values()) / len(computed)), 3)
            if computed and sum(computed.values()) else None}


async def replay(args: argparse.Namespace, specs: list[RequestSpec], url: str, desc: str,
                 redis_url: str, namespace: str):
    client_args = SimpleNamespace(url=url, timeout_s=args.timeout_s, api_key=None,
                                  no_progress=args.no_progress, extra_body=None)
    run = await run_level_in_process(client_args, MODEL_NAME, specs, None, desc)
    return run, await worker_statuses(redis_url, namespace)


def run_policy(args: argparse.Namespace, policy: str, specs: list[RequestSpec],
               frontends: int = 1) -> tuple[dict, list[float]]:
    from runtime.redis_embedded import EmbeddedRedis, free_port
    from splitserve.serve import Cluster, wait_ready

    namespace = f"replay-{uuid.uuid4().hex[:6]}"
    http_port, grpc_port = free_port(), free_port()
    with EmbeddedRedis() as redis, disk_dir_for(args, policy) as disk_dir:
        cluster = Cluster()
        from runtime.grpc_links import ensure_cluster_token
        ensure_cluster_token()          # the cluster's, so that worker_statuses may ask its workers
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # the banner goes to stderr: this command's stdout carries only JSON
        cluster.spawn("serve", serve_argv(args, policy, redis.url, namespace, http_port, grpc_port, disk_dir,
                                          frontends), env, stdout=sys.stderr)
        try:
            if not wait_ready(cluster, f"http://127.0.0.1:{http_port}/health", args.workers, 0,
                              args.startup_timeout_s, {"sig": None}):
                raise RuntimeError(f"the {policy} cluster did not start")
            with asyncio.Runner(loop_factory=event_loop_factory("http://")) as runner:
                run, statuses = runner.run(replay(args, specs, f"http://127.0.0.1:{http_port}", policy,
                                                  redis.url, namespace))
        finally:
            cluster.stop(timeout_s=30.0)
    ok = [r for r in run.results if r.error is None]
    prompt = sum(r.prompt_len for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    record = {"policy": policy, "frontends": frontends, **summarize_level(run.results, run.duration_s),
              "host_load_avg_1m": round(os.getloadavg()[0], 2),
              "prefix_hit_rate": round(cached / prompt, 4) if prompt else None,
              "cached_tokens": cached, "max_in_flight": run.max_in_flight,
              **load_fields(statuses)}
    return record, sorted(r.ttft_s for r in ok)


# ---------------------------------------------------------------------------------------------
# The command


def plot_ttft_cdf(ttfts: dict[str, list[float]], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, xs in ttfts.items():
        if xs:
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


SUMMARY_KEYS = ("requests", "errors", "prefix_hit_rate", "oracle_share", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
                "itl_p50_s", "output_tok_s", "max_over_mean_load")


def frontend_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise BenchInputError(f"--frontends wants counts >= 1 (e.g. 1 or 1,4), got {text!r}")
    return counts


def main(args: argparse.Namespace) -> int:
    try:
        frontend_counts(args.frontends)
        policies = [p.strip() for p in args.policy.split(",") if p.strip()]
        if not policies or any(p not in POLICIES for p in policies):
            raise BenchInputError(f"--policy wants a comma list of {', '.join(POLICIES)}")
        check_tier_args(args)
        from splitserve.models import resolve_model
        args.model = resolve_model(args.model)
        specs, workload = make_specs(args)
    except BenchInputError as e:
        print(f"bench replay: {e}", file=sys.stderr)
        return 2
    header = {"bench": "replay", "git_sha": git_sha(), "machine": f"{platform.node()} "
              f"({os.cpu_count()} CPUs, {platform.machine()})", "label": args.label,
              "workers": args.workers, "block_size": args.block_size, "seed": args.seed,
              "mock_profile": args.mock_profile or "h100-8b-curve", "num_blocks": args.num_blocks,
              "kv_host_gib": args.kv_host_gib, "kv_disk_gib": args.kv_disk_gib, "lower_tier_weight": args.lower_tier_weight,
              "max_num_batched_tokens": args.max_num_batched_tokens, **workload,
              "offered_prefill_util": offered_prefill_util(specs, args), **oracle_fields(specs, args)}
    records, ttfts = [], {}
    for policy, frontends in [(p, f) for p in policies for f in frontend_counts(args.frontends)]:
        record, ttfts[policy] = run_policy(args, policy, specs, frontends)
        record["oracle_share"] = share_of_oracle(record["prefix_hit_rate"], header["oracle_hit_rate"])
        records.append(header | record)
        emit(records[-1], args.output)
    if args.plot:
        what = workload.get("trace") or workload["workload"]
        plot_ttft_cdf(ttfts, args.plot, f"TTFT, {what}, {args.workers} mock workers, speedup "
                      f"{workload.get('speedup', '-')} ({header['git_sha']})")
    if len(records) > 1:
        summary = header | {"bench": "replay_summary", "policy": policies, "plot": args.plot}
        summary |= {k: {f'{r["policy"]}/{r["frontends"]}': r[k] for r in records} for k in SUMMARY_KEYS} \
            if len(frontend_counts(args.frontends)) > 1 else {k: {r["policy"]: r[k] for r in records} for k in SUMMARY_KEYS}
        emit(summary, args.output)
    return 0

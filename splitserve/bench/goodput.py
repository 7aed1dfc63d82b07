"""`splitserve bench goodput`: the highest request rate at which a server keeps its latency targets.

Goodput, as DistServe defines it: the highest rate of Poisson arrivals at which at least the
`--attainment` share of requests (0.9 by default) meets BOTH targets, TTFT <= `--ttft-ms` and the
request's mean inter-token latency <= `--itl-ms`. A request's mean ITL is the mean of its ITL
samples as `bench serve` takes them (stats.itl_samples): (last token's arrival - first token's
arrival) / (tokens after the first chunk); with one token a chunk that is DistServe's TPOT,
(E2E - TTFT) / (output tokens - 1), except that the stream's tail after the last token does not
count. A request with no token after its first chunk meets the ITL target by definition; a failed
request (error, timeout, truncated stream) meets neither.

How it runs: a warm-up (by default two requests per GPU of `--gpus`, all at once, so that every
worker of a fleet has served before anything is measured: a worker's first request is slower
than the rest, and one cold worker among three is enough to fail the requests sent alone); then
`ALONE_REQUESTS` requests one at a time. If those already miss the targets more often than the
goal allows, no rate can meet them: the command says so and reports a goodput of 0 without
searching. Otherwise each probe sends Poisson arrivals at one rate for
`--duration-s` (at least `--min-requests` requests), waits for every response, and counts the
requests that met both targets; rate_search.py picks the rates (doubling/halving to a bracket,
then bisection) and says when to stop. The first rate is `--start-rate`, else `--start-in-flight`
requests in flight at the idle latency (that many / the median E2E of the requests sent alone).

The load generator is `bench serve`'s: its clients (HTTP OpenAI or gRPC), workloads (random or
corpus prompts of --isl/--osl or a --scenario, or a trace's lengths and prefixes: Mooncake JSONL or
Azure CSV, whose arrival times are replaced by the probe's Poisson ones), open-loop sender and
per-level statistics. Each probe draws its prompts from a seed of its own, so no probe finds its
prompts in the cache an earlier one filled. Output: one JSON line per probe (`goodput_probe`), the
last line the result (`goodput`: `goodput_req_s`, `goodput_req_s_per_gpu`, the attainment curve,
why the search stopped); `--plot` draws attainment against rate. Progress goes to stderr.

It knows nothing about the server's insides.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from splitserve.bench import serve as bench_serve
from splitserve.bench.clients import RequestResult, RequestSpec
from splitserve.bench.rate_search import RateSearch, SearchLimits, StopReason
from splitserve.bench.records import git_sha
from splitserve.bench.stats import percentile, summarize_level
from splitserve.bench.workloads import BenchInputError, synthetic_specs, trace_specs

WARMUP_PER_GPU = 2             # without --warmup: warm-up requests per GPU (every worker serves some)
ALONE_REQUESTS = 3             # sent one at a time before the search: can an idle server meet the targets?
ALONE_SALT = 1 << 30           # their prompts' seed, apart from the probes' and the warm-up's
ITL_DEFINITION = ("per request: (last token time - first token time) / (tokens after the first chunk), "
                  "the mean of its ITL samples")


@dataclass(frozen=True, slots=True)
class Targets:
    ttft_s: float
    itl_s: float

    def meets(self, r: RequestResult) -> tuple[bool, bool]:
        """(TTFT met, mean ITL met) for one request; a failed request meets neither."""
        if r.error is not None:
            return False, False
        itl = request_mean_itl_s(r)
        return r.ttft_s <= self.ttft_s, itl is None or itl <= self.itl_s


def request_mean_itl_s(r: RequestResult) -> float | None:
    """The mean of the request's ITL samples (None: no token came after the first chunk)."""
    later = r.num_output_tokens - (r.chunk_tokens[0] if r.chunk_tokens else 0)
    if later <= 0 or len(r.chunk_times) < 2:
        return None
    return (r.chunk_times[-1] - r.chunk_times[0]) / later


def request_latencies(results: Sequence[RequestResult]) -> tuple[np.ndarray, np.ndarray]:
    """Each request's TTFT and mean ITL, in seconds: inf for both where it failed (an error, or no
    token), nan for the ITL where no token came after the first chunk."""
    ttft = np.full(len(results), np.inf)
    itl = np.full(len(results), np.inf)
    for i, r in enumerate(results):
        if r.error is None and r.chunk_times:
            mean_itl = request_mean_itl_s(r)
            ttft[i], itl[i] = r.ttft_s, np.nan if mean_itl is None else mean_itl
    return ttft, itl


def add_arguments(p: argparse.ArgumentParser) -> None:
    bench_serve.add_target_arguments(p)
    p.add_argument("--ttft-ms", type=float, required=True, help="time-to-first-token target, ms")
    p.add_argument("--itl-ms", type=float, required=True,
                   help="target for each request's mean inter-token latency, ms")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="share of requests that must meet both targets, in (0, 1]")
    bench_serve.add_workload_arguments(p)
    p.add_argument("--duration-s", type=float, default=30.0,
                   help="arrivals of one probe last this long (a probe then waits for its responses)")
    p.add_argument("--min-requests", type=int, default=10, help="requests of one probe at least")
    p.add_argument("--start-rate", type=float, default=None,
                   help="first rate probed, requests/s; none: --start-in-flight / the median E2E of the "
                        "requests sent alone")
    p.add_argument("--start-in-flight", type=float, default=2.0,
                   help="without --start-rate, the first rate keeps this many requests in flight at the idle "
                        "server's latency (Little's law); a batching server starts sooner higher")
    p.add_argument("--min-rate", type=float, default=0.01, help="halving stops here, requests/s")
    p.add_argument("--max-rate", type=float, default=1000.0, help="doubling stops here, requests/s")
    p.add_argument("--precision", type=float, default=0.1,
                   help="stop when the bracket (highest passing rate, lowest failing rate) is narrower "
                        "than this share of its lower end")
    p.add_argument("--max-probes", type=int, default=12, help="rates tried at most")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no probe that would end past this many seconds; none: no limit")
    bench_serve.add_report_arguments(p, "attainment against request rate")
    # bench serve's plan reader wants these; a goodput probe sets its own count and arrival times
    p.set_defaults(concurrency=None, num_requests=None, speedup=1.0, warmup=None)


def check_args(args: argparse.Namespace) -> tuple[Targets, bench_serve.Plan]:
    for name in ("ttft_ms", "itl_ms", "duration_s"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise BenchInputError(f"--{name.replace('_', '-')} must be a number > 0, got {value}")
    if not 0 < args.attainment <= 1:
        raise BenchInputError(f"--attainment must lie in (0, 1], got {args.attainment}")
    if args.min_requests < 1:
        raise BenchInputError(f"--min-requests must be >= 1, got {args.min_requests}")
    if args.processes < 1:
        raise BenchInputError(f"--processes must be >= 1, got {args.processes}")
    if args.warmup is None:
        args.warmup = WARMUP_PER_GPU * max(args.gpus, 1)
    if args.warmup < 0:
        raise BenchInputError(f"--warmup must be >= 0, got {args.warmup}")
    if not args.start_in_flight > 0:
        raise BenchInputError(f"--start-in-flight must be > 0, got {args.start_in_flight}")
    if args.time_budget_s is not None and not args.time_budget_s > 0:
        raise BenchInputError(f"--time-budget-s must be > 0, got {args.time_budget_s}")
    try:
        SearchLimits(args.start_rate or args.min_rate, args.min_rate, args.max_rate, args.precision,
                     args.max_probes)
    except ValueError as e:
        raise BenchInputError(f"bad search limits: {e}") from None
    return Targets(args.ttft_ms / 1000.0, args.itl_ms / 1000.0), bench_serve.make_plan(args)


def poisson_arrivals(rate: float, n: int, seed: Sequence[int]) -> np.ndarray:
    """n arrival times (s) of a Poisson process of `rate` per second, the first at 0."""
    gaps = np.random.default_rng(list(seed)).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])])


def probe_specs(plan: bench_serve.Plan, args: argparse.Namespace, rate: float, n: int,
                salt: int) -> list[RequestSpec]:
    """n requests of the workload, their prompts seeded by (seed, salt), arriving as Poisson(rate).
    A trace lends n consecutive rows (wrapping) from a seeded offset: its lengths and shared
    prefixes, not its arrival times."""
    seed = (args.seed, salt)
    if plan.trace_rows:
        rows = plan.trace_rows
        first = int(np.random.default_rng(list(seed)).integers(len(rows)))
        taken = [rows[(first + i) % len(rows)] for i in range(n)]
        specs = trace_specs(taken, plan.block_size, args.vocab_size, seed)
    else:
        specs = synthetic_specs(plan.isl, plan.osl, n, args.vocab_size, seed, plan.range_ratio, plan.corpus)
    for spec, t in zip(specs, poisson_arrivals(rate, n, (*seed, 7))):
        spec.arrival_s = float(t)
    return specs


def attainment_fields(results: Sequence[RequestResult], targets: Targets) -> dict:
    met = [targets.meets(r) for r in results]
    n = max(len(results), 1)
    itls = np.array([x for r in results if r.error is None and (x := request_mean_itl_s(r)) is not None])
    return {"met": sum(a and b for a, b in met),
            "attainment": round(sum(a and b for a, b in met) / n, 4),
            "ttft_attainment": round(sum(a for a, _ in met) / n, 4),
            "itl_attainment": round(sum(b for _, b in met) / n, 4),
            "request_mean_itl_p50_s": percentile(itls, 50), "request_mean_itl_p90_s": percentile(itls, 90)}


@dataclass(slots=True)
class Session:
    """One goodput run: its settings, the server's model, and what every record starts with."""
    args: argparse.Namespace
    plan: bench_serve.Plan
    targets: Targets
    model: str
    header: dict


async def measure(s: Session, specs: list[RequestSpec], concurrency: int | None, desc: str,
                  probe_at: tuple[float, int] | None = None) -> dict:
    """Send `specs` (open loop at their arrival times, or closed loop) and reduce them to a record.
    A probe (`probe_at`: its rate and salt) with --processes N is sent by N client processes, each
    every N-th request of the same list at its own arrival time (procs.py), their results merged."""
    if probe_at is not None and s.args.processes > 1:
        from splitserve.bench.procs import run_level_processes
        rate, salt = probe_at
        args = argparse.Namespace(**vars(s.args), probe_rate=rate)
        results, duration_s, peak, lag = await asyncio.to_thread(
            run_level_processes, probe_share, args, s.model, None, salt, s.args.processes)
        run = bench_serve.LevelRun(results, duration_s, peak, lag)
    else:
        run = await bench_serve.run_level_in_process(s.args, s.model, specs, concurrency, desc)
    record = summarize_level(run.results, run.duration_s, s.args.gpus)
    record |= attainment_fields(run.results, s.targets)
    record["client_lag_p99_s"] = percentile(np.array(run.loop_lag_s), 99)
    return record


async def probe(s: Session, rate: float, index: int) -> dict:
    n = probe_size(s.args, rate)
    specs = probe_specs(s.plan, s.args, rate, n, salt=index)
    span = specs[-1].arrival_s
    record = s.header | {"bench": "goodput_probe", "rate_req_s": rate,
                         "offered_rate_req_s": round((n - 1) / span, 4) if span > 0 else None}
    record |= await measure(s, specs, None, f"{rate:.4g} req/s", probe_at=(rate, index))
    record["processes"] = s.args.processes
    record["passed"] = record["attainment"] >= s.args.attainment
    lag = record["client_lag_p99_s"]
    if lag is not None and lag > 0.25 * s.targets.itl_s:
        print(f"bench goodput: warning: the client's event loop ran {lag * 1000:.0f} ms late (p99) at "
              f"{rate:.4g} req/s; latencies there are the client's as much as the server's", file=sys.stderr)
    return record


def probe_share(conn, args: argparse.Namespace, model: str, concurrency: int | None, salt: int, k: int,
                n: int) -> None:
    """In client process k of n (procs.py): the probe's requests, as `probe` builds them, every n-th
    from the k-th, sent open loop at their arrival times."""
    plan = bench_serve.make_plan(args)
    specs = probe_specs(plan, args, args.probe_rate, probe_size(args, args.probe_rate), salt)[k::n]
    bench_serve.run_share(conn, args, model, specs, concurrency, f"p{k}")


async def alone(s: Session) -> dict:
    """ALONE_REQUESTS requests one at a time: the idle server's latency."""
    specs = probe_specs(s.plan, s.args, 1.0, ALONE_REQUESTS, salt=ALONE_SALT)
    record = s.header | {"bench": "goodput_alone"} | await measure(s, specs, 1, "alone")
    record["passed"] = record["attainment"] >= s.args.attainment
    return record


def emit(record: dict, output: str | None) -> None:
    bench_serve.emit(record, output)


def say(text: str) -> None:
    print(f"bench goodput: {text}", file=sys.stderr, flush=True)


def make_header(args: argparse.Namespace, plan: bench_serve.Plan, model: str) -> dict:
    header = {"bench": "goodput", "git_sha": git_sha(), "url": args.url,
              "api": "grpc" if args.url.startswith("grpc://") else "http", "model": model,
              "label": args.label, "gpus": args.gpus, "seed": args.seed, "ttft_ms": args.ttft_ms,
              "itl_ms": args.itl_ms, "attainment_goal": args.attainment, "probe_duration_s": args.duration_s,
              **plan.workload_fields}
    if plan.trace_rows:
        header |= {"trace": os.path.basename(args.trace), "trace_scale": args.trace_scale,
                   "max_input_len": args.max_input_len}
    return header


def probe_size(args: argparse.Namespace, rate: float) -> int:
    return max(math.ceil(rate * args.duration_s), args.min_requests)


class ProbeClock:
    """How long the next probe will take: its arrivals (requests / rate) plus the longest drain seen
    (a probe's wall time past its arrivals; at first the idle server's E2E p99)."""

    def __init__(self, args: argparse.Namespace, idle: dict) -> None:
        self.args, self.started = args, time.monotonic()
        self.drain_s = idle["e2e_p99_s"] or 0.0

    def fits(self, rate: float) -> bool:
        budget = self.args.time_budget_s
        expected_s = probe_size(self.args, rate) / rate + self.drain_s
        return budget is None or time.monotonic() - self.started + expected_s <= budget

    def ran(self, rate: float, wall_s: float) -> None:
        self.drain_s = max(self.drain_s, wall_s - probe_size(self.args, rate) / rate)


def idle_verdict(args: argparse.Namespace, idle: dict) -> str | None:
    """Why the search cannot start (None: it can)."""
    if idle["errors"] == idle["requests"]:
        return (f"every request sent alone failed ({', '.join(idle['error_kinds'])}): is {args.url} an "
                "OpenAI-compatible completions server that streams?")
    if idle["passed"]:
        return None
    return (f"the targets are never met: requests sent one at a time met TTFT <= {args.ttft_ms:g} ms and "
            f"mean ITL <= {args.itl_ms:g} ms {idle['met']} of {idle['requests']} times (TTFT p50 "
            f"{_ms(idle['ttft_p50_s'])}, mean ITL p50 {_ms(idle['request_mean_itl_p50_s'])}, "
            f"{idle['errors']} failed); no request rate can reach {args.attainment:g}. Goodput: 0")


async def run_search(args: argparse.Namespace, plan: bench_serve.Plan, targets: Targets) -> int:
    started = time.monotonic()
    model, _ = await bench_serve.discover_model(args)
    s = Session(args, plan, targets, model, make_header(args, plan, model))
    if args.warmup > 0:
        await bench_serve.warm_up(args, plan, model)
    idle = await alone(s)
    emit(idle, args.output)
    start_rate = args.start_rate or (args.start_in_flight / idle["e2e_p50_s"] if idle["e2e_p50_s"] else args.min_rate)
    search = RateSearch(SearchLimits(min(max(start_rate, args.min_rate), args.max_rate), args.min_rate,
                                     args.max_rate, args.precision, args.max_probes))
    if (why := idle_verdict(args, idle)) is not None:
        say(why)
        if idle["errors"] == idle["requests"]:
            return 1
        search.stop(StopReason.UNATTAINABLE)
    clock, probes = ProbeClock(args, idle), []
    while (rate := search.next_rate()) is not None:
        if not clock.fits(rate):
            search.stop(StopReason.TIME_BUDGET)
            break
        probe_start = time.monotonic()
        record = await probe(s, rate, len(probes))
        clock.ran(rate, time.monotonic() - probe_start)
        search.record(rate, record["passed"])
        emit(record, args.output)
        probes.append(record)
        say(f"{rate:.4g} req/s: {record['met']} of {record['requests']} met both targets "
            f"({record['attainment']:.1%}; TTFT {record['ttft_attainment']:.1%}, ITL "
            f"{record['itl_attainment']:.1%}) -> {'pass' if record['passed'] else 'miss'}")
    return finish(s, search, idle, probes, time.monotonic() - started)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def finish(s: Session, search: RateSearch, idle: dict, probes: list[dict], elapsed_s: float) -> int:
    args = s.args
    best = max((p for p in probes if p["passed"]), key=lambda p: p["rate_req_s"], default=None)
    curve = sorted(({"rate_req_s": p["rate_req_s"], "attainment": p["attainment"], "requests": p["requests"]}
                    for p in probes), key=lambda c: c["rate_req_s"])
    reason = search.stop_reason
    summary = s.header | {
        "goodput_req_s": search.goodput,
        "goodput_req_s_per_gpu": round(search.goodput / args.gpus, 6),
        "stop_reason": reason.value if reason else None,
        "converged": reason is StopReason.CONVERGED,
        "bracket_req_s": [search.passed, search.failed],
        "attainment_curve": curve,
        "idle": {k: idle.get(k) for k in ("met", "requests", "ttft_p50_s", "request_mean_itl_p50_s", "e2e_p50_s")},
        "at_goodput": None if best is None else {k: best.get(k) for k in (
            "attainment", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "request_mean_itl_p90_s",
            "output_tok_s", "output_tok_s_per_gpu", "total_tok_s_per_gpu")},
        "itl_definition": ITL_DEFINITION,
        "probes": len(probes),
        "total_requests": idle["requests"] + sum(p["requests"] for p in probes),
        "total_errors": idle["errors"] + sum(p["errors"] for p in probes),
        "elapsed_s": round(elapsed_s, 3),
        "plot": args.plot,
    }
    emit(summary, args.output)        # before the plot: a host without matplotlib keeps the result
    if args.plot:
        from splitserve.bench.goodput_plot import plot_attainment
        what = s.header.get("scenario") or s.header.get("trace") or f"isl{args.isl}/osl{args.osl}"
        try:
            plot_attainment(curve, args.attainment, search.goodput, args.plot,
                            f"{s.model} | {what} | TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms | "
                            f"{args.label or s.header['api']}")
        except ImportError as e:
            say(f"no plot ({e})")
    bound = {StopReason.MAX_RATE: " (at least: the search stopped at --max-rate)",
             StopReason.MAX_PROBES: " (the probe budget ran out before the bracket closed)",
             StopReason.TIME_BUDGET: " (the time budget ran out before the bracket closed)",
             StopReason.MIN_RATE: f" (no rate down to {args.min_rate:g} req/s met the targets)"}.get(reason, "")
    say(f"goodput {search.goodput:g} req/s, {summary['goodput_req_s_per_gpu']:g} per GPU{bound}")
    return 0


def main(args: argparse.Namespace) -> int:
    """Run the search; 0 when it ran (a goodput of 0 included), 1 when the server failed every
    request, 2 on bad input."""
    try:
        targets, plan = check_args(args)
        with asyncio.Runner(loop_factory=bench_serve.event_loop_factory(args.url)) as runner:
            return runner.run(run_search(args, plan, targets))
    except BenchInputError as e:
        print(f"bench goodput: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="splitserve bench goodput", description=__doc__.split("\n")[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))

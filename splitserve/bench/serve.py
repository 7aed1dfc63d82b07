"""`splitserve bench serve`: an InferenceMAX-style load generator for a running Splitserve.

Owns the client side of a serving benchmark: building prompts (random token ids, their lengths
fixed or drawn per request as InferenceMAX does; text drawn from a corpus, as aiperf and vLLM's
benchmark send it, so that the server's tokenization is in the measured path; or real prompts
rebuilt from a Mooncake trace's prefix-block hash ids), driving the OpenAI HTTP API (`/v1/completions`, streamed) or the gRPC
`Generation.Generate` stream at a sweep of concurrency levels, timing every token, and reducing the
timings to one JSON line per level plus a summary and a Pareto plot (`plot.py`); the
clients and the request/result types are in `clients.py`. It knows nothing about the server's
insides.

Definitions (also in docs/benchmarking.md):

- A *chunk* is one piece of response body as httpx hands it over (one HTTP/1.1 transfer chunk,
  normally one SSE event per server flush) or one gRPC stream message, that carries new tokens;
  every token in it is stamped with the time the client read the chunk. Several SSE events inside one
  piece are one chunk.
- TTFT: send -> first chunk with a token. E2E: send -> end of stream.
- ITL: for every chunk after the first, its gap from the previous chunk split evenly over the k
  tokens it carries (k samples of gap/k). Extra tokens in the first chunk give no ITL sample (their
  wait is inside TTFT).
- output_tok_s_per_user: the median over successful requests of (output_tokens - 1) / (e2e - ttft),
  i.e. 1 / TPOT, the decode speed one user sees (InferenceMAX's "interactivity"). Requests with a
  single output token have no decode phase and are left out.
- output_tok_s: output tokens of successful requests (as received) / the level's wall time (first
  send -> last completion); input_tok_s likewise with prompt tokens; *_per_gpu divides by --gpus.
- mean_input_len, mean_output_len: the mean prompt length and max_tokens of the requests sent
  (failed ones included): the workload itself, which a range ratio below 1 makes vary. With
  --corpus the prompt length is the window's length in tokens; the server's own count
  (usage.prompt_tokens) may differ by a token or two where the window's edges re-tokenize, and it
  is the one input_tok_s counts.
- A request fails (counted in `errors` by kind, left out of every latency and throughput figure) on
  a non-200 status, a connection or protocol error, a timeout, an error event, a stream that ends
  without [DONE] / a finish reason, or a stream with no tokens. A failed request never stops the run.
- token_mismatches: successful requests whose output token count differs from max_tokens (the
  requests set ignore_eos, so they must be equal) or from the server's own usage count.

- client_lag_p99_s: how late the client's event loop woke a 10 ms timer (p99) during the level. When
  it exceeds a few ms the client, not the server, is the bottleneck: chunks queue in the socket and
  are read back to back, so ITL and TTFT are inflated or squashed. Use fewer streams per process.

The client keeps per-token work to one list append: the SSE parser splits bytes into events, each
event is JSON-decoded once, and a chunk appends one timestamp and one token count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from splitserve.bench.clients import RequestResult, RequestSpec, make_client
from splitserve.bench.records import git_sha
from splitserve.bench.stats import percentile, summarize_level
from splitserve.bench.workloads import (DEFAULT_CONCURRENCY, DEFAULT_REQUESTS_CAP, SCENARIO_RANGE_RATIO,
                                        TRACE_BLOCK_TOKENS, BenchInputError, TextCorpus, TraceRow,
                                        default_num_requests, load_trace, parse_concurrency, parse_scenario,
                                        synthetic_specs, trace_specs)

# ---------------------------------------------------------------------------------------------
# Load patterns: when to send


@dataclass(slots=True)
class LevelRun:
    results: list[RequestResult]
    duration_s: float
    max_in_flight: int
    loop_lag_s: list[float] = field(default_factory=list)


async def sample_loop_lag(into: list[float], period_s: float = 0.01) -> None:
    """Until cancelled, append how late each `period_s` sleep wakes up: the client's own load."""
    while True:
        start = time.perf_counter()
        await asyncio.sleep(period_s)
        # asyncio may wake a timer up to its clock resolution early: that is no lag
        into.append(max(time.perf_counter() - start - period_s, 0.0))


async def run_closed_loop(send, specs: Sequence[RequestSpec], concurrency: int,
                          on_done: Callable[[], None] = lambda: None) -> LevelRun:
    """Keep exactly `concurrency` requests in flight until `specs` runs out."""
    pending = iter(specs)
    results: list[RequestResult] = []

    async def user() -> None:
        for spec in pending:  # the shared iterator hands each free user the next request
            results.append(await send(spec))
            on_done()

    start = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(min(concurrency, len(specs)))))
    return LevelRun(results, time.perf_counter() - start, min(concurrency, len(specs)))


async def run_replay(send, specs: Sequence[RequestSpec],
                     on_done: Callable[[], None] = lambda: None) -> LevelRun:
    """Send each request at its `arrival_s` (open loop), however many are then in flight."""
    results: list[RequestResult] = []
    in_flight = max_in_flight = 0

    async def one(spec: RequestSpec) -> None:
        nonlocal in_flight, max_in_flight
        in_flight += 1
        max_in_flight = max(max_in_flight, in_flight)
        results.append(await send(spec))
        in_flight -= 1
        on_done()

    start = time.perf_counter()
    tasks = []
    for spec in specs:
        delay = start + spec.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(spec)))
    await asyncio.gather(*tasks)
    return LevelRun(results, time.perf_counter() - start, max_in_flight)


# ---------------------------------------------------------------------------------------------
# The command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    add_workload_arguments(parser)
    p = parser
    p.add_argument("--speedup", type=float, default=1.0,
                   help="trace replay: divide arrival times by this")
    p.add_argument("--concurrency", default=None,
                   help=f"comma-separated closed-loop levels (default {DEFAULT_CONCURRENCY}); "
                        "with --trace, given = closed loop over the trace, absent = replay arrivals")
    p.add_argument("--num-requests", type=int, default=None,
                   help=f"requests per level (default max(4*concurrency, 16), at most "
                        f"{DEFAULT_REQUESTS_CAP}; replay: the whole trace)")
    add_report_arguments(parser, "the Pareto plot")


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    """The server and how to reach it (shared with `bench goodput`)."""
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="http://host:port (OpenAI API) or grpc://host:port (gRPC API)")
    p.add_argument("--model", default=None, help="model id (default: the first the server lists)")
    p.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY"),
                   help="bearer token (default: $SPLITSERVE_API_KEY)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request limit, whole stream")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """What each request asks for (shared with `bench goodput`)."""
    p.add_argument("--isl", type=int, default=None,
                   help="input tokens per request (random ids; the maximum if --random-range-ratio < 1)")
    p.add_argument("--osl", type=int, default=None,
                   help="output tokens per request (ignore_eos; the maximum if --random-range-ratio < 1)")
    p.add_argument("--scenario", default=None, help="InferenceMAX's 1k1k, 1k8k or 8k1k: --isl/--osl "
                                                    f"with --random-range-ratio {SCENARIO_RANGE_RATIO}")
    p.add_argument("--random-range-ratio", type=float, default=None, metavar="R",
                   help="R in (0, 1]: each request's input and output lengths are drawn independently, "
                        "uniform over the integers [floor(R*N), N] (N = isl or osl), as vLLM's "
                        "benchmark_serving --random-range-ratio that InferenceMAX runs; default "
                        f"{SCENARIO_RANGE_RATIO} with --scenario (InferenceMAX's value), 1 (exact "
                        "lengths) with --isl/--osl; not with --trace")
    p.add_argument("--trace", default=None,
                   help="Mooncake JSONL trace (timestamp, lengths, hash_ids) or Azure LLM CSV "
                        "(TIMESTAMP, ContextTokens, GeneratedTokens)")
    p.add_argument("--trace-scale", type=float, default=1.0,
                   help="multiply trace lengths and the 512-token block size by this")
    p.add_argument("--max-input-len", type=int, default=None, help="cap trace input lengths")
    p.add_argument("--corpus", default=None, metavar="PATH",
                   help="send text prompts: windows of the input length cut from this text file (or the "
                        ".txt/.md/.py/.rst files under this directory), so that the server tokenizes them "
                        "in the measured time (needs --tokenizer); default: random token ids")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="with --corpus: the served model's directory (its tokenizer.json), or tiny")
    p.add_argument("--vocab-size", type=int, default=4000,
                   help="prompt token ids are drawn from [0, vocab-size), below the special tokens")
    p.add_argument("--seed", type=int, default=0)


def add_report_arguments(p: argparse.ArgumentParser, plot: str) -> None:
    """Warm-up, GPUs, where results go (shared with `bench goodput`)."""
    p.add_argument("--warmup", type=int, default=2, help="requests sent before the sweep, not measured")
    p.add_argument("--gpus", type=int, default=1, help="GPUs serving; divides throughput per GPU")
    p.add_argument("--output", default=None, help="append the JSON lines to this file")
    p.add_argument("--plot", default=None, help=f"write {plot} to this PNG")
    p.add_argument("--label", default="", help="device label for the plot title and the JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--extra-body", type=_json_object, default=None,
                   help='HTTP only: a JSON object merged into every request body, e.g. \'{"echo": true, "logprobs": 1}\'')
    p.add_argument("--processes", type=int, default=1,
                   help="split each level's clients (bench goodput: each probe's requests) over this many "
                        "processes (procs.py) and merge their records, so that the load generator never sets "
                        "the pace")


@dataclass(frozen=True, slots=True)
class Plan:
    """The validated workload: synthetic (isl/osl) or trace, closed loop or replay."""

    levels: tuple[int | None, ...]  # None = one replay level
    isl: int | None = None
    osl: int | None = None
    scenario: str | None = None
    range_ratio: float = 1.0
    trace_rows: tuple[TraceRow, ...] = ()
    block_size: int = TRACE_BLOCK_TOKENS
    corpus: TextCorpus | None = None

    @property
    def workload_fields(self) -> dict:
        if self.trace_rows:
            return {}
        return {"scenario": self.scenario, "isl": self.isl, "osl": self.osl,
                "range_ratio": self.range_ratio, "prompts": "text" if self.corpus else "token_ids"}


def make_plan(args: argparse.Namespace) -> Plan:
    modes = [args.trace is not None, args.scenario is not None,
             args.isl is not None or args.osl is not None]
    if sum(modes) != 1:
        raise BenchInputError("give exactly one of --isl/--osl, --scenario or --trace")
    for name in ("gpus", "vocab_size"):
        if getattr(args, name) < 1:
            raise BenchInputError(f"--{name.replace('_', '-')} must be >= 1")
    if args.speedup <= 0 or args.timeout_s <= 0:
        raise BenchInputError("--speedup and --timeout-s must be > 0")
    if args.num_requests is not None and args.num_requests < 1:
        raise BenchInputError("--num-requests must be >= 1")
    if getattr(args, "processes", 1) < 1:
        raise BenchInputError("--processes must be >= 1")
    ratio = args.random_range_ratio
    if ratio is not None and not 0 < ratio <= 1:  # NaN fails too
        raise BenchInputError(f"--random-range-ratio must be in (0, 1], got {ratio}")
    if args.trace is not None:
        if getattr(args, "corpus", None) is not None:
            raise BenchInputError("--corpus is for --isl/--osl and --scenario; trace prompts are token ids")
        if ratio is not None:
            raise BenchInputError("--random-range-ratio is for --isl/--osl and --scenario; "
                                  "--trace requests keep the trace's own lengths")
        rows, block_size = load_trace(args.trace, args.trace_scale, args.max_input_len)
        levels = tuple(parse_concurrency(args.concurrency)) if args.concurrency else (None,)
        return Plan(levels, trace_rows=tuple(rows), block_size=block_size)
    levels = tuple(parse_concurrency(args.concurrency or DEFAULT_CONCURRENCY))
    corpus = None
    if getattr(args, "corpus", None) is not None:
        if not args.tokenizer:
            raise BenchInputError("--corpus needs --tokenizer (the served model's directory, or tiny)")
        corpus = TextCorpus(args.corpus, args.tokenizer)
    if args.scenario is not None:
        isl, osl = parse_scenario(args.scenario)
        return Plan(levels, isl, osl, args.scenario.strip().lower(),
                    SCENARIO_RANGE_RATIO if ratio is None else ratio, corpus=corpus)
    if args.isl is None or args.osl is None or args.isl < 1 or args.osl < 1:
        raise BenchInputError("--isl and --osl go together and must be >= 1")
    return Plan(levels, args.isl, args.osl, range_ratio=1.0 if ratio is None else ratio, corpus=corpus)


def level_specs(plan: Plan, args: argparse.Namespace, concurrency: int | None,
                salt: int) -> list[RequestSpec]:
    """This level's requests. Each level (and the warmup) gets its own token seed `salt`, so that
    no level hits a prefix that an earlier level left in the server's cache."""
    seed = (args.seed, salt)
    if concurrency is None:  # trace replay
        rows = plan.trace_rows[:args.num_requests] if args.num_requests else plan.trace_rows
        return trace_specs(rows, plan.block_size, args.vocab_size, seed, args.speedup)
    n = args.num_requests or default_num_requests(concurrency)
    if plan.trace_rows:
        return trace_specs(plan.trace_rows[:n], plan.block_size, args.vocab_size, seed)
    return synthetic_specs(plan.isl, plan.osl, n, args.vocab_size, seed, plan.range_ratio, plan.corpus)


def emit(record: dict, output: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if output:
        with open(output, "a") as f:
            f.write(line + "\n")


async def discover_model(args: argparse.Namespace) -> tuple[str, int | None]:
    client = make_client(args.url, args.model or "", 1, args.timeout_s, args.api_key)
    try:
        models = await client.list_models()
    except Exception as e:  # noqa: BLE001 - any failure to list models is reported the same way
        if args.model:
            return args.model, None
        raise BenchInputError(f"cannot list models at {args.url} ({type(e).__name__}: {e}); "
                              "pass --model") from None
    finally:
        await client.aclose()
    chosen = next((m for m in models if m["id"] == args.model), None) if args.model else \
        (models[0] if models else None)
    if chosen is None:
        if args.model:
            return args.model, None
        raise BenchInputError(f"{args.url} lists no models; pass --model")
    return chosen["id"], chosen["max_model_len"]


async def run_level_in_process(args: argparse.Namespace, model: str, specs: list[RequestSpec],
                               concurrency: int | None, desc: str) -> LevelRun:
    from tqdm import tqdm

    pool = concurrency if concurrency is not None else min(len(specs), 4096)
    client = make_client(args.url, model, pool, args.timeout_s, args.api_key)
    if args.extra_body:
        if not hasattr(client, "extra_body"):
            raise SystemExit("--extra-body is for the HTTP API only")
        client.extra_body = args.extra_body
    bar = tqdm(total=len(specs), desc=desc, unit="req", file=sys.stderr, mininterval=0.5,
               disable=args.no_progress, leave=False)
    lag: list[float] = []
    sampler = asyncio.create_task(sample_loop_lag(lag))
    try:
        if concurrency is None:
            run = await run_replay(client.send, specs, bar.update)
        else:
            run = await run_closed_loop(client.send, specs, concurrency, bar.update)
        run.loop_lag_s = lag
        return run
    finally:
        sampler.cancel()
        bar.close()
        await client.aclose()


async def run_level(args: argparse.Namespace, plan: Plan, model: str, concurrency: int | None,
                    salt: int) -> LevelRun:
    """One level, in this process or split over --processes (procs.py)."""
    n = getattr(args, "processes", 1)
    if n <= 1:
        specs = level_specs(plan, args, concurrency, salt)
        return await run_level_in_process(args, model, specs, concurrency,
                                          f"c={concurrency}" if concurrency else "replay")
    from splitserve.bench.procs import run_level_processes
    results, duration_s, max_in_flight, lag = await asyncio.to_thread(
        run_level_processes, level_share, args, model, concurrency, salt, n)
    return LevelRun(results, duration_s, max_in_flight, lag)


def level_share(conn, args: argparse.Namespace, model: str, concurrency: int | None, salt: int, k: int,
                n: int) -> None:
    """In client process k of n (procs.py): build the level's requests, take every n-th from the
    k-th and a share of the concurrency, say ready, wait for go, run, send the results back."""
    from splitserve.bench.procs import shares

    plan = make_plan(args)
    specs = level_specs(plan, args, concurrency, salt)[k::n]
    run_share(conn, args, model, specs, None if concurrency is None else shares(concurrency, n)[k], f"p{k}")


def run_share(conn, args: argparse.Namespace, model: str, specs: list[RequestSpec], concurrency: int | None,
              desc: str) -> None:
    """A client process's part (procs.py): say ready, wait for go, run `specs` at `concurrency`
    (None: open loop at their arrival times, from the common go), send the results back."""
    conn.send("ready")
    conn.recv()                                     # go
    with asyncio.Runner(loop_factory=event_loop_factory(args.url)) as runner:
        start = time.perf_counter()
        run = runner.run(run_level_in_process(args, model, specs, concurrency, desc)) \
            if specs and concurrency != 0 else None
        end = time.perf_counter()
    conn.send((start, end, run.results if run else [], run.loop_lag_s if run else [],
               run.max_in_flight if run else 0))
    conn.close()


# The client's loop lag (p99) beyond this share of the ITL p50 stamps chunks late enough to distort ITL.
LAG_WARN_SHARE_OF_ITL = 0.2


def warn_client_lag(record: dict) -> None:
    """Mark (and say on stderr) a level whose client lagged enough to distort its ITL figures."""
    lag, itl = record.get("client_lag_p99_s"), record.get("itl_p50_s")
    record["client_lag_distorts_itl"] = bool(lag and itl and lag > LAG_WARN_SHARE_OF_ITL * itl)
    if record["client_lag_distorts_itl"]:
        print(f"bench serve: warning: at concurrency {record.get('concurrency')} the client's event loop lagged "
              f"{lag * 1e3:.1f} ms at p99 against an ITL p50 of {itl * 1e3:.1f} ms: the load generator, not "
              f"the server, shapes ITL; use more --processes (now {record.get('processes', 1)})",
              file=sys.stderr)


WARMUP_SALT = 1 << 31


async def warm_up(args: argparse.Namespace, plan: Plan, model: str) -> None:
    """Send --warmup requests (closed loop, as many at once as the largest level), unmeasured."""
    concurrency = min(args.warmup, max((c for c in plan.levels if c), default=args.warmup))
    seed = (args.seed, WARMUP_SALT)
    if plan.trace_rows:
        specs = trace_specs(plan.trace_rows[:args.warmup], plan.block_size, args.vocab_size, seed)
    else:
        specs = synthetic_specs(plan.isl, plan.osl, args.warmup, args.vocab_size, seed, plan.range_ratio)
    await run_level_in_process(args, model, specs, concurrency, "warmup")


async def run_sweep(args: argparse.Namespace, plan: Plan) -> int:
    model, max_model_len = await discover_model(args)
    if max_model_len and plan.isl and plan.isl + plan.osl > max_model_len:
        print(f"bench serve: warning: isl+osl={plan.isl + plan.osl} exceeds the model's "
              f"max_model_len={max_model_len}", file=sys.stderr)
    header = {"bench": "serve", "git_sha": git_sha(), "url": args.url,
              "api": "grpc" if args.url.startswith("grpc://") else "http", "model": model,
              "label": args.label, "gpus": args.gpus, "seed": args.seed, **plan.workload_fields}
    if plan.trace_rows:
        header |= {"trace": os.path.basename(args.trace), "trace_scale": args.trace_scale,
                   "max_input_len": args.max_input_len}
    if args.warmup > 0:
        await warm_up(args, plan, model)
    levels = []
    for i, concurrency in enumerate(plan.levels):
        run = await run_level(args, plan, model, concurrency, i)
        mode = {"concurrency": concurrency} if concurrency else \
            {"concurrency": None, "mode": "replay", "speedup": args.speedup,
             "max_in_flight": run.max_in_flight}
        record = header | mode | summarize_level(run.results, run.duration_s, args.gpus)
        record["client_lag_p99_s"] = percentile(np.array(run.loop_lag_s), 99)
        record["processes"] = getattr(args, "processes", 1)
        warn_client_lag(record)
        emit(record, args.output)
        levels.append(record)
    return finish_sweep(args, header, levels)


def finish_sweep(args: argparse.Namespace, header: dict, levels: list[dict]) -> int:
    from splitserve.bench.plot import frontier_levels, plot_pareto

    front = frontier_levels(levels)
    if args.plot:
        what = header.get("scenario") or header.get("trace") or f"isl{header.get('isl')}/osl{header.get('osl')}"
        if header.get("range_ratio", 1.0) != 1.0:
            what += f" (range ratio {header['range_ratio']})"
        plot_pareto(levels, args.plot, f"{header['model']} | {what} | {args.label or header['api']}")
    keys = ("concurrency", "requests", "errors", "token_mismatches", "mean_input_len",
            "mean_output_len", "ttft_p50_s", "itl_p50_s", "e2e_p50_s", "output_tok_s",
            "output_tok_s_per_user", "output_tok_s_per_gpu")
    summary = {**header, "bench": "serve_summary",
               "levels": [{k: lv.get(k) for k in keys} for lv in levels],
               "pareto_concurrency": [lv["concurrency"] for lv in front],
               "max_output_tok_s_per_gpu": max((lv["output_tok_s_per_gpu"] for lv in levels), default=None),
               "total_requests": sum(lv["requests"] for lv in levels),
               "total_errors": sum(lv["errors"] for lv in levels),
               "total_token_mismatches": sum(lv["token_mismatches"] for lv in levels),
               "plot": args.plot}
    emit(summary, args.output)
    return 0


def event_loop_factory(url: str):
    if url.startswith("grpc://"):
        return None  # grpc.aio is only supported on the standard asyncio loop
    try:
        import uvloop
        return uvloop.new_event_loop
    except ImportError:
        return None


def main(args: argparse.Namespace) -> int:
    """Run the sweep; 0 when it ran (failed requests are reported, not fatal), 2 on bad input."""
    try:
        plan = make_plan(args)
        with asyncio.Runner(loop_factory=event_loop_factory(args.url)) as runner:
            return runner.run(run_sweep(args, plan))
    except BenchInputError as e:
        print(f"bench serve: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="splitserve bench serve", description=__doc__.split("\n")[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value

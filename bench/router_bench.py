"""Router benchmark: event ingest and routing decisions on one core, seeded. Prints JSON lines.

Fleet: ``--workers`` decode workers; ``--docs`` documents of ``--doc-blocks`` blocks (random
64-bit hashes standing in for chained block hashes), each starting with one of 16 shared
system prompts of 32 blocks; every worker caches ``--docs-per-worker`` whole documents, so the
index holds workers × docs_per_worker × doc_blocks (worker, block) entries (1M by default).

Ingest: the whole fleet state is published as BlockStored events of ``--event-blocks`` blocks
through PrefixIndex.apply (``--ingest-runs`` times into a fresh index, the median reported; and
again from encoded bytes through the codec), then churned
(remove + re-store). Decisions: Router.route + finished for 256-block prompts: a third whole
documents cached on one worker, a third a shared system prompt followed by an unseen tail, a
third unseen; each finished at once (an idle fleet: queues empty, many workers tie), then again
with ``--in-flight`` requests decoding (the KV policy's decode-delay term at work). A round-robin
router in the same process is the baseline for the per-decision overhead. ``--out`` appends the
JSON lines to a file.

Goals (issue 20, docs/router.md): ≥ 50k decisions/s with p99 ≤ 1 ms at 4k-token prompts, 64
workers, ≥ 1M indexed blocks; ≥ 1M block events/s ingest. Each phase's line says which it met
(``goal_met``). The decisions are the KV policy's (predicted TTFT, router/selection.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvstore.event_codec import decode_batch, encode_batch  # noqa: E402
from kvstore.events import BlockRemoved, BlockStored, KvEventBatch  # noqa: E402
from router import Router, RouterConfig, RoutingPolicy, WorkerRole  # noqa: E402
from splitserve.bench.records import cpu_model, git_sha  # noqa: E402

BLOCK_SIZE = 16
SYSTEM_BLOCKS = 32


def make_docs(rng: random.Random, num_docs: int, doc_blocks: int) -> list[list[int]]:
    systems = [[rng.getrandbits(64) for _ in range(SYSTEM_BLOCKS)] for _ in range(16)]
    return [rng.choice(systems) + [rng.getrandbits(64) for _ in range(doc_blocks - SYSTEM_BLOCKS)]
            for _ in range(num_docs)]


def fleet_batches(rng: random.Random, docs: list[list[int]], workers: list[str],
                  docs_per_worker: int, event_blocks: int) -> tuple[list[KvEventBatch], dict]:
    """Every worker's BlockStored events for its documents, batched 16 events per batch."""
    placement = {w: rng.sample(range(len(docs)), docs_per_worker) for w in workers}
    batches = []
    for w in workers:
        events = []
        for d in placement[w]:
            doc = docs[d]
            for i in range(0, len(doc), event_blocks):
                events.append(BlockStored(tuple(doc[i:i + event_blocks]),
                                          doc[i - 1] if i else None))
        for seq, i in enumerate(range(0, len(events), 16), start=1):
            batches.append(KvEventBatch(w, seq, events[i:i + 16]))
    return batches, placement


def count_blocks(batches: list[KvEventBatch]) -> tuple[int, int]:
    events = sum(len(b.events) for b in batches)
    blocks = sum(len(e.block_hashes) for b in batches for e in b.events)
    return events, blocks


def bench_ingest(batches: list[KvEventBatch], router: Router) -> float:
    t0 = time.perf_counter()
    for b in batches:
        router.apply_events(b)
    return time.perf_counter() - t0


def bench_churn(router: Router, placement: dict, docs: list[list[int]], event_blocks: int,
                rng: random.Random, num_ops: int) -> tuple[float, int, int]:
    """Remove and re-store random document tails: the steady state of an LRU pool."""
    batches, blocks = churn_batches(router, placement, docs, event_blocks, rng, num_ops)
    t0 = time.perf_counter()
    for b in batches:
        router.apply_events(b)
    return time.perf_counter() - t0, 2 * len(batches), blocks


def churn_batches(router: Router, placement: dict, docs: list[list[int]], event_blocks: int,
                  rng: random.Random, num_ops: int) -> tuple[list[KvEventBatch], int]:
    """``bench_churn``'s batches (one remove + re-store each) and their block count."""
    batches = []
    blocks = 0
    workers = list(placement)
    next_seq = {w: router.index.applied_seq(w) + 1 for w in workers}
    while blocks < num_ops:
        w = rng.choice(workers)
        doc = docs[rng.choice(placement[w])]
        tail = tuple(doc[-event_blocks:])
        batches.append(KvEventBatch(w, next_seq[w], [BlockRemoved(tail),
                                                      BlockStored(tail, doc[-event_blocks - 1])]))
        next_seq[w] += 1
        blocks += 2 * len(tail)
    return batches, blocks


def make_prompts(rng: random.Random, docs: list[list[int]], placement: dict, n: int,
                 prompt_blocks: int) -> list[tuple[str, list[int]]]:
    cached = sorted({d for ds in placement.values() for d in ds})
    systems = sorted({tuple(doc[:SYSTEM_BLOCKS]) for doc in docs})
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            hs = docs[rng.choice(cached)][:prompt_blocks]
        elif kind == 1:
            hs = list(rng.choice(systems)) + [rng.getrandbits(64)
                                              for _ in range(prompt_blocks - SYSTEM_BLOCKS)]
        else:
            hs = [rng.getrandbits(64) for _ in range(prompt_blocks)]
        out.append((("hit", "system", "miss")[kind], hs))
    return out


def bench_decisions(router: Router, prompts: list[tuple[str, list[int]]], in_flight: int = 0) -> dict:
    """Route each prompt and finish it at once, or (``in_flight`` > 0) mark its first token at
    once and finish it ``in_flight`` decisions later: the fleet then decodes that many requests,
    and the KV policy weighs the delay a prefill imposes on them."""
    times_ns: dict[str, list[int]] = {"hit": [], "system": [], "miss": []}
    clock = time.perf_counter_ns
    num_tokens = len(prompts[0][1]) * BLOCK_SIZE
    t0 = time.perf_counter()
    for i, (kind, hs) in enumerate(prompts):
        rid = str(i)
        s = clock()
        router.route(rid, hs, num_tokens, WorkerRole.DECODE)
        times_ns[kind].append(clock() - s)
        if in_flight:
            router.first_token(rid)
            if i >= in_flight:
                router.finished(str(i - in_flight))
        else:
            router.finished(rid)
    for i in range(max(0, len(prompts) - in_flight), len(prompts) if in_flight else 0):
        router.finished(str(i))
    wall_s = time.perf_counter() - t0
    every = sorted(t for ts in times_ns.values() for t in ts)
    out = {"decisions_per_s": round(len(prompts) / wall_s),
           "decision_p50_ms": round(pct(every, 50) / 1e6, 4),
           "decision_p99_ms": round(pct(every, 99) / 1e6, 4),
           "decision_max_ms": round(every[-1] / 1e6, 4)}
    for kind, ts in times_ns.items():
        ts.sort()
        out[f"decision_{kind}_p50_ms"] = round(pct(ts, 50) / 1e6, 4)
        out[f"decision_{kind}_p99_ms"] = round(pct(ts, 99) / 1e6, 4)
    return out


def pct(sorted_values: list[int], p: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * p / 100))]


def emit(out: str | None, record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def add_fleet_arguments(ap: argparse.ArgumentParser, decisions: int, cpu: int) -> None:
    """The fleet, its documents and the decision runs, as this bench and bench/router_ab.py build them."""
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--docs", type=int, default=4096)
    ap.add_argument("--doc-blocks", type=int, default=256)
    ap.add_argument("--docs-per-worker", type=int, default=72)
    ap.add_argument("--decisions", type=int, default=decisions)
    ap.add_argument("--in-flight", type=int, default=512,
                    help="requests decoding during the second decision run (first token out)")
    ap.add_argument("--cpu", type=int, default=cpu, help="core to pin to (-1: don't pin)")


def parse_fleet_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse, refuse a fleet that cannot be built, and pin to --cpu."""
    args = ap.parse_args()
    if min(args.workers, args.docs, args.doc_blocks, args.docs_per_worker, args.decisions) < 1 or args.in_flight < 0:
        ap.error("--workers, --docs, --doc-blocks, --docs-per-worker and --decisions must be >= 1, --in-flight >= 0")
    if args.docs_per_worker > args.docs:
        ap.error(f"--docs-per-worker {args.docs_per_worker} exceeds --docs {args.docs}")
    if args.cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    return args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_fleet_arguments(ap, decisions=60_000, cpu=0)
    ap.add_argument("--event-blocks", type=int, default=16)
    ap.add_argument("--ingest-runs", type=int, default=3,
                    help="times the fleet's events are ingested into a fresh index (the median is reported)")
    ap.add_argument("--out", help="also append the JSON lines to this file")
    args = parse_fleet_args(ap)
    if args.ingest_runs < 1 or args.event_blocks < 1:
        ap.error("--ingest-runs and --event-blocks must be >= 1")

    rng = random.Random(args.seed)
    workers = [f"decode-{i}" for i in range(args.workers)]

    def fresh_router(policy: RoutingPolicy = RoutingPolicy.KV) -> Router:
        r = Router(RouterConfig(policy=policy), block_size=BLOCK_SIZE, seed=args.seed)
        for w in workers:
            r.add_worker(w, WorkerRole.DECODE)
        return r

    docs = make_docs(rng, args.docs, args.doc_blocks)
    batches, placement = fleet_batches(rng, docs, workers, args.docs_per_worker, args.event_blocks)
    num_events, num_blocks = count_blocks(batches)
    base = {"bench": "router", "git_sha": git_sha(), "device": "cpu", "cores": 1,
            "host_load_avg_1m": round(os.getloadavg()[0], 2), "host_cpus": os.cpu_count(), "cpu_model": cpu_model(),
            "python": sys.version.split()[0], "seed": args.seed, "workers": args.workers,
            "block_size": BLOCK_SIZE}

    # The whole fleet's events into an empty index, --ingest-runs times (a fresh index each; the
    # last is kept): one run is about a second, and a host's moment moves it by tens of percent.
    ingest_runs = []
    for _ in range(args.ingest_runs):
        router = None
        gc.collect()
        router = fresh_router()
        ingest_runs.append(bench_ingest(batches, router))
    ingest_s = statistics.median(ingest_runs)
    encoded = [encode_batch(b) for b in batches]
    router_codec = fresh_router()
    t0 = time.perf_counter()
    for data in encoded:
        router_codec.apply_events(decode_batch(data))
    codec_ingest_s = time.perf_counter() - t0
    churn_s, churn_events, churn_blocks = bench_churn(router, placement, docs, args.event_blocks,
                                                      rng, 1_000_000)
    single = [KvEventBatch(b.worker_id, b.seq, [BlockStored((h,), None) for e in b.events
                                                for h in e.block_hashes]) for b in batches[:4000]]
    single_events = sum(len(b.events) for b in single)
    single_s = bench_ingest(single, fresh_router())
    emit(args.out, {**base, "phase": "ingest",
                      "indexed_blocks": router.index.num_entries(),
                      "distinct_hashes": router.index.num_hashes(),
                      "event_blocks": args.event_blocks,
                      "event_ingest_ops_per_s": round(num_blocks / ingest_s),
                      "event_ingest_ops_per_s_runs": [round(num_blocks / t) for t in ingest_runs],
                      "event_ingest_events_per_s": round(num_events / ingest_s),
                      "event_ingest_batches_per_s": round(len(batches) / ingest_s),
                      "codec_decode_and_ingest_ops_per_s": round(num_blocks / codec_ingest_s),
                      "churn_remove_store_ops_per_s": round(churn_blocks / churn_s),
                      "churn_events_per_s": round(churn_events / churn_s),
                      "single_block_events_per_s": round(single_events / single_s),
                      "goal_met": {"ingest_1M_blocks_per_s": num_blocks / ingest_s >= 1e6},
                      "encoded_bytes_per_block": round(sum(map(len, encoded)) / num_blocks, 2)})

    prompts = make_prompts(rng, docs, placement, args.decisions, args.doc_blocks)
    blocks_router = fresh_router(RoutingPolicy.KV_BLOCKS)   # the same fleet state, Dynamo's formula
    bench_ingest(batches, blocks_router)
    # A long-lived router should freeze its start-up heap too: a full collection over millions
    # of objects otherwise lands inside a decision as a multi-millisecond pause.
    del batches, encoded, single, router_codec
    gc.collect()
    gc.freeze()
    kv = bench_decisions(router, prompts)
    decoding = bench_decisions(router, prompts[: args.decisions // 3], args.in_flight)
    rr = bench_decisions(fresh_router(RoutingPolicy.ROUND_ROBIN), prompts[: args.decisions // 3])
    kv_blocks = bench_decisions(blocks_router, prompts[: args.decisions // 3])
    t0 = time.perf_counter()
    for _, hs in prompts:
        router.index.overlaps(hs)
    lookup_s = time.perf_counter() - t0
    emit(args.out, {**base, "phase": "decide", "indexed_blocks": router.index.num_entries(),
                      "prompt_tokens": args.doc_blocks * BLOCK_SIZE, "policy": "kv", **kv,
                      "index_lookups_per_s": round(len(prompts) / lookup_s),
                      "in_flight": args.in_flight,
                      "in_flight_decisions_per_s": decoding["decisions_per_s"],
                      "in_flight_decision_p50_ms": decoding["decision_p50_ms"],
                      "in_flight_decision_p99_ms": decoding["decision_p99_ms"],
                      "baseline_round_robin_decisions_per_s": rr["decisions_per_s"],
                      "kv_blocks_decisions_per_s": kv_blocks["decisions_per_s"],
                      "kv_blocks_decision_p99_ms": kv_blocks["decision_p99_ms"],
                      "kv_vs_round_robin_time_ratio": round(rr["decisions_per_s"]
                                                            / kv["decisions_per_s"], 2),
                      "goal_met": {"50k_decisions_per_s": kv["decisions_per_s"] >= 50_000,
                                   "p99_1ms": kv["decision_p99_ms"] <= 1.0}})


if __name__ == "__main__":
    main()

"""Router decision and ingest speed, A/B in one process: two source trees' ``router`` packages side by side.

A noisy host (a shared VM, a CI run beside it) moves one `router_bench` run's decisions/s by tens
of percent, which hides a change of that size. Here both trees' routers live in one process, get
the same fleet (router_bench's: ``--workers`` workers, their documents, the churn) and route the
same prompts in alternating chunks (A then B, B then A), so a slow moment hits both; each chunk's
B/A speed ratio is paired, and the medians are printed. The fleet's events are ingested the same
way (``ingest``: blocks/s in alternating chunks of ``--ingest-chunk`` batches of 16 16-block events),
then the churn (``churn``: remove + re-store, the same chunks). Two runs as in router_bench: an idle fleet
(each request finished at once) and ``--in-flight`` requests decoding. ``--clock thread`` counts
this thread's CPU time, not wall time, which discards time the process was not running.

Each tree must hold a ``router`` package; the bench and the rest of the code (kvstore) come from
this repository. The same decisions are asserted (``same_choices``): a speed-up must not move one.

    mkdir -p /tmp/base && git archive main | tar -x -C /tmp/base
    python bench/router_ab.py /tmp/base . --cpu 1
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import random
import statistics
import sys
import time
from types import ModuleType

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.router_bench import (BLOCK_SIZE, add_fleet_arguments, churn_batches, fleet_batches,  # noqa: E402
                                make_docs, make_prompts, parse_fleet_args)
from splitserve.bench.records import cpu_model, git_sha  # noqa: E402


def load_router(tree: str) -> ModuleType:
    """Import ``tree``'s router package as a fresh set of modules (the other tree's stay alive
    through the objects built from them)."""
    for name in [m for m in sys.modules if m == "router" or m.startswith("router.")]:
        del sys.modules[name]
    sys.path.insert(0, os.path.abspath(tree))
    try:
        module = importlib.import_module("router")
    finally:
        sys.path.pop(0)
    if not os.path.abspath(module.__file__).startswith(os.path.abspath(tree) + os.sep):
        raise SystemExit(f"{tree}: no router package there")
    return module


def paired(speed: dict[str, list[float]], unit: str) -> dict:
    """Medians of A's and B's chunk speeds and of their paired B/A ratios."""
    ratios = sorted(b / a for a, b in zip(speed["A"], speed["B"]))
    return {f"a_{unit}": round(statistics.median(speed["A"])),
            f"b_{unit}": round(statistics.median(speed["B"])),
            "b_over_a_paired_median": round(statistics.median(ratios), 3),
            "b_over_a_quartiles": [round(ratios[len(ratios) // 4], 3), round(ratios[3 * len(ratios) // 4], 3)],
            "chunks": len(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="source tree A (the baseline)")
    ap.add_argument("b", help="source tree B")
    add_fleet_arguments(ap, decisions=20_000, cpu=-1)
    ap.add_argument("--churn-blocks", type=int, default=1_000_000)
    ap.add_argument("--chunk", type=int, default=500, help="decisions per timed chunk")
    ap.add_argument("--ingest-chunk", type=int, default=64, help="event batches per timed ingest chunk")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the prompts per run")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    args = parse_fleet_args(ap)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time

    rng = random.Random(args.seed)
    workers = [f"decode-{i}" for i in range(args.workers)]
    docs = make_docs(rng, args.docs, args.doc_blocks)
    batches, placement = fleet_batches(rng, docs, workers, args.docs_per_worker, 16)
    prompts = [hs for _, hs in make_prompts(rng, docs, placement, args.decisions, args.doc_blocks)]
    routers = {}
    for tag, tree in (("A", args.a), ("B", args.b)):
        m = load_router(tree)
        r = m.Router(m.RouterConfig(policy=m.RoutingPolicy.KV), block_size=BLOCK_SIZE,
                     seed=args.seed)
        for w in workers:
            r.add_worker(w, m.WorkerRole.DECODE)
        routers[tag] = (r, m.WorkerRole.DECODE)

    def ingest(batches: list) -> dict[str, list[float]]:
        """The batches in alternating chunks (A then B, B then A): blocks/s per chunk."""
        speed: dict[str, list[float]] = {"A": [], "B": []}
        for k, lo in enumerate(range(0, len(batches), args.ingest_chunk)):
            part = batches[lo:lo + args.ingest_chunk]
            blocks = sum(len(e.block_hashes) for b in part for e in b.events)
            for tag in ("A", "B") if k % 2 == 0 else ("B", "A"):
                apply = routers[tag][0].apply_events
                t0 = clock()
                for b in part:
                    apply(b)
                speed[tag].append(blocks / max(clock() - t0, 1e-9))
        return speed

    stored = ingest(batches)
    # the same remove + re-store churn for both (their index states are alike, so are its seqs)
    churned = ingest(churn_batches(routers["A"][0], placement, docs, 16, random.Random(args.seed + 1),
                                   args.churn_blocks)[0])
    del batches
    gc.collect()
    gc.freeze()
    num_tokens = args.doc_blocks * BLOCK_SIZE
    chosen: dict[str, list[str]] = {"A": [], "B": []}

    def chunk(tag: str, lo: int, hi: int, in_flight: int, prefix: str) -> float:
        r, role = routers[tag]
        route, finished, first_token, out = r.route, r.finished, r.first_token, chosen[tag]
        t0 = clock()
        for i in range(lo, hi):
            rid = prefix + str(i)
            out.append(route(rid, prompts[i], num_tokens, role).worker_id)
            if not in_flight:
                finished(rid)
                continue
            first_token(rid)
            if i >= in_flight:
                finished(prefix + str(i - in_flight))
        return (hi - lo) / (clock() - t0)

    record = {"bench": "router_ab", "git_sha": git_sha(), "a": args.a, "b": args.b, "clock": args.clock,
              "workers": args.workers, "decisions": args.decisions, "rounds": args.rounds,
              "host_load_avg_1m": round(os.getloadavg()[0], 2), "cpu_model": cpu_model(),
              "ingest": paired(stored, "blocks_per_s"), "churn": paired(churned, "blocks_per_s"),
              "same_index": len({(r.index.num_entries(), r.index.num_hashes()) for r, _ in routers.values()}) == 1}
    for run, in_flight in (("idle", 0), ("decoding", args.in_flight)):
        speed: dict[str, list[float]] = {"A": [], "B": []}
        for rnd in range(args.rounds):
            prefix = f"{run}{rnd}-"
            for k, lo in enumerate(range(0, args.decisions, args.chunk)):
                hi = min(lo + args.chunk, args.decisions)
                for tag in ("A", "B") if k % 2 == 0 else ("B", "A"):
                    speed[tag].append(chunk(tag, lo, hi, in_flight, prefix))
            if in_flight:                       # the requests still decoding end
                for r, _ in routers.values():
                    for i in range(max(0, args.decisions - in_flight), args.decisions):
                        r.finished(prefix + str(i))
        record[run] = paired(speed, "decisions_per_s")
    record["same_choices"] = chosen["A"] == chosen["B"]
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()

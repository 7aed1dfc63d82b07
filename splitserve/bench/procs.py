"""`bench serve --processes N`: one level's clients split over N processes, their records merged.

A Python client is one event loop on one core: past a few hundred streams (or a few ten thousand
tokens/s) it reads chunks late, which inflates or squashes ITL (serve.py's `client_lag_p99_s`).
Here each of N spawned processes builds the level's requests itself (the same seed, so the same
list), takes every N-th one and its share of the concurrency, connects, says it is ready, and waits;
when all are ready they start together. Each sends its results back (`RequestResult`s, time stamps
from time.perf_counter, which on Linux is CLOCK_MONOTONIC and so one clock for every process); the
level's duration runs from the first start to the last end, and its loop lag is every process's.

It knows nothing of what the clients send: serve.py's `level_share` runs one process's share.
"""

from __future__ import annotations

import argparse
import multiprocessing

from splitserve.bench.clients import RequestResult


def shares(total: int, n: int) -> list[int]:
    """`total` split into `n` near-equal parts (the first ones one larger)."""
    return [total // n + (k < total % n) for k in range(n)]


def run_level_processes(share, args: argparse.Namespace, model: str, concurrency: int | None, salt: int, n: int):
    """The level run by `n` processes, each `share(conn, args, model, concurrency, salt, k, n)` (a
    module-level function: serve.py's `level_share`); returns (results, duration_s, max_in_flight,
    loop_lag_s)."""
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    args = argparse.Namespace(**{**vars(args), "no_progress": True})
    for k in range(n):
        parent, end = ctx.Pipe()
        p = ctx.Process(target=share, args=(end, args, model, concurrency, salt, k, n), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    try:
        for c in pipes:
            if c.recv() != "ready":
                raise RuntimeError("a client process failed to start")
        for c in pipes:
            c.send("go")
        outs = [c.recv() for c in pipes]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    results: list[RequestResult] = [r for o in outs for r in o[2]]
    duration_s = max(o[1] for o in outs) - min(o[0] for o in outs)
    return results, duration_s, sum(o[4] for o in outs), [x for o in outs for x in o[3]]
